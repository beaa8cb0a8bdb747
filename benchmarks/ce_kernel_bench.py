"""Micro-benchmark of the per-chunk soft cross-entropy of the head loss: `_chunk_ce` eager, compiled
(`_fast`, torch.compile) and the fused Triton kernel (`fused_chunk_ce`) on one [rows, V] chunk.

Effective bandwidth counts the bytes the op cannot avoid: read s and t once, write g once
(rows x V x (s + t + g element sizes)); the torch versions read more, which is the point.
Also reported: the fused kernel at a few block sizes / warp counts, the start-up check's verdict
and cost, and the largest differences from eager (loss, g, top-1 hits).

Indexed teacher: the head loss keeps the teacher's logits for a whole packed row (a table
[table_rows, V]) and each chunk needs `rows` of its rows (increasing ids with gaps, as the TTT
steps' rows r + 1 + k are). Timed: the kernel reading them through `t_rows` (triton_indexed),
against the gather it replaces (index_select alone, and index_select + kernel), and the torch
fallback as training calls it (compiled_gather: index_select + compiled `_chunk_ce`).

GPU (H200, well under a minute; needs CUDA, triton for the kernel parts):
    PYTHONPATH=src python benchmarks/ce_kernel_bench.py
Options: --rows 4096 --vocab 32000 --table-rows 16384 --teacher-dtype bf16|fp32 --iters 50.
Progress goes to stderr; stdout ends with a short table and one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_ms(fn, *, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of `fn()` over `iters` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--table-rows", type=int, default=16384, help="rows of the cached teacher table (>= --rows)")
    ap.add_argument("--teacher-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if args.table_rows < args.rows:
        ap.error(f"--table-rows {args.table_rows} < --rows {args.rows}: the chunk picks distinct rows of the table")
    result: dict = {
        "bench": "ce_kernel",
        "rows": args.rows,
        "vocab": args.vocab,
        "student_dtype": "bf16",
        "teacher_dtype": args.teacher_dtype,
        "table_rows": args.table_rows,
        "errors": {},
    }
    if not torch.cuda.is_available():
        result["errors"]["cuda"] = "CUDA is not available: nothing to time"
        print(json.dumps(result))
        return 1
    from eyas.drafter import ce_kernel as CE
    from eyas.drafter.ttt.compiled import _fast
    from eyas.drafter.ttt.head_loss import _chunk_ce, _gathering, check_fused_chunk_ce

    dev = torch.device("cuda")
    result["device"] = torch.cuda.get_device_name(dev)
    result["torch"] = torch.__version__
    t_dtype = torch.bfloat16 if args.teacher_dtype == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    c, V = args.rows, args.vocab
    s = (3 * torch.randn(c, V, generator=g, device=dev)).to(torch.bfloat16)
    table = (3 * torch.randn(args.table_rows, V, generator=g, device=dev)).to(t_dtype)
    t_rows = torch.randperm(args.table_rows, generator=g, device=dev)[:c].sort().values
    t = table.index_select(0, t_rows)  # the chunk's teacher rows, [c, V]
    w = torch.rand(c, generator=g, device=dev)
    top = s.float().argmax(-1)
    top[::2] = torch.randint(0, V, (len(range(0, c, 2)),), generator=g, device=dev)
    nbytes = c * V * (s.element_size() + t.element_size() + s.element_size())
    result["bytes_min"] = nbytes
    ref = _chunk_ce(s, t, w, top)
    rows = []

    def run(name: str, fn) -> None:
        note(f"timing {name} ...")
        try:
            t0 = time.perf_counter()
            out = fn()  # first call: compiles where it compiles
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ms = time_ms(fn, iters=args.iters)
        except Exception as exc:  # noqa: BLE001  (report and go on with the other parts)
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            note(traceback.format_exc())
            return
        entry = {
            "ms": round(ms, 4),
            "gb_s": round(nbytes / ms / 1e6, 1),
            "first_call_s": round(first_s, 2),
            "ce_rel_diff": abs(out[0].item() - ref[0].item()) / max(1.0, abs(ref[0].item())),
            "g_max_abs_diff": (out[2].float() - ref[2].float()).abs().max().item(),
            "hits_mismatch": int((out[1] != ref[1]).sum().item()),
        }
        result[name] = entry
        rows.append((name, entry))

    run("eager", lambda: _chunk_ce(s, t, w, top))
    compiled = _fast(_chunk_ce, dev)
    run("compiled", lambda: compiled(s, t, w, top))
    fallback = _gathering(compiled)
    run("compiled_gather", lambda: fallback(s, table, w, top, t_rows=t_rows))
    note("timing index_select ...")
    try:
        ms = time_ms(lambda: table.index_select(0, t_rows), iters=args.iters)
        result["index_select"] = {"ms": round(ms, 4), "gb_s": round(2 * t.numel() * t.element_size() / ms / 1e6, 1)}
    except Exception as exc:  # noqa: BLE001
        result["errors"]["index_select"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    why = CE.kernel_unavailable(dev)
    if why is not None:
        result["errors"]["triton"] = why
        note(f"triton kernel skipped: {why}")
    else:
        run("triton", lambda: CE.fused_chunk_ce(s, t, w, top))
        run("triton_indexed", lambda: CE.fused_chunk_ce(s, table, w, top, t_rows=t_rows))
        run("index_select+triton", lambda: CE.fused_chunk_ce(s, table.index_select(0, t_rows), w, top))
        run(
            "triton_indexed_b32768_w16",
            lambda: CE.fused_chunk_ce(s, table, w, top, t_rows=t_rows, block_v=32768, num_warps=16),
        )
        for block, warps in [
            (1024, 4),
            (2048, 8),
            (4096, 4),
            (4096, 8),
            (8192, 16),
            (32768, 8),
            (32768, 16),
            (32768, 32),
        ]:
            run(
                f"triton_b{block}_w{warps}",
                lambda b=block, nw=warps: CE.fused_chunk_ce(s, t, w, top, block_v=b, num_warps=nw),
            )
        try:
            t0 = time.perf_counter()
            verdict = check_fused_chunk_ce(dev, torch.bfloat16, t_dtype)
            result["startup_check"] = {
                "passed": verdict is None,
                "why": verdict,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        except Exception as exc:  # noqa: BLE001
            result["errors"]["startup_check"] = f"{type(exc).__name__}: {exc}"
    if "compiled" in result and "triton" in result:
        result["speedup_vs_compiled"] = round(result["compiled"]["ms"] / result["triton"]["ms"], 2)
    if "triton_indexed" in result and "index_select+triton" in result:
        result["speedup_indexed_vs_gather"] = round(
            result["index_select+triton"]["ms"] / result["triton_indexed"]["ms"], 2
        )
    if "index_select" in result:
        note(f"index_select alone: {result['index_select']['ms']:.3f} ms")
    print(f"{'version':<22}{'ms':>9}{'GB/s':>9}{'g diff':>11}{'ce rel':>11}{'hits !=':>9}")
    for name, e in rows:
        print(
            f"{name:<22}{e['ms']:>9.3f}{e['gb_s']:>9.0f}{e['g_max_abs_diff']:>11.2e}{e['ce_rel_diff']:>11.2e}"
            f"{e['hits_mismatch']:>9}"
        )
    if "index_select" in result:
        print(f"{'index_select alone':<22}{result['index_select']['ms']:>9.3f}{result['index_select']['gb_s']:>9.0f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
