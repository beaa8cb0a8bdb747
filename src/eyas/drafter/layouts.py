"""The three on-disk layouts of an EAGLE-3 drafter, each with its reader and its writer, and the layer ids.

Layouts (everything is read into one `DrafterConfig` plus weights keyed by SGLang's names, which are
eyas's own; `Provenance` records where they came from):

| | eyas (`eyas train`) | SGLang (`LlamaForCausalLMEagle3`) | vLLM / speculators (`Eagle3Speculator`) |
|---|---|---|---|
| config | `{"schema": "eyas.drafter/1", "drafter": DrafterConfig}` | Llama fields at top level | Llama fields in `transformer_layer_config` |
| layer keys | `midlayer.*` | `midlayer.*` | `layers.0.*` |
| aux layer ids | `aux_layer_ids`, hf-input | `eagle_config.eagle_aux_hidden_state_layer_ids`, id k = OUTPUT of layer k | top-level `eagle_aux_hidden_state_layer_ids`, hf-input |
| residual | the raw feature | the raw feature | `norm_before_residual` (absent = true) |
| full vocabulary | d2t = 0, t2d all true | no d2t/t2d (`hot_token_id` stays None) | no d2t/t2d (no `draft_id_to_target_id` then) |

Layer ids. eyas's convention ("hf-input"): id i = the INPUT to decoder layer i = Hugging Face
`output_hidden_states[i]`; vLLM uses the same. SGLang's id k is the OUTPUT of layer k, captured before
layer k + 1, so Llama & co write i - 1; its DeepSeek-V2/V3 models add the 1 only when the first id
is 1 (and use the ids as they are otherwise). `engine_layer_ids` / `eyas_layer_ids` are the one
conversion and its inverse; `default_aux_layer_ids` (2, N//2, N-3) and `check_layer_ids` (1..N-1,
the ids both engines can capture) are the one default and the one range check.

Unknown weight keys are an error when reading, not skipped as the engines do: a wrong prefix would
otherwise serve a randomly initialised layer. Run: `eyas export --drafter DIR --format sglang|vllm --out DIR`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.drafter.model import DrafterConfig

CONVENTION = "hf-input"  # id i = input to decoder layer i = output_hidden_states[i]
ENGINES = ("sglang", "vllm")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")  # Kimi wraps DeepSeek-V3 (same rule)
SCHEMA = "eyas.drafter/1"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

# The weight keys of one EAGLE-3 draft layer, SGLang naming (= eyas's Eagle3Drafter state_dict).
LAYER_KEYS = (
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)
REQUIRED_KEYS = ("fc.weight", *LAYER_KEYS, "norm.weight", "lm_head.weight")
OPTIONAL_KEYS = ("embed_tokens.weight", "d2t", "t2d")
# Present in some speculators checkpoints, never used at inference.
IGNORED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight")


# ----------------------------------------------------------------------------------------------
# layer ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high: the inputs to layers 2, N//2 and N-3."""
    if num_layers < 4:
        raise EyasError(f"the target has {num_layers} layers; EAGLE-3's default aux layers need at least 4")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, *, what: str = "aux layer ids") -> list[int]:
    """Aux ids must be inputs to existing layers after the first: 1 <= i <= N-1 (0 is the embeddings,
    which neither engine can capture; N would be the final output). Returns them as ints."""
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if not 1 <= i < num_layers]
    if not ids or bad:
        raise EyasError(
            f"{what}: ids {ids} {'include ' + str(bad) + ', ' if bad else 'are empty, '}expected inputs to decoder "
            f"layers 1..{num_layers - 1} of a {num_layers}-layer target (convention {CONVENTION})")
    return ids


