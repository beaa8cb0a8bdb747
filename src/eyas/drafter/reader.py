"""Reading a drafter in any of the three layouts (drafter/layouts.py) into one `DrafterConfig` plus weights keyed
by SGLang's names, and the checks made on what was read: weight shapes against the config, the vocabulary maps,
the drafter against a target.

Unknown weight keys are an error when reading, not skipped as the engines do: a wrong prefix would
otherwise serve a randomly initialised layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.drafter.layouts import (
    CONFIG_FILE,
    IGNORED_KEYS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    SCHEMA,
    DraftCheckpoint,
    Provenance,
    check_layer_ids,
    default_aux_layer_ids,
    eyas_layer_ids,
)
from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.drafter.model import DrafterConfig


# ----------------------------------------------------------------------------------------------
# small readers


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise EyasError(
            f"--drafter {path.parent}: no {path.name}; expected an eyas, SGLang or vLLM/speculators "
            f"drafter directory ({what})"
        )
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
        raise EyasError(
            f"--drafter {where}: the config names no aux layer ids and no target was given to derive the default"
        )
    return default_aux_layer_ids(target_layers)


# ----------------------------------------------------------------------------------------------
# per-layout config readers


def _config_from_sglang(
    cfg: dict[str, Any], *, where: str, target_layers: int | None, target_model_type: str | None
) -> tuple[DrafterConfig, Provenance]:
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
        raise EyasError(
            f"--drafter {where}: speculators_model_type={cfg.get('speculators_model_type')!r}; only eagle3 is supported"
        )
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag):
            raise EyasError(f"--drafter {where}: {flag}=true is a speculators variant eyas does not evaluate")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EyasError(f"--drafter {where}: speculators config without a transformer_layer_config object")
    _check_single_llama_layer(layer, where=where)
    return layer


def _config_from_speculators(
    cfg: dict[str, Any], *, where: str, target_layers: int | None, target_model_type: str | None
) -> tuple[DrafterConfig, Provenance]:
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
        raise EyasError(
            f"{directory / CONFIG_FILE}: schema {meta.get('schema')!r}, expected {SCHEMA!r} with a "
            "`drafter` object; train one with `eyas train`"
        )
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
        key = name[len("model.") :] if name.startswith("model.") else name
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
        raise EyasError(
            f"--drafter {where}: lm_head has {weights['lm_head.weight'].shape[0]} rows but draft_vocab_size={vd}"
        )
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


def read_drafter(
    directory: str | Path, *, target_layers: int | None = None, target_model_type: str | None = None
) -> DraftCheckpoint:
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
        config, provenance = _config_from_sglang(
            cfg, where=where, target_layers=target_layers, target_model_type=target_model_type
        )
    else:
        config, provenance = _config_from_speculators(
            cfg, where=where, target_layers=target_layers, target_model_type=target_model_type
        )
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
        raise EyasError(
            f"--drafter {directory}: not a directory (expected `eyas train`'s <out>/drafter or an "
            "`eyas export` directory)"
        )
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
