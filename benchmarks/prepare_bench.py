"""`eyas prepare` wall time: the chats rendered in this process against the worker processes it starts for a
large source (`eyas.data.prepare.pool_workers`), on the same source, alternating, --repeat times each.

Every run is the real `prepare` (source read, render, split, write); the outputs of the two arms are compared
byte for byte (train/eval tensors and ids). Default source: the embedded ShareGPT with the embedded target.

    PYTHONPATH=src python benchmarks/prepare_bench.py [--source sharegpt] [--target default] [--repeat 3]

Progress goes to stderr; the last stdout line is one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eyas.data.prepare import PrepareConfig, pool_workers, prepare

OUTPUTS = ("train.safetensors", "eval.safetensors", "train.ids.json", "eval.ids.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--target", default="default")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eyas-prepare-bench-"))
    seconds: dict[str, list[float]] = {"in_process": [], "workers": []}
    summary = None
    try:
        for r in range(a.repeat):
            for arm in seconds:
                out = root / f"{arm}-{r}"
                cfg = PrepareConfig(source=a.source, target=a.target, out=out, limit=a.limit)
                t0 = time.perf_counter()
                summary = prepare(cfg, workers=1 if arm == "in_process" else None)
                seconds[arm].append(round(time.perf_counter() - t0, 2))
                print(f"run {r + 1} {arm}: {seconds[arm][-1]} s", file=sys.stderr, flush=True)
        same = all(
            (root / f"in_process-{r}" / name).read_bytes() == (root / f"workers-{r}" / name).read_bytes()
            for r in range(a.repeat)
            for name in OUTPUTS
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    chats = summary["samples_kept"] + summary["skipped_total"]
    doc = {
        "benchmark": "prepare",
        "source": a.source,
        "chats": chats,
        "tokens": summary["tokens"],
        "workers": pool_workers(chats),
        "seconds": seconds,
        "median_s": {k: statistics.median(v) for k, v in seconds.items()},
        "outputs_identical": same,
    }
    for arm, v in seconds.items():
        print(f"{arm:<11} median {statistics.median(v):7.2f} s   runs {v}")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
