"""Serving layouts for an EAGLE-3 drafter: SGLang's and vLLM/speculators', written from any readable drafter.

Both write `config.json` + `model.safetensors` (+ `eyas_export.json`: provenance, checksums, the layer
ids in every convention). What differs, as read from the engines' sources (FIELD.md sections 2-3):

| | SGLang (`LlamaForCausalLMEagle3`) | vLLM / speculators (`Eagle3Speculator`) |
|---|---|---|
| layer keys | `midlayer.*` (eyas's own names) | `layers.0.*` |
| aux layer ids | `eagle_config.eagle_aux_hidden_state_layer_ids`, id k = OUTPUT of layer k = ours - 1 | top-level `eagle_aux_hidden_state_layer_ids`, id i = INPUT of layer i = ours |
| Llama shape | top-level config fields | `transformer_layer_config` |
| residual | always the raw feature | `norm_before_residual: false` written explicitly (vLLM defaults it to true) |

`embed_tokens.weight` is written to both (the engines replace or accept it; it makes the directory
self-contained). Run: `eyas export --drafter DIR --format sglang|vllm --out DIR`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.specdec.checkpoint import CONVENTION, DraftCheckpoint, DraftSpec

FORMATS = ("sglang", "vllm")
SCHEMA = "eyas.export/1"


def sglang_layer_ids(ours: list[int], target_model_type: str | None = None) -> list[int]:
    """SGLang id k = output of layer k; it captures before layer k + 1. Ours: id i = input of layer i.

    DeepSeek-V2/V3 in recent SGLang adds the 1 only when the first id is 1 (and older SGLang always adds
    it): ours starting at 2 is written k = i - 1 (right under both rules); any other first id is written
    as is, which only the recent rule reads right; a first id of 1 cannot be expressed at all.
    """
    bad = [i for i in ours if i < 1]
    if bad:
        raise EyasError(f"aux layer id(s) {bad} (input to layer 0 = the embeddings) cannot be written in SGLang's "
                        "convention (id = output of a layer)")
    if target_model_type in ("deepseek_v2", "deepseek_v3") and ours[0] != 2:
        if ours[0] == 1:
            raise EyasError(f"aux layer ids {ours}: no SGLang id list makes its DeepSeek models capture the input of "
                            "layer 1 first (a first id of 1 is shifted to 2, a first id of 0 is kept as 0); train "
                            "with another low layer (the default is 2)")
        return list(ours)
    return [i - 1 for i in ours]


def vllm_layer_ids(ours: list[int]) -> list[int]:
    """vLLM/speculators: id i = input of layer i, the same convention as eyas."""
    return list(ours)


def sglang_key(name: str) -> str:
    return name


def speculators_key(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _rope_fields(spec: DraftSpec) -> dict[str, Any]:
    """Old (`rope_theta`, `rope_scaling`) and new (`rope_parameters`) keys, consistent with each other."""
    rp = dict(spec.rope_parameters)
    theta = float(rp.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**rp, "rope_theta": theta}}


def llama_layer_config(spec: DraftSpec, *, dtype: str) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        **_rope_fields(spec),
        "vocab_size": spec.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def sglang_config(spec: DraftSpec, *, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_layer_config(spec, dtype=dtype),
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(spec.aux_layer_ids, spec.target_model_type),
            "use_aux_hidden_state": True,
        },
    }


def vllm_config(spec: DraftSpec, *, dtype: str, verifier: str | None, speculative_tokens: int,
                verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_config(spec, dtype=dtype),
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "norm_before_residual": bool(spec.norm_before_residual),
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(spec.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures or ["LlamaForCausalLM"]},
        },
        "torch_dtype": dtype,
    }


def export_weights(weights: dict[str, torch.Tensor], fmt: str, *, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Rename for `fmt`; float tensors cast to `dtype` (None keeps theirs); d2t int64, t2d bool."""
    rename = sglang_key if fmt == "sglang" else speculators_key
    out = {}
    for name, t in weights.items():
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif dtype is not None:
            t = t.to(dtype)
        out[rename(name)] = t.detach().cpu().contiguous()
    return out