def engine_layer_ids(ours: Sequence[int], engine: str, *, model_type: str | None = None) -> list[int]:
    """eyas ids (input of layer i) -> the ids `engine` is configured with.

    vLLM: the same. SGLang: id k = output of layer k, so i - 1; for DeepSeek-V2/V3 recent SGLang adds
    the 1 only when the first id is 1 (older SGLang always adds it): ours starting at 2 is written
    i - 1 (right under both rules), any other first id as is (the recent rule), and a first id of 1
    cannot be expressed at all.
    """
    ours = [int(i) for i in ours]
    if engine == "vllm":
        return ours
    if engine != "sglang":
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    bad = [i for i in ours if i < 1]
    if bad:
        raise EyasError(f"aux layer id(s) {bad} (input to layer 0 = the embeddings) cannot be written in SGLang's "
                        "convention (id = output of a layer)")
    if model_type in DEEPSEEK_TYPES and ours and ours[0] != 2:
        if ours[0] == 1:
            raise EyasError(f"aux layer ids {ours}: no SGLang id list makes its DeepSeek models capture the input of "
                            "layer 1 first (a first id of 1 is shifted to 2, a first id of 0 is kept as 0); train "
                            "with another low layer (the default is 2)")
        return ours
    return [i - 1 for i in ours]


def eyas_layer_ids(ids: Sequence[int], engine: str, *, model_type: str | None = None) -> list[int]:
    """The inverse of `engine_layer_ids`: ids as `engine` reads them -> eyas ids (input of layer i)."""
    ids = [int(k) for k in ids]
    if engine == "vllm":
        return ids
    if engine != "sglang":
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    if model_type in DEEPSEEK_TYPES and ids and ids[0] != 1:
        return ids
    return [k + 1 for k in ids]


# ----------------------------------------------------------------------------------------------
# what was read


