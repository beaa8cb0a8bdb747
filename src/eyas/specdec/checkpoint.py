"""Read an EAGLE-3 drafter from any of the three layouts into one spec and one set of weight names.

Layouts read (FIELD.md sections 2-3):
- eyas: `config.json` with the DrafterConfig fields (aux layer ids in convention "hf-input") and
  `model.safetensors` whose keys are SGLang's.
- SGLang (also what EAGLE's authors and SpecForge publish): `architectures: ["LlamaForCausalLMEagle3"]`,
  keys `midlayer.*`, `fc.weight`, ...; layer ids in `eagle_config.eagle_aux_hidden_state_layer_ids`,
  id k = OUTPUT of layer k, so ours = k + 1. Weights may be `pytorch_model.bin`.
- vLLM/speculators: `speculators_model_type: "eagle3"`, the Llama shape in `transformer_layer_config`,
  keys `layers.0.*`, top-level `eagle_aux_hidden_state_layer_ids` in vLLM's convention (= ours).

Everything comes out as (`DraftSpec`, weights keyed by SGLang's names, which are eyas's). Unknown weight
keys are an error here, not silently skipped as the engines do: a wrong prefix would otherwise
evaluate a randomly initialised layer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError

CONVENTION = "hf-input"  # same as eyas.target.CONVENTION (kept literal: no torch-free import cycle)

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


@dataclass(kw_only=True)
class DraftSpec:
    """Everything needed to run an EAGLE-3 draft layer, independent of the checkpoint layout."""

    hidden_size: int
    """Draft hidden size H (the draft layer's residual width)."""
    num_attention_heads: int
    """Query heads of the draft attention."""
    num_key_value_heads: int
    """Key/value heads (GQA when fewer than the query heads)."""
    head_dim: int
    """Width of one head; q/k/v map 2H -> heads * head_dim."""
    intermediate_size: int
    """SwiGLU MLP width."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_parameters: dict[str, Any]
    """Hugging Face rope parameters (`rope_type`, `rope_theta`, scaling fields)."""
    max_position_embeddings: int
    """Positions the draft's RoPE was configured for."""
    vocab_size: int
    """The TARGET's vocabulary size (embedding rows, t2d length)."""
    draft_vocab_size: int
    """Rows of lm_head; draft id i is target id i + d2t[i]."""
    target_hidden_size: int
    """Width of one target feature; fc maps len(aux_layer_ids) * target_hidden_size -> H."""
    aux_layer_ids: list[int]
    """Target layers whose INPUT is captured (eyas convention "hf-input"), low to high."""
    norm_before_residual: bool = False
    """speculators' variant: the residual is the normalised feature. EAGLE-3/SGLang: False."""
    source_format: str = "eyas"
    """Layout the drafter was read from: eyas, sglang or speculators."""
    source_layer_ids: list[int] | None = field(default=None)
    """Layer ids exactly as written in the source config (its own convention), if any."""
    target_model_type: str | None = None
    """The target's HF model_type when known (SGLang converts DeepSeek ids differently)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# small readers


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise EyasError(f"--drafter {directory}: no config.json; expected an eyas, SGLang or vLLM/speculators drafter directory")
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


def _rope_parameters(llama_like: dict[str, Any]) -> dict[str, Any]:
    """rope parameters from a Llama-style config dict, old (`rope_theta`/`rope_scaling`) or new keys."""
    rp = llama_like.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        out = dict(rp)
    else:
        out = dict(llama_like.get("rope_scaling") or {})
        out["rope_theta"] = float(llama_like.get("rope_theta", 10000.0))
    out.setdefault("rope_type", out.pop("type", "default") if "type" in out else "default")
    return out


def _llama_dims(cfg: dict[str, Any], *, where: str) -> dict[str, Any]:
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
            rope_parameters=_rope_parameters(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            vocab_size=int(cfg["vocab_size"]),
        )
    except KeyError as exc:
        raise EyasError(f"--drafter {where}: config lacks {exc.args[0]!r}; cannot build the draft layer") from exc


def _check_single_llama_layer(cfg: dict[str, Any], *, where: str) -> None:
    n = int(cfg.get("num_hidden_layers", 1))
    if n != 1:
        raise EyasError(f"--drafter {where}: num_hidden_layers={n}; eyas evaluates single-layer EAGLE-3 drafters only")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise EyasError(f"--drafter {where}: hidden_act={act!r}; the EAGLE-3 draft layer uses silu")


# ----------------------------------------------------------------------------------------------
# per-layout spec readers


def detect_format(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") is not None or "Eagle3Speculator" in archs:
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs or "Eagle3LlamaForCausalLM" in archs:
        return "sglang"
    if str(cfg.get("convention", "")) == CONVENTION or "aux_layer_ids" in cfg or str(cfg.get("schema", "")).startswith("eyas"):
        return "eyas"
    raise EyasError(
        f"config.json: cannot tell the drafter layout (architectures={archs}); expected eyas "
        "(aux_layer_ids + convention), SGLang (LlamaForCausalLMEagle3) or speculators (speculators_model_type)"
    )


DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")


def from_sglang_layer_ids(ids: list[int], target_model_type: str | None) -> list[int]:
    """SGLang's ids -> ours. Llama & co: ours = k + 1. DeepSeek-V2/V3 in recent SGLang adds the 1 only when
    the first id is 1 and otherwise uses the ids as they are (input-of-layer ids, like ours)."""
    if target_model_type in DEEPSEEK_TYPES and ids and ids[0] != 1:
        return list(ids)
    return [k + 1 for k in ids]


def _spec_from_sglang(cfg: dict[str, Any], *, where: str, target_layers: int | None,
                      target_model_type: str | None = None) -> DraftSpec:
    _check_single_llama_layer(cfg, where=where)
    dims = _llama_dims(cfg, where=where)
    eagle = cfg.get("eagle_config") or {}
    sgl_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    top_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sgl_ids:  # SGLang: id k = output of layer k = input to layer k + 1 (but see DeepSeek)
        ours, source = from_sglang_layer_ids([int(i) for i in sgl_ids], target_model_type), list(sgl_ids)
    elif top_ids:  # vLLM reads this key from the same layout, in its own (= our) convention
        ours, source = [int(i) for i in top_ids], list(top_ids)
    else:
        ours, source = _default_ids(target_layers, where=where), None
    return DraftSpec(
        **dims,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or dims["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or dims["hidden_size"]),
        aux_layer_ids=ours,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        source_format="sglang",
        source_layer_ids=source,
        target_model_type=target_model_type,
    )


def _spec_from_speculators(cfg: dict[str, Any], *, where: str, target_layers: int | None) -> DraftSpec:
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise EyasError(f"--drafter {where}: speculators_model_type={cfg.get('speculators_model_type')!r}; only eagle3 is supported")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag):
            raise EyasError(f"--drafter {where}: {flag}=true is a speculators variant eyas does not evaluate")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EyasError(f"--drafter {where}: speculators config without a transformer_layer_config object")
    _check_single_llama_layer(layer, where=where)
    dims = _llama_dims(layer, where=where)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    ours = [int(i) for i in ids] if ids else _default_ids(target_layers, where=where)
    return DraftSpec(
        **dims,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or dims["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or dims["hidden_size"]),
        aux_layer_ids=ours,
        # vLLM's reader defaults this to True when absent (FIELD.md section 3)
        norm_before_residual=bool(cfg.get("norm_before_residual", True)),
        source_format="speculators",
        source_layer_ids=list(ids) if ids else None,
    )


def _default_ids(target_layers: int | None, *, where: str) -> list[int]:
    if target_layers is None:
        raise EyasError(f"--drafter {where}: the config names no aux layer ids and no target was given to derive the default")
    return [2, target_layers // 2, target_layers - 3]


def _spec_from_eyas(directory: Path) -> DraftSpec:
    """An eyas drafter directory: config.json {"schema": "eyas.drafter/1", "drafter": DrafterConfig fields}."""
    try:
        from eyas.drafter.model import load_config
    except ImportError as exc:  # the drafter module is another stage; say so plainly
        raise EyasError(f"--drafter {directory}: eyas drafter support is not installed ({exc})") from exc
    try:
        config, _meta = load_config(directory)
    except (KeyError, TypeError, ValueError) as exc:
        raise EyasError(f"--drafter {directory}: config.json is not a valid eyas drafter config ({exc})") from exc
    return spec_from_drafter_config(config)


def spec_from_drafter_config(config) -> DraftSpec:
    """Build a DraftSpec from eyas's DrafterConfig."""
    c = config
    if getattr(c, "layer_convention", CONVENTION) != CONVENTION:
        raise EyasError(f"drafter config: layer_convention {c.layer_convention!r}, expected {CONVENTION!r}")
    rope = dict(c.rope_parameters or {})
    rope.setdefault("rope_theta", float(c.rope_theta))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return DraftSpec(
        hidden_size=int(c.hidden_size),
        num_attention_heads=int(c.num_attention_heads),
        num_key_value_heads=int(c.num_key_value_heads),
        head_dim=int(c.head_dim),
        intermediate_size=int(c.intermediate_size),
        rms_norm_eps=float(c.rms_norm_eps),
        rope_parameters=rope,
        max_position_embeddings=int(c.max_position_embeddings),
        vocab_size=int(c.vocab_size),
        draft_vocab_size=int(c.draft_vocab_size),
        target_hidden_size=int(c.target_hidden_size),
        aux_layer_ids=[int(i) for i in c.aux_layer_ids],
        norm_before_residual=False,
        source_format="eyas",
        source_layer_ids=[int(i) for i in c.aux_layer_ids],
        target_model_type=getattr(c, "target_model_type", None),
    )


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


def complete_vocab_maps(spec: DraftSpec, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Fill d2t/t2d when a full-vocabulary drafter omits them; check their shapes."""
    vd, v = spec.draft_vocab_size, spec.vocab_size
    if weights["lm_head.weight"].shape[0] != vd:
        raise EyasError(f"--drafter {where}: lm_head has {weights['lm_head.weight'].shape[0]} rows but draft_vocab_size={vd}")
    if "d2t" not in weights:
        if vd != v:
            raise EyasError(f"--drafter {where}: no d2t map but draft_vocab_size {vd} != vocab_size {v}")
        weights["d2t"] = torch.zeros(vd, dtype=torch.long)
    weights["d2t"] = weights["d2t"].to(torch.long)
    if weights["d2t"].shape != (vd,):
        raise EyasError(f"--drafter {where}: d2t has shape {tuple(weights['d2t'].shape)}, expected ({vd},)")
    target_ids = torch.arange(vd) + weights["d2t"]
    if target_ids.min() < 0 or target_ids.max() >= v:
        raise EyasError(f"--drafter {where}: d2t maps draft ids outside the target vocabulary 0..{v - 1}")
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    if "t2d" in weights and not torch.equal(weights["t2d"].to(torch.bool), t2d):
        raise EyasError(f"--drafter {where}: t2d disagrees with d2t (they must mark the same target ids)")
    weights["t2d"] = t2d


# ----------------------------------------------------------------------------------------------
# entry points


@dataclass
class DraftCheckpoint:
    spec: DraftSpec
    weights: dict[str, torch.Tensor]  # SGLang key names, CPU tensors
    path: Path


def load_draft_checkpoint(directory: str | Path, *, target_layers: int | None = None,
                          target_model_type: str | None = None) -> DraftCheckpoint:
    """Read any supported drafter directory; `target_layers` supplies default aux ids when needed,
    `target_model_type` the conversion rule of SGLang ids (DeepSeek differs)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise EyasError(f"--drafter {directory}: not a directory")
    cfg = _read_config(directory)
    fmt = detect_format(cfg)
    where = str(directory)
    if fmt == "eyas":
        spec = _spec_from_eyas(directory)
    elif fmt == "sglang":
        spec = _spec_from_sglang(cfg, where=where, target_layers=target_layers, target_model_type=target_model_type)
    else:
        spec = _spec_from_speculators(cfg, where=where, target_layers=target_layers)
    if target_model_type and not spec.target_model_type:
        spec.target_model_type = target_model_type
    weights = canonical_weights(read_weights(directory), where=where)
    complete_vocab_maps(spec, weights, where=where)
    check_shapes(spec, weights, where=where)
    return DraftCheckpoint(spec=spec, weights=weights, path=directory)


def check_shapes(spec: DraftSpec, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Every weight has the shape the spec implies (catches a config that does not match its weights)."""
    h, hd, nh, nkv, i = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    expected = {
        "fc.weight": (h, len(spec.aux_layer_ids) * spec.target_hidden_size),
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
        "lm_head.weight": (spec.draft_vocab_size, h),
    }
    if "embed_tokens.weight" in weights:
        expected["embed_tokens.weight"] = (spec.vocab_size, h)
    for key, shape in expected.items():
        got = tuple(weights[key].shape)
        if got != shape:
            raise EyasError(f"--drafter {where}: {key} has shape {got}, the config implies {shape}")


def check_against_target(spec: DraftSpec, target_config, *, where: str) -> None:
    """A drafter built for another target fails here with the mismatch named."""
    from eyas.target import hidden_size_of, num_layers_of

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    v, h, n = int(text.vocab_size), hidden_size_of(target_config), num_layers_of(target_config)
    if spec.vocab_size != v:
        raise EyasError(
            f"--drafter {where}: built for a target vocabulary of {spec.vocab_size} tokens, but the target has {v}; "
            "evaluate it against the target it was trained for"
        )
    if spec.target_hidden_size != h:
        raise EyasError(
            f"--drafter {where}: expects target features of width {spec.target_hidden_size}, but the target's hidden "
            f"size is {h}; evaluate it against the target it was trained for"
        )
    bad = [i for i in spec.aux_layer_ids if not 0 <= i < n]
    if bad:
        raise EyasError(
            f"--drafter {where}: aux layer ids {spec.aux_layer_ids} (convention {CONVENTION}) include {bad}, "
            f"outside the target's {n} layers"
        )
