"""The self-checked fast paths, in one table: each kernel's fast path, its fallback and its start-up check.

A fast path runs only where its start-up check passed: the check runs the fast path against its fallback on small
random inputs (and says why not where the fast path cannot run at all), once per (kernel, device type, key) in a
process, and its answer is kept. The fallback is logged once where it costs speed (CUDA). A failed compile or a wrong
answer on a new machine must cost speed, never correctness.

One environment variable overrides the choice, for tests and A/B runs; it is read at every call:

    EYAS_KERNELS=teacher_stats:off,ce:on

`off`: always the fallback (nothing checked); `on`: the fast path, and an error where it cannot run or fails its
check; `auto` (any kernel not named): as checked.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eyas.errors import EyasError

ENV = "EYAS_KERNELS"


@dataclass(frozen=True)
class Kernel:
    name: str
    what: str
    """What runs faster, for the log line."""
    fast: str
    """module:function of the fast path."""
    fallback: str
    """module:function of the fallback (what runs where the fast path cannot)."""
    check: str
    """module:function, check(device, *key) -> None where the fast path equals the fallback here, else why not."""


_TABLE = {
    k.name: k
    for k in (
        Kernel(
            "ce",
            "the head loss's cross-entropy (one Triton kernel, two passes a row)",
            "eyas.drafter.ce_kernel:fused_chunk_ce",
            "eyas.drafter.ttt.head_loss:_chunk_ce",
            "eyas.drafter.ttt.head_loss:check_fused_chunk_ce",
        ),
        Kernel(
            "teacher_stats",
            "the teacher's row maximum and log-sum-exp (one Triton pass)",
            "eyas.drafter.ce_kernel:row_max_lse",
            "eyas.drafter.ttt.teacher:_teacher_max_lse",
            "eyas.drafter.ttt.teacher:check_row_max_lse",
        ),
        Kernel(
            "varlen_flash",
            "packed causal attention (the varlen flash kernel)",
            "eyas.packing:cuda_fwd",
            "eyas.packing:segments_fwd",
            "eyas.packing:check_varlen_flash",
        ),
        Kernel(
            "gqa_flash",
            "grouped keys read by the flash kernel (no repeated copy)",
            "eyas.packing:cuda_fwd",
            "eyas.drafter.model:repeat_kv",
            "eyas.packing:check_gqa_flash",
        ),
        Kernel(
            "addmm_fp32",
            "the head's fp32 weight gradient summed inside the matmul",
            "eyas.drafter.ttt.head_loss:_addmm_in_fp32",
            "eyas.drafter.ttt.head_loss:_addmm_by_copy",
            "eyas.drafter.ttt.head_loss:check_addmm_fp32",
        ),
    )
}

_checked: dict[tuple, str | None] = {}
"""(kernel, device type, key...) -> None (the fast path passed its check) or why not."""


def names() -> list[str]:
    return list(_TABLE)


def entry(name: str) -> Kernel:
    return _TABLE[name]


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def fast(name: str) -> Callable[..., Any]:
    return _resolve(_TABLE[name].fast)


def fallback(name: str) -> Callable[..., Any]:
    return _resolve(_TABLE[name].fallback)


def setting(name: str) -> str:
    """'auto', 'on' or 'off' for kernel `name`, from EYAS_KERNELS now (a bad value: EyasError)."""
    if name not in _TABLE:
        raise KeyError(name)
    found = "auto"
    for part in filter(None, (p.strip() for p in os.environ.get(ENV, "").split(","))):
        kname, sep, value = part.partition(":")
        kname, value = kname.strip(), value.strip().lower()
        if kname not in _TABLE or not sep or value not in ("auto", "on", "off"):
            raise EyasError(
                f"{ENV}={os.environ[ENV]!r}: expected NAME:on|off|auto, comma separated, NAME one of "
                f"{', '.join(_TABLE)}"
            )
        if kname == name:
            found = value
    return found


def use(name: str, device: torch.device | str, *key: Any) -> bool:
    """Whether kernel `name` runs its fast path on `device` for `key` (e.g. dtypes, head dim): EYAS_KERNELS's
    setting, else its start-up check's answer (checked once, kept, logged once)."""
    mode = setting(name)
    if mode == "off":
        return False
    device = torch.device(device)
    ck = (name, device.type, *key)
    if ck not in _checked:
        why = _resolve(_TABLE[name].check)(device, *key)
        _checked[ck] = why
        from eyas.common import log

        if why is None:
            log(f"kernels: {name}: {_TABLE[name].what} runs here ({device.type}, checked against its fallback)")
        elif device.type == "cuda" and mode == "auto":
            log(f"kernels: {name}: the fallback runs, not {_TABLE[name].what} ({why})")
    why = _checked[ck]
    if why is not None and mode == "on":
        raise EyasError(f"{ENV}: {name}:on, but {why}; leave {name} out of {ENV} to fall back")
    return why is None


def checked() -> dict[tuple, str | None]:
    """A copy of the start-up checks' answers so far."""
    return dict(_checked)


def forget() -> None:
    """Drop the kept answers (tests: the next `use` checks again)."""
    _checked.clear()
