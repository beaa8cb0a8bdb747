"""Run SpecForge 0.2.0's CLI on the CPU: `python lab/scripts/specforge_cpu.py train --config run.yaml`.

Used only by lab/scripts/specforge_side_by_side.py --device cpu (a CPU check of the whole side by side
before GPU time is spent); on a GPU that script runs SpecForge's plain CLI. Two things in SpecForge
cannot run on a CPU, and this launcher changes exactly those before handing over to
`specforge.cli.main`:

  * its EAGLE-3 objective, specforge/core/loss.py LogSoftmaxLoss, is a Triton kernel: the module
    imports `triton` at import time (not installed without CUDA) and launches the kernel on the
    logits' device. The module is imported with the placeholder `triton` of benchmarks/specforge_peer.py
    (just enough for its decorators; removed from sys.modules right after, so torch keeps seeing no
    triton), and LogSoftmaxLoss.apply is bound to SpecForge's own reference `_compute_loss` from the
    same file: the same value (the mean over all B x T positions of the masked soft cross-entropy
    -sum_v target_v log_softmax(logits)_v) and, through autograd, the same gradient.
  * torch.compile is off (TORCHDYNAMO_DISABLE=1): SpecForge compiles its teacher, metric, RoPE and
    flex-attention helpers, which on the CPU means minutes of C++ builds for tiny shapes; eager
    computes the same.
SPECFORGE_DEVICE=cpu puts SpecForge on the CPU (gloo process group) even where CUDA exists.
The config side (FSDP -> NO_SHARD, flex_attention -> sdpa) is the caller's: see specforge_side_by_side.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # specforge_peer, a portable benchmark


class ReferenceLogSoftmaxLoss:
    """specforge.core.loss.LogSoftmaxLoss's interface over the same file's reference `_compute_loss`."""

    reference = None

    @classmethod
    def apply(cls, logits, target, position_mask):
        return cls.reference(logits, target, position_mask)


def install_cpu_loss() -> None:
    """Import specforge.core.loss without triton and make its LogSoftmaxLoss the reference loss."""
    if "specforge.core.loss" in sys.modules:
        raise RuntimeError("specforge.core.loss is imported already: install_cpu_loss() must come first")
    import torch
    import torch._dynamo  # noqa: F401  (torch probes for triton once: before any placeholder, as specforge_peer does)

    torch.compile(lambda x: x)  # loads the compile machinery with the real (or no) triton
    from specforge_peer import _missing, _triton_placeholder

    fake = _triton_placeholder() if _missing("triton") else {}
    sys.modules.update(fake)
    try:
        loss = importlib.import_module("specforge.core.loss")
    finally:
        for name in fake:
            sys.modules.pop(name, None)
    ReferenceLogSoftmaxLoss.reference = staticmethod(loss._compute_loss)
    loss.LogSoftmaxLoss = ReferenceLogSoftmaxLoss


def main(argv: list[str] | None = None) -> int:
    os.environ["SPECFORGE_DEVICE"] = "cpu"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # before torch is imported: torch._dynamo reads it once
    install_cpu_loss()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
