"""Writing a drafter: the eyas layout (`eyas train`), and SGLang's and vLLM/speculators' serving layouts
(drafter/layouts.py describes the three). Run: `eyas export --drafter DIR --format sglang|vllm --out DIR`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.drafter.layouts import CONFIG_FILE, ENGINES, SCHEMA, WEIGHTS_FILE, DraftCheckpoint, engine_layer_ids
from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.drafter.model import DrafterConfig


def write_eyas(
    out_dir: str | Path,
    config: DrafterConfig,
    weights: dict[str, torch.Tensor],
    *,
    target: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
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
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


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
            "eagle_aux_hidden_state_layer_ids": engine_layer_ids(
                config.aux_layer_ids, "sglang", model_type=config.target_model_type
            ),
            "use_aux_hidden_state": True,
        },
    }


def vllm_config(
    config: DrafterConfig,
    *,
    dtype: str,
    verifier: str | None,
    speculative_tokens: int,
    verifier_architectures: list[str] | None = None,
    verifier_path: str | None = None,
) -> dict[str, Any]:
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


def is_full_vocab(config: DrafterConfig, weights: dict[str, torch.Tensor]) -> bool:
    """Draft vocab == target vocab with the identity map: the engines then expect no d2t/t2d."""
    return config.draft_vocab_size == config.vocab_size and not bool(weights["d2t"].any())


def engine_weights(
    weights: dict[str, torch.Tensor], fmt: str, *, dtype: torch.dtype | None, full_vocab: bool = False
) -> dict[str, torch.Tensor]:
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


def write_engine_layout(
    ckpt: DraftCheckpoint,
    fmt: str,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    verifier: str | None = None,
    verifier_architectures: list[str] | None = None,
    verifier_path: str | None = None,
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """Write config.json + model.safetensors for `fmt` into `out_dir`; returns what was written
    (config, weight keys, dtype name, full_vocab)."""
    from safetensors.torch import save_file

    from eyas.common import honour_umask

    if fmt not in ENGINES:
        raise EyasError(f"--format {fmt!r}: expected one of {', '.join(ENGINES)}")
    config = ckpt.config
    if len(config.aux_layer_ids) != 3:
        # both engines size fc as 3 x target_hidden_size (SGLang LlamaModel, vLLM Eagle3 LlamaModel)
        raise EyasError(
            f"the drafter reads {len(config.aux_layer_ids)} aux layers {config.aux_layer_ids}; SGLang and "
            "vLLM serve EAGLE-3 drafters with exactly 3 (low, mid, high)"
        )
    full_vocab = is_full_vocab(config, ckpt.weights)
    weights = engine_weights(ckpt.weights, fmt, dtype=dtype, full_vocab=full_vocab)
    float_dtypes = {str(t.dtype).replace("torch.", "") for t in weights.values() if t.is_floating_point()}
    dtype_name = sorted(float_dtypes)[0] if len(float_dtypes) == 1 else "float32"
    if fmt == "sglang":
        cfg = sglang_config(config, dtype=dtype_name)
    else:
        cfg = vllm_config(
            config,
            dtype=dtype_name,
            verifier=verifier,
            speculative_tokens=speculative_tokens,
            verifier_architectures=verifier_architectures,
            verifier_path=verifier_path,
        )
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    honour_umask(out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    return {"config": cfg, "keys": sorted(weights), "dtype": dtype_name, "full_vocab": full_vocab}
