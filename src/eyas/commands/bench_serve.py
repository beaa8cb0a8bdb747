"""`eyas bench-serve`: speculative decoding measured on running SGLang or vLLM servers; see eyas/serve_bench.py.

The options are BenchServeConfig's fields (eyas/serve_bench.py, via eyas/cli_options.py) plus where the
results go.
"""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_options import options_from


@options_from("eyas.serve_bench:BenchServeConfig")
def bench_serve(
    cfg,
    out: Path = typer.Option(
        Path("runs/bench-serve"),
        "--out",
        help="Results directory: summary.json, report.md, throughput.png, turns.jsonl, results.jsonl (ledger lines).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite/--no-overwrite", help="Replace an existing --out directory written by `eyas bench-serve`."
    ),
) -> dict:
    """Benchmark a running SGLang or vLLM server with a draft model (and a baseline without one) on eval's prompts."""
    from eyas.serve_bench import bench_serve as run

    return run(cfg, out=out, overwrite=overwrite)