def write_export(ckpt: DraftCheckpoint, fmt: str, out_dir: Path, *, dtype: torch.dtype | None = None,
                 verifier: str | None = None, verifier_architectures: list[str] | None = None,
                 speculative_tokens: int = 3, source_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the layout into `out_dir` (an empty directory). Returns the provenance record."""
    from safetensors.torch import save_file

    from eyas.common import sha256_file

    if fmt not in FORMATS:
        raise EyasError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    spec = ckpt.spec
    if len(spec.aux_layer_ids) != 3:
        # both engines size fc as 3 x target_hidden_size (SGLang LlamaModel, vLLM Eagle3 LlamaModel)
        raise EyasError(f"the drafter reads {len(spec.aux_layer_ids)} aux layers {spec.aux_layer_ids}; SGLang and vLLM "
                        "serve EAGLE-3 drafters with exactly 3 (low, mid, high)")
    weights = export_weights(ckpt.weights, fmt, dtype=dtype)
    float_dtypes = {str(t.dtype).replace("torch.", "") for t in weights.values() if t.is_floating_point()}
    dtype_name = sorted(float_dtypes)[0] if len(float_dtypes) == 1 else "float32"
    if fmt == "sglang":
        config = sglang_config(spec, dtype=dtype_name)
    else:
        config = vllm_config(spec, dtype=dtype_name, verifier=verifier, speculative_tokens=speculative_tokens,
                             verifier_architectures=verifier_architectures)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = {
        "schema": SCHEMA,
        "format": fmt,
        "source": {"path": str(ckpt.path.resolve()), "format": spec.source_format, **(source_meta or {})},
        "aux_layer_ids": {
            CONVENTION: spec.aux_layer_ids,
            "sglang (output of layer k)": sglang_layer_ids(spec.aux_layer_ids, spec.target_model_type),
            "vllm (input of layer i)": vllm_layer_ids(spec.aux_layer_ids),
            "written": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if fmt == "sglang"
            else config["eagle_aux_hidden_state_layer_ids"],
        },
        "dtype": dtype_name,
        "weights": {"file": "model.safetensors", "sha256": sha256_file(out_dir / "model.safetensors"),
                    "keys": sorted(weights)},
    }
    (out_dir / "eyas_export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def export_drafter(drafter: str | Path, fmt: str, out: str | Path, *, overwrite: bool = False, dtype: str = "keep",
                   verifier: str | None = None, speculative_tokens: int = 5,
                   target_layers: int | None = None) -> dict[str, Any]:
    """Read any drafter directory and write it atomically in `fmt` layout; returns the CLI summary."""
    from eyas.common import atomic_directory
    from eyas.specdec.checkpoint import load_draft_checkpoint

    drafter, out = Path(drafter), Path(out)
    if fmt not in FORMATS:
        raise EyasError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in ("keep", "bfloat16", "float16", "float32"):
        raise EyasError(f"--dtype {dtype!r}: expected keep, bfloat16, float16 or float32")
    if speculative_tokens < 1:
        raise EyasError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    if out.exists() and not overwrite:
        raise EyasError(f"--out {out} already exists: pass --overwrite to replace it, or choose another --out")
    if out.resolve() == drafter.resolve():
        raise EyasError(f"--out {out} is the --drafter directory itself; choose another --out")
    ckpt = load_draft_checkpoint(drafter, target_layers=target_layers)
    cfg = json.loads((drafter / "config.json").read_text())
    recorded = cfg.get("target") if isinstance(cfg.get("target"), dict) else {}
    arch = None
    if recorded.get("path") and (Path(recorded["path"]) / "config.json").is_file():
        arch = json.loads((Path(recorded["path"]) / "config.json").read_text()).get("architectures")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        record = write_export(
            ckpt, fmt, tmp, dtype=None if dtype == "keep" else getattr(torch, dtype),
            verifier=verifier or recorded.get("path"), verifier_architectures=arch,
            speculative_tokens=speculative_tokens, source_meta={"target": recorded} if recorded else None,
        )
    return {
        "out": str(out),
        "format": fmt,
        "aux_layer_ids_written": record["aux_layer_ids"]["written"],
        "aux_layer_ids_hf_input": record["aux_layer_ids"][CONVENTION],
        "dtype": record["dtype"],
        "weights_sha256": record["weights"]["sha256"],
        "keys": len(record["weights"]["keys"]),
    }
