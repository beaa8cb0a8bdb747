"""How many compiled regions one 8B-structured training step calls, and where dynamo breaks its graphs.

The 8B step is bound by the host (lab/archive/RESULTS.md, 2026-12-01 evening): every call of a compiled
region costs host time (guards, the wrapper, its kernel launches) whatever the tensor sizes. This runs the
CUDA path's settings (compiled pieces, bf16 autocast, weights cast once or per step) on the CPU at tiny
dimensions, where only the structure matters, and prints the compiled-region calls of one step (forward
and backward) and dynamo's graph breaks:

    PYTHONPATH=src python lab/scripts/compiled_regions.py [--cast once|steps] [--ttt-steps 7]

(once, the 8B default: the once-cast weights' gradients summed by autograd; steps: every TTT step casts the
weights itself)

The CPU run has no Triton kernels: the attention merge and the head's chunk loss, compiled on CUDA only,
add their own calls there (train_bench.py --profile shows those on the GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cast", choices=["once", "steps"], default="once", help="TTTConfig.cast_once on or off")
    ap.add_argument("--ttt-steps", type=int, default=7)
    args = ap.parse_args()

    import train_bench as tb
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    c = tb.shapes(False)  # the 8B drafter's head counts, everything else tiny
    c.update(
        hidden_size=64, head_dim=2, intermediate_size=128, vocab_size=1024, draft_vocab_size=256, target_hidden_size=64
    )
    # the CUDA path's settings on the CPU: compiled pieces, bf16 autocast
    step = tb.make_fast_step(
        c,
        B=1,
        T=32,
        K=args.ttt_steps,
        device=torch.device("cpu"),
        compile_parts=True,
        cast_once=args.cast != "steps",
        bf16=True,
    )

    for _ in range(3):  # compiled, then steady
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ev = prof.key_averages()
    fwd = sum(e.count for e in ev if e.key.startswith("Torch-Compiled Region"))
    bwd = sum(e.count for e in ev if e.key == "CompiledFunctionBackward")
    print(
        f"cast {args.cast}, TTT {args.ttt_steps}: {fwd} compiled-region calls forward, {bwd} backward per step; "
        f"{counters['stats']['unique_graphs']} graphs, {sum(counters['graph_break'].values())} graph breaks"
    )
    for reason, n in counters["graph_break"].items():
        print(f"  break x{n}: {reason.splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