@dataclass(kw_only=True)
class Provenance:
    """Where a drafter was read from (kept apart from the config: it does not change the model)."""

    format: str = "eyas"
    """Layout it was read from: eyas, sglang or speculators."""
    layer_ids: list[int] | None = None
    """Layer ids exactly as written in the source config (its own convention), if any."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DraftCheckpoint:
    config: DrafterConfig
    weights: dict[str, torch.Tensor]  # SGLang key names, CPU tensors; d2t int64 and t2d bool always present
    path: Path
    provenance: Provenance


# ----------------------------------------------------------------------------------------------
# small readers


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise EyasError(f"--drafter {path.parent}: no {path.name}; expected an eyas, SGLang or vLLM/speculators "
                        f"drafter directory ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EyasError(f"--drafter {path}: not valid JSON ({exc})") from exc


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of *.safetensors (or pytorch_model*.bin) in `directory`, on CPU."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            weights.update(load_file(str(f)))
        return weights
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise EyasError(f"--drafter {directory}: no *.safetensors or pytorch_model*.bin weights found")
    for f in bins:
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return weights


def rope_parameters_of(llama_like: dict[str, Any]) -> dict[str, Any]:
    """One rope dict (`rope_type`, `rope_theta`, scaling fields) from a Llama-style config dict, old
    (`rope_theta` + `rope_scaling`) or new (`rope_parameters`) keys."""
    rp = llama_like.get("rope_parameters")
    out = dict(rp) if isinstance(rp, dict) else dict(llama_like.get("rope_scaling") or {})
    if "rope_theta" not in out or out["rope_theta"] is None:
        out["rope_theta"] = float(llama_like.get("rope_theta") or 10000.0)
    out["rope_theta"] = float(out["rope_theta"])
    out.setdefault("rope_type", out.pop("type", "default"))
    return out


def llama_dims(cfg: dict[str, Any], *, where: str, max_positions: int = 8192) -> dict[str, Any]:
    """The DrafterConfig fields a Llama-style config dict gives (also a target's)."""
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope_parameters_of(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", max_positions)),
            vocab_size=int(cfg["vocab_size"]),
        )
    except KeyError as exc:
        raise EyasError(f"{where}: config lacks {exc.args[0]!r}; cannot build the draft layer") from exc


def _check_single_llama_layer(cfg: dict[str, Any], *, where: str) -> None:
    n = int(cfg.get("num_hidden_layers", 1))
    if n != 1:
        raise EyasError(f"--drafter {where}: num_hidden_layers={n}; eyas evaluates single-layer EAGLE-3 drafters only")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise EyasError(f"--drafter {where}: hidden_act={act!r}; the EAGLE-3 draft layer uses silu")


def detect_format(cfg: dict[str, Any], *, where: str | Path) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") is not None or "Eagle3Speculator" in archs:
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs or "Eagle3LlamaForCausalLM" in archs:
        return "sglang"
    if str(cfg.get("schema", "")).startswith("eyas") or "drafter" in cfg:
        return "eyas"
    raise EyasError(
        f"--drafter {where}: cannot tell the drafter layout (architectures={archs}); expected eyas "
        "(schema eyas.drafter/1), SGLang (LlamaForCausalLMEagle3) or speculators (speculators_model_type)"
    )


def _build(**values) -> DrafterConfig:
    from eyas.drafter.model import DrafterConfig

    try:
        return DrafterConfig(**values)
    except (TypeError, ValueError) as exc:
        raise EyasError(f"drafter config: {exc}") from exc


def _default_ids(target_layers: int | None, *, where: str) -> list[int]:
    if target_layers is None:
        raise EyasError(f"--drafter {where}: the config names no aux layer ids and no target was given to derive the default")
    return default_aux_layer_ids(target_layers)


# ----------------------------------------------------------------------------------------------
# per-layout config readers


def _config_from_sglang(cfg: dict[str, Any], *, where: str, target_layers: int | None,
                        target_model_type: str | None) -> tuple[DrafterConfig, Provenance]:
    _check_single_llama_layer(cfg, where=where)
    dims = llama_dims(cfg, where=f"--drafter {where}")
    sgl_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sgl_ids:
        ours, source = eyas_layer_ids(sgl_ids, "sglang", model_type=target_model_type), list(sgl_ids)
    elif top_ids:  # vLLM reads this key from the same layout, in its own (= our) convention
        ours, source = eyas_layer_ids(top_ids, "vllm"), list(top_ids)
    else:
        ours, source = _default_ids(target_layers, where=where), None
    config = _build(
        **dims,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or dims["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or dims["hidden_size"]),
        aux_layer_ids=ours,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        target_num_layers=target_layers,
        target_model_type=target_model_type,
    )
    return config, Provenance(format="sglang", layer_ids=source)


def _speculators_layer(cfg: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The draft layer's Llama config of a speculators config, after refusing the variants eyas does not read."""
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise EyasError(f"--drafter {where}: speculators_model_type={cfg.get('speculators_model_type')!r}; only eagle3 is supported")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag):
            raise EyasError(f"--drafter {where}: {flag}=true is a speculators variant eyas does not evaluate")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EyasError(f"--drafter {where}: speculators config without a transformer_layer_config object")
    _check_single_llama_layer(layer, where=where)
    return layer


def _config_from_speculators(cfg: dict[str, Any], *, where: str, target_layers: int | None,
                             target_model_type: str | None) -> tuple[DrafterConfig, Provenance]:
    layer = _speculators_layer(cfg, where=where)
    dims = llama_dims(layer, where=f"--drafter {where}")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    config = _build(
        **dims,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or dims["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or dims["hidden_size"]),
        aux_layer_ids=eyas_layer_ids(ids, "vllm") if ids else _default_ids(target_layers, where=where),
        # vLLM's reader defaults this to True when absent
        norm_before_residual=bool(cfg.get("norm_before_residual", True)),
        target_num_layers=target_layers,
        target_model_type=target_model_type,
    )
    return config, Provenance(format="speculators", layer_ids=list(ids) if ids else None)


def read_eyas_config(directory: str | Path) -> tuple[DrafterConfig, dict[str, Any]]:
    """(DrafterConfig, the whole config.json) of an eyas drafter directory, without its weights."""
    directory = Path(directory)
    meta = _read_json(directory / CONFIG_FILE, what="an eyas drafter is written by `eyas train`")
    return _eyas_config(meta, directory), meta


def _eyas_config(meta: dict[str, Any], directory: Path) -> DrafterConfig:
    """The DrafterConfig in `meta`, the config.json of the eyas drafter `directory` (read once by the caller)."""
    from eyas.drafter.model import DrafterConfig

    if meta.get("schema") != SCHEMA or not isinstance(meta.get("drafter"), dict):
        raise EyasError(f"{directory / CONFIG_FILE}: schema {meta.get('schema')!r}, expected {SCHEMA!r} with a "
                        "`drafter` object; train one with `eyas train`")
    try:
        return DrafterConfig.from_dict(meta["drafter"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EyasError(f"--drafter {directory}: config.json is not a valid eyas drafter config ({exc})") from exc


# ----------------------------------------------------------------------------------------------
# weights


def canonical_weights(raw: dict[str, torch.Tensor], *, where: str) -> dict[str, torch.Tensor]:
    """Rename to SGLang's keys; refuse unknown keys, report missing ones."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in raw.items():
        key = name[len("model."):] if name.startswith("model.") else name
        key = key.replace("layers.0.", "midlayer.", 1) if key.startswith("layers.0.") else key
        if key in IGNORED_KEYS:
            continue
        if key not in REQUIRED_KEYS and key not in OPTIONAL_KEYS:
            unknown.append(name)
            continue
        out[key] = tensor
    if unknown:
        raise EyasError(
            f"--drafter {where}: weight keys eyas does not know: {sorted(unknown)[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}; expected SGLang (midlayer.*) or speculators (layers.0.*) names"
        )
    missing = [k for k in REQUIRED_KEYS if k not in out]
    if missing:
        raise EyasError(f"--drafter {where}: missing weights {missing}")
    return out


def complete_vocab_maps(config: DrafterConfig, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Fill d2t/t2d when a full-vocabulary drafter omits them; check that they agree."""
    from eyas.drafter.vocab import target_ids_of, vocab_maps

    vd, v = config.draft_vocab_size, config.vocab_size
    if weights["lm_head.weight"].shape[0] != vd:
        raise EyasError(f"--drafter {where}: lm_head has {weights['lm_head.weight'].shape[0]} rows but draft_vocab_size={vd}")
    if "d2t" not in weights:
        if vd != v:
            raise EyasError(f"--drafter {where}: no d2t map but draft_vocab_size {vd} != vocab_size {v}")
        weights["d2t"] = torch.zeros(vd, dtype=torch.long)
    d2t = weights["d2t"].to(torch.long)
    if d2t.shape != (vd,):
        raise EyasError(f"--drafter {where}: d2t has shape {tuple(d2t.shape)}, expected ({vd},)")
    used = target_ids_of(d2t)
    if used.min() < 0 or used.max() >= v:
        raise EyasError(f"--drafter {where}: d2t maps draft ids outside the target vocabulary 0..{v - 1}")
    d2t, t2d = vocab_maps(used, v)
    if "t2d" in weights and not torch.equal(weights["t2d"].to(torch.bool), t2d):
        raise EyasError(f"--drafter {where}: t2d disagrees with d2t (they must mark the same target ids)")
    weights["d2t"], weights["t2d"] = d2t, t2d


def is_full_vocab(config: DrafterConfig, weights: dict[str, torch.Tensor]) -> bool:
    """Draft vocab == target vocab with the identity map: the engines then expect no d2t/t2d."""
    return config.draft_vocab_size == config.vocab_size and not bool(weights["d2t"].any())


def expected_shapes(config: DrafterConfig, *, with_embed: bool) -> dict[str, tuple[int, ...]]:
    c = config
    h, hd, nh, nkv, i = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    shapes = {
        "fc.weight": (h, c.fc_in_features),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
    }
    if with_embed:
        shapes["embed_tokens.weight"] = (c.vocab_size, h)
    return shapes


def check_shapes(config: DrafterConfig, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Every weight has the shape the config implies (catches a config that does not match its weights)."""
    for key, shape in expected_shapes(config, with_embed="embed_tokens.weight" in weights).items():
        got = tuple(weights[key].shape)
        if got != shape:
            raise EyasError(f"--drafter {where}: {key} has shape {got}, the config implies {shape}")


# ----------------------------------------------------------------------------------------------
# reading any layout


def read_drafter(directory: str | Path, *, target_layers: int | None = None,
                 target_model_type: str | None = None) -> DraftCheckpoint:
    """Read any supported drafter directory; `target_layers` supplies default aux ids when needed,
    `target_model_type` the conversion rule of SGLang ids (DeepSeek differs)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise EyasError(f"--drafter {directory}: not a directory")
    where = str(directory)
    cfg = _read_json(directory / CONFIG_FILE, what="config.json names the layout")
    fmt = detect_format(cfg, where=directory / CONFIG_FILE)
    if fmt == "eyas":
        config = _eyas_config(cfg, directory)
        provenance = Provenance(format="eyas", layer_ids=list(config.aux_layer_ids))
    elif fmt == "sglang":
        config, provenance = _config_from_sglang(cfg, where=where, target_layers=target_layers,
                                                 target_model_type=target_model_type)
    else:
        config, provenance = _config_from_speculators(cfg, where=where, target_layers=target_layers,
                                                      target_model_type=target_model_type)
    if target_model_type and not config.target_model_type:
        config.target_model_type = target_model_type
    weights = canonical_weights(read_weights(directory), where=where)
    complete_vocab_maps(config, weights, where=where)
    check_shapes(config, weights, where=where)
    return DraftCheckpoint(config=config, weights=weights, path=directory, provenance=provenance)


def check_drafter_dir(directory: str | Path) -> str:
    """Refuse a drafter directory that `read_drafter` would refuse for its config or its missing weights,
    reading config.json only (so eval and generate fail before the target loads); returns the layout."""
    directory = Path(directory)
    if not directory.is_dir():
        raise EyasError(f"--drafter {directory}: not a directory (expected `eyas train`'s <out>/drafter or an "
                        "`eyas export` directory)")
    path = directory / CONFIG_FILE
    cfg = _read_json(path, what="config.json names the layout")
    if not isinstance(cfg, dict):
        raise EyasError(f"--drafter {path}: expected a JSON object, got {type(cfg).__name__}")
    fmt = detect_format(cfg, where=path)
    if fmt == "eyas":
        _eyas_config(cfg, directory)
    elif fmt == "sglang":
        _check_single_llama_layer(cfg, where=str(directory))
        llama_dims(cfg, where=f"--drafter {path}")
    else:
        llama_dims(_speculators_layer(cfg, where=str(directory)), where=f"--drafter {path}")
    if not any(directory.glob("*.safetensors")) and not any(directory.glob("pytorch_model*.bin")):
        raise EyasError(f"--drafter {directory}: no *.safetensors or pytorch_model*.bin weights found")
    return fmt


def check_against_target(config: DrafterConfig, target_config, *, where: str) -> None:
    """A drafter built for another target fails here with the mismatch named."""
    from eyas.target import hidden_size_of, num_layers_of

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    v, h, n = int(text.vocab_size), hidden_size_of(target_config), num_layers_of(target_config)
    if config.vocab_size != v:
        raise EyasError(
            f"--drafter {where}: built for a target vocabulary of {config.vocab_size} tokens, but the target has {v}; "
            "evaluate it against the target it was trained for"
        )
    if config.target_hidden_size != h:
        raise EyasError(
            f"--drafter {where}: expects target features of width {config.target_hidden_size}, but the target's hidden "
            f"size is {h}; evaluate it against the target it was trained for"
        )
    check_layer_ids(config.aux_layer_ids, n, what=f"--drafter {where}: aux layer ids")


# ----------------------------------------------------------------------------------------------
# writers


def write_eyas(out_dir: str | Path, config: DrafterConfig, weights: dict[str, torch.Tensor], *,
               target: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """The eyas layout: config.json (every DrafterConfig field + target identity) and model.safetensors."""
    from safetensors.torch import save_file

    from eyas.common import honour_umask

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_file(sd, str(out / WEIGHTS_FILE), metadata={"format": "pt", "schema": SCHEMA})
    honour_umask(out / WEIGHTS_FILE)
    meta = {"schema": SCHEMA, "drafter": config.to_dict(), "target": target or {}, **(extra or {})}
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def speculators_key(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _rope_fields(config: DrafterConfig) -> dict[str, Any]:
    """Old (`rope_theta`, `rope_scaling`) and new (`rope_parameters`) keys, consistent with each other."""
    rp = dict(config.rope_parameters)
    theta = float(rp["rope_theta"])
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": rp}


def llama_layer_config(config: DrafterConfig, *, dtype: str) -> dict[str, Any]:
    c = config
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        **_rope_fields(c),
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def sglang_config(config: DrafterConfig, *, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_layer_config(config, dtype=dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_layer_ids(config.aux_layer_ids, "sglang",
                                                                 model_type=config.target_model_type),
            "use_aux_hidden_state": True,
        },
    }


def vllm_config(config: DrafterConfig, *, dtype: str, verifier: str | None, speculative_tokens: int,
                verifier_architectures: list[str] | None = None, verifier_path: str | None = None) -> dict[str, Any]:
    """The speculators layout. `verifier` is what `vllm serve <dir>` serves as the target (a Hub id);
    `verifier_path` the local target directory, kept where vLLM does not look."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_config(config, dtype=dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": bool(config.norm_before_residual),
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(config.aux_layer_ids, "vllm"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures or ["LlamaForCausalLM"]},
        },
        "eyas_verifier_path": verifier_path,
        "torch_dtype": dtype,
    }


def engine_weights(weights: dict[str, torch.Tensor], fmt: str, *, dtype: torch.dtype | None,
                   full_vocab: bool = False) -> dict[str, torch.Tensor]:
    """Rename for `fmt` (sglang | vllm); float tensors cast to `dtype` (None keeps theirs); d2t int64,
    t2d bool, both left out for a full-vocabulary drafter (vLLM has no parameter to load d2t into then)."""
    out = {}
    for name, t in weights.items():
        if full_vocab and name in ("d2t", "t2d"):
            continue
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif dtype is not None:
            t = t.to(dtype)
        out[name if fmt == "sglang" else speculators_key(name)] = t.detach().cpu().contiguous()
    return out


def write_engine_layout(ckpt: DraftCheckpoint, fmt: str, out_dir: Path, *, dtype: torch.dtype | None = None,
                        verifier: str | None = None, verifier_architectures: list[str] | None = None,
                        verifier_path: str | None = None, speculative_tokens: int = 3) -> dict[str, Any]:
    """Write config.json + model.safetensors for `fmt` into `out_dir`; returns what was written
    (config, weight keys, dtype name, full_vocab)."""
    from safetensors.torch import save_file

    from eyas.common import honour_umask

    if fmt not in ENGINES:
        raise EyasError(f"--format {fmt!r}: expected one of {', '.join(ENGINES)}")
    config = ckpt.config
    if len(config.aux_layer_ids) != 3:
        # both engines size fc as 3 x target_hidden_size (SGLang LlamaModel, vLLM Eagle3 LlamaModel)
        raise EyasError(f"the drafter reads {len(config.aux_layer_ids)} aux layers {config.aux_layer_ids}; SGLang and "
                        "vLLM serve EAGLE-3 drafters with exactly 3 (low, mid, high)")
    full_vocab = is_full_vocab(config, ckpt.weights)
    weights = engine_weights(ckpt.weights, fmt, dtype=dtype, full_vocab=full_vocab)
    float_dtypes = {str(t.dtype).replace("torch.", "") for t in weights.values() if t.is_floating_point()}
    dtype_name = sorted(float_dtypes)[0] if len(float_dtypes) == 1 else "float32"
    if fmt == "sglang":
        cfg = sglang_config(config, dtype=dtype_name)
    else:
        cfg = vllm_config(config, dtype=dtype_name, verifier=verifier, speculative_tokens=speculative_tokens,
                          verifier_architectures=verifier_architectures, verifier_path=verifier_path)
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    honour_umask(out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    return {"config": cfg, "keys": sorted(weights), "dtype": dtype_name, "full_vocab": full_vocab}
