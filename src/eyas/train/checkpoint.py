"""Training checkpoints: model, optimizer, scheduler, data position (the step) and RNG, in one file.

State dicts are saved in FULL (unsharded, world-size independent) form through
`torch.distributed.checkpoint.state_dict`, so a checkpoint written by N ranks (DDP or FSDP2)
resumes on M ranks. Rank 0 writes `<out>/checkpoints/step-XXXXXX.pt` atomically; every rank
reads it. `identity` (drafter config, TTT settings, global batch, data fingerprint) must match on
resume, otherwise the run stops before any step with the differences listed.
"""

from __future__ import annotations

import io
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import atomic_write_bytes
from eyas.errors import EyasError

CKPT_RE = re.compile(r"^step-(\d{6,})\.pt$")


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
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(path: Path, *, model, optimizer, scheduler, step: int, identity: dict, extra: dict,
                    is_main: bool) -> Path | None:
    """Collective (every rank calls it); rank 0 writes."""
    model_sd, optim_sd = full_state(model, optimizer)
    if not is_main:
        return None
    buf = io.BytesIO()
    torch.save({"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(), "step": step,
                "rng": rng_state(), "identity": identity, "extra": extra}, buf)
    atomic_write_bytes(path, buf.getvalue())
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    if not directory.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := CKPT_RE.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise EyasError(f"--resume: {path} does not exist (checkpoints are <out>/checkpoints/step-XXXXXX.pt)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise EyasError(f"--resume: cannot read {path} ({type(exc).__name__}: {exc}); it may be truncated") from exc


def check_identity(saved: dict, current: dict, path: Path) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        raise EyasError(f"--resume: {path} comes from another configuration: " + "; ".join(d[:300] for d in diffs[:6])
                        + ". Resume with the original settings, or start a new run with another --out")


def restore(ckpt: dict, *, model, optimizer, scheduler) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                   options=_sd_options())
    scheduler.load_state_dict(ckpt["scheduler"])
    set_rng_state(ckpt["rng"])
