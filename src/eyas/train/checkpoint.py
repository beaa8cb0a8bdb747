"""Training checkpoints: model, optimizer, scheduler, data position (the step) and RNG, in one file.

Storage is one safetensors file, `<out>/checkpoints/step-XXXXXX.safetensors`: every tensor (model
weights, optimizer moments, RNG states) is a safetensors tensor, and everything else (step,
scheduler, optimizer hyper-parameters, Python/NumPy RNG, identity) is JSON in the file's metadata,
with tensors referenced by key. Reading it runs no code (no pickle anywhere), so `--resume auto`
is safe even on a directory someone else could write to. Key trade-off: the generic
tensor/JSON split (`_encode`/`_decode`) handles any nesting of dicts, lists, tuples and tensors
that the optimizer and scheduler state dicts use, at the cost of one extra pass over them.

State dicts are saved in FULL (unsharded, world-size independent) form through
`torch.distributed.checkpoint.state_dict`, so a checkpoint written by N ranks (DDP or FSDP2)
resumes on M ranks. Rank 0 writes atomically (temp file + rename); a kill mid-write leaves only a
`.step-*.tmp` temp file, which `latest_checkpoint` and `save_checkpoint` remove. `identity`
(drafter config, TTT settings, global batch, data fingerprint) must match on resume, otherwise the
run stops before any step with the differences listed. Non-finite weights are never written. The metadata
carries `tensors_sha256` (sha256 of every tensor's bytes, keys in sorted order), which loading checks: a file
changed after it was written (a flipped bit, overwritten bytes) is refused naming it, never trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import atomic_write_bytes, require_finite
from eyas.errors import EyasError

CKPT_RE = re.compile(r"^step-(\d{6,})\.safetensors$")
STALE_TMP_RE = re.compile(r"^\.step-\d{6,}\.(safetensors|pt)\..*\.tmp$")
FORMAT = "eyas-train-checkpoint/1"


def _sd_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_state(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=_sd_options())


def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(list(st["cuda"]))


# ----------------------------------------------------------------------------------------------
# tensors <-> safetensors, everything else <-> JSON


def _encode(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """A JSON-able copy of `obj` with each tensor/array moved into `tensors` under a unique key."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if hasattr(t, "full_tensor"):  # a DTensor left unsharded by mistake
            t = t.full_tensor()
        tensors[key] = t.contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _encode(v, tensors, f"{key}.{k}") for k, v in obj.items()}}
        return {
            "__items__": [
                [_encode(k, tensors, f"{key}.k{i}"), _encode(v, tensors, f"{key}.{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, float) and not np.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} at {key}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__dict__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__dict__"].items()}
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__float__" in obj:
        return float(obj["__float__"])
    raise ValueError(f"unknown checkpoint entry {sorted(obj)[:3]}")


def encode_checkpoint(state: dict[str, Any]) -> bytes:
    """The safetensors bytes of a checkpoint dict (tensors as tensors, the rest as JSON metadata)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta = _encode(state, tensors, "s")
    return save(
        tensors, metadata={"format": FORMAT, "state": json.dumps(meta), "tensors_sha256": tensors_sha256(tensors)}
    )


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of `tensors`, keys in sorted order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


class ChecksumMismatch(ValueError):
    """The checkpoint's tensors differ from the checksum written with them."""


def decode_checkpoint(data: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    meta = _read_metadata(data)
    if meta.get("format") != FORMAT or "state" not in meta:
        raise ValueError(f"not an eyas training checkpoint (format {meta.get('format')!r}, expected {FORMAT!r})")
    tensors = load(data)
    if "tensors_sha256" in meta and tensors_sha256(tensors) != meta["tensors_sha256"]:
        raise ChecksumMismatch("its tensors do not match the checksum written with them (tensors_sha256)")
    return _decode(json.loads(meta["state"]), tensors)


def _read_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise ValueError("file too short for a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise ValueError("not a safetensors file (bad header length)")
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


# ----------------------------------------------------------------------------------------------


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temp files a killed checkpoint write left in `directory` (only eyas's own names)."""
    removed = []
    if Path(directory).is_dir():
        for p in Path(directory).iterdir():
            if STALE_TMP_RE.match(p.name) and p.is_file():
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    if removed:
        from eyas.common import log

        log(f"removed {len(removed)} stale checkpoint temp file(s) in {directory} left by an interrupted write")
    return removed


def save_checkpoint(
    path: Path, *, model, optimizer, scheduler, step: int, identity: dict, extra: dict, is_main: bool
) -> Path | None:
    """Collective (every rank calls it); rank 0 writes `path` with a .safetensors suffix.

    Refuses (EyasError, nothing written) when any weight is NaN/Inf: a diverged run must not leave a
    checkpoint that resume or export would take as good.
    """
    model_sd, optim_sd = full_state(model, optimizer)
    if not is_main:
        return None
    require_finite(model_sd, what=f"the drafter weights at step {step}")
    path = Path(path)
    path = path.with_suffix(".safetensors")
    remove_stale_temps(path.parent)
    data = encode_checkpoint(
        {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "step": int(step),
            "rng": rng_state(),
            "identity": identity,
            "extra": extra,
        }
    )
    atomic_write_bytes(path, data)
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    directory = Path(directory)
    if not directory.is_dir():
        return None
    remove_stale_temps(directory)
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := CKPT_RE.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"--resume: {path} does not exist (checkpoints are <out>/checkpoints/step-XXXXXX.safetensors)")
    try:
        return decode_checkpoint(path.read_bytes())
    except ChecksumMismatch as exc:
        raise EyasError(
            f"--resume: checkpoint {path} is damaged: {exc}; the file changed after it was written. Resume "
            "from an earlier checkpoint (--resume FILE) or start over with --overwrite"
        ) from None
    except Exception as exc:  # any parse failure of a user-supplied file is bad input
        raise EyasError(
            f"--resume: cannot read {path} as an eyas checkpoint ({type(exc).__name__}: {exc}); it may be "
            "truncated, or written by an older eyas (pickled .pt files are not read): resume from "
            "another checkpoint or start a new run"
        ) from exc


def check_identity(saved: dict, current: dict, path: Path) -> None:
    # compare through JSON so tuples/lists and int/str keys read back from the file compare equal
    saved, current = json.loads(json.dumps(saved, default=str)), json.loads(json.dumps(current, default=str))
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise EyasError(
            f"--resume: {path} comes from another configuration: "
            + "; ".join(d[:300] for d in diffs[:6])
            + ". Resume with the original settings, or start a new run with another --out"
        )


def restore(ckpt: dict, *, model, optimizer, scheduler) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"], options=_sd_options()
    )
    scheduler.load_state_dict(ckpt["scheduler"])
    set_rng_state(ckpt["rng"])


def prune_checkpoints(directory: Path, *, keep: int) -> list[Path]:
    """Delete all but the latest `keep` checkpoints in `directory` (keep 0: none deleted); only eyas's own
    step-XXXXXX.safetensors names (and files named after one, e.g. its checksum), so `--resume auto` finds the
    latest and nothing else there is touched."""
    directory = Path(directory)
    if keep <= 0 or not directory.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := CKPT_RE.match(p.name)))
    removed = []
    for _, p in found[:-keep]:
        for q in [p, *(x for x in directory.iterdir() if x.name.startswith(p.name + ".") and x.is_file())]:
            with contextlib.suppress(FileNotFoundError):
                q.unlink()
                removed.append(q)
    return removed
