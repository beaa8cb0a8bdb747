"""Serving layouts for an EAGLE-3 drafter: SGLang's and vLLM/speculators', written from any readable drafter.

Both write `config.json` + `model.safetensors` (+ `eyas_export.json`: provenance, checksums, the layer
ids in every convention). What differs, as read from the engines' sources (FIELD.md sections 2-3):

| | SGLang (`LlamaForCausalLMEagle3`) | vLLM / speculators (`Eagle3Speculator`) |
|---|---|---|
| layer keys | `midlayer.*` (eyas's own names) | `layers.0.*` |
| aux layer ids | `eagle_config.eagle_aux_hidden_state_layer_ids`, id k = OUTPUT of layer k = ours - 1 | top-level `eagle_aux_hidden_state_layer_ids`, id i = INPUT of layer i = ours |
| Llama shape | top-level config fields | `transformer_layer_config` |
| residual | always the raw feature | `norm_before_residual: false` written explicitly (vLLM defaults it to true) |
| full vocabulary (draft = target vocab) | no `d2t`/`t2d`: `hot_token_id` stays None | no `d2t`/`t2d`: vLLM then has no `draft_id_to_target_id` |
| target | not written (the server is started with it) | `speculators_config.verifier.name_or_path`: a Hub repository id |

Serving the vLLM export, two routes:
- `vllm serve <export dir>`: vLLM reads the speculators config, serves `verifier.name_or_path` as the
  target and the directory as the drafter. It accepts only a Hub repository id there, so the id is
  taken from `--verifier` or the target's config (`_name_or_path`); the local target path is kept in
  `eyas_verifier_path` beside it.
- `vllm serve <target> --speculative-config '{"method": "eagle3", "model": "<export dir>",
  "num_speculative_tokens": 5}'`: works with a local target; the verifier field is not read.

`embed_tokens.weight` is written to both (the engines replace or accept it; it makes the directory
self-contained). Run: `eyas export --drafter DIR --format sglang|vllm --out DIR`.
"""

from __future__ import annotations

import json
import re
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
                verifier_architectures: list[str] | None = None, verifier_path: str | None = None) -> dict[str, Any]:
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
        "eyas_verifier_path": verifier_path,
        "torch_dtype": dtype,
    }


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def resolve_verifier(verifier: str | None, recorded_path: str | None) -> tuple[str | None, str | None, list[str] | None]:
    """(Hub repository id, local target path, architectures) for speculators_config.verifier.

    `verifier` is a Hub id or a local target directory; None = the target recorded in the drafter.
    The Hub id of a local directory is its config's `_name_or_path` when that is one.
    """
    local = None
    if verifier is not None and not Path(verifier).is_dir():
        if not HUB_ID.match(verifier) or ".." in verifier:
            raise EyasError(f"--verifier {verifier!r}: neither a local target directory nor a Hub repository id "
                            "(owner/name); pass the id the target is published under")
        hub = verifier
    else:
        hub = None
        local = verifier or recorded_path
    arch = None
    if local and (Path(local) / "config.json").is_file():
        cfg = json.loads((Path(local) / "config.json").read_text())
        arch = cfg.get("architectures")
        name = str(cfg.get("_name_or_path") or "")
        if hub is None and HUB_ID.match(name) and not Path(name).exists():
            hub = name
    return hub, (str(Path(local).resolve()) if local else None), arch


def is_full_vocab(spec: DraftSpec, weights: dict[str, torch.Tensor]) -> bool:
    """Draft vocab == target vocab with the identity map: the engines then expect no d2t/t2d."""
    return spec.draft_vocab_size == spec.vocab_size and not bool(weights["d2t"].any())


def export_weights(weights: dict[str, torch.Tensor], fmt: str, *, dtype: torch.dtype | None,
                   full_vocab: bool = False) -> dict[str, torch.Tensor]:
    """Rename for `fmt`; float tensors cast to `dtype` (None keeps theirs); d2t int64, t2d bool, both
    left out for a full-vocabulary drafter (vLLM has no parameter to load d2t into then)."""
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


def write_export(ckpt: DraftCheckpoint, fmt: str, out_dir: Path, *, dtype: torch.dtype | None = None,
                 verifier: str | None = None, verifier_architectures: list[str] | None = None,
                 verifier_path: str | None = None, speculative_tokens: int = 3, source_meta: dict[str, Any] | None = None) -> dict[str, Any]:
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
    full_vocab = is_full_vocab(spec, ckpt.weights)
    weights = export_weights(ckpt.weights, fmt, dtype=dtype, full_vocab=full_vocab)
    float_dtypes = {str(t.dtype).replace("torch.", "") for t in weights.values() if t.is_floating_point()}
    dtype_name = sorted(float_dtypes)[0] if len(float_dtypes) == 1 else "float32"
    if fmt == "sglang":
        config = sglang_config(spec, dtype=dtype_name)
    else:
        config = vllm_config(spec, dtype=dtype_name, verifier=verifier, speculative_tokens=speculative_tokens,
                             verifier_architectures=verifier_architectures, verifier_path=verifier_path)
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
        "full_vocab": full_vocab,
        "verifier": {"name_or_path": verifier, "local_path": verifier_path} if fmt == "vllm" else None,
        "weights": {"file": "model.safetensors", "sha256": sha256_file(out_dir / "model.safetensors"),
                    "keys": sorted(weights)},
    }
    (out_dir / "eyas_export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def export_drafter(drafter: str | Path, fmt: str, out: str | Path, *, overwrite: bool = False, dtype: str = "keep",
                   verifier: str | None = None, speculative_tokens: int = 5,
                   target_layers: int | None = None) -> dict[str, Any]:
    """Read any drafter directory and write it atomically in `fmt` layout; returns the CLI summary."""
    from eyas.common import atomic_directory, log
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
    hub, local, arch = resolve_verifier(verifier, recorded.get("path"))
    if fmt == "vllm" and hub is None:
        log(f"export: no Hub repository id for the target (--verifier, or `_name_or_path` in its config): "
            f"`vllm serve {out}` will refuse the local path; serve with `vllm serve <target> --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{out}\"}}'` or export again with --verifier OWNER/NAME")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        record = write_export(
            ckpt, fmt, tmp, dtype=None if dtype == "keep" else getattr(torch, dtype),
            verifier=hub or local, verifier_path=local, verifier_architectures=arch,
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
        "full_vocab": record["full_vocab"],
        **({"verifier": hub or local} if fmt == "vllm" else {}),
    }
