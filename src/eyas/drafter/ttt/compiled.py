"""`_fast`: the TTT loss's small fp32 helpers compiled once per device on CUDA (eager elsewhere)."""

from __future__ import annotations

import torch

_COMPILED: dict[tuple[str, str], object] = {}


def _fast(fn, device: torch.device):
    """`fn` compiled into a few fused kernels on CUDA (eager elsewhere, or where compiling fails):
    the fp32 elementwise math around the matmuls is memory-bound, and fusing it removes the
    fp32 copies eager mode writes between steps."""
    if device.type != "cuda":
        return fn
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        # the merges take lists of J diagonals: one graph per J (1..TTT steps - 1) for packed rows and again for
        # dense batches, past dynamo's default of 8 graphs a function (beyond it, calls fall back to eager)
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        try:
            _COMPILED[key] = torch.compile(fn, dynamic=True)
        except Exception:  # noqa: BLE001  (compilation is an optimisation)
            _COMPILED[key] = fn
    return _COMPILED[key]
