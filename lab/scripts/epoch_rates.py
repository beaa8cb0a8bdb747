"""Training rate of the first epoch against the epochs after it, from one `eyas train` run's metrics.jsonl.

With the online state cache (`eyas train --cache-states`, on by default for multi-epoch GPU runs) the
target runs during the first epoch only; this reads the per-step times the run logged and prints the
rate of each part, so the cache's effect is measured inside one run (same process, data and model).

    python lab/scripts/epoch_rates.py RUN/metrics.jsonl --steps-per-epoch 162 [--skip 20]

--steps-per-epoch: the run's log says it ("... N steps per epoch"). --skip: first steps left out (compile,
warm-up). Evaluation records are ignored; a step's time is its logged `step_s`. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rates(records: list[dict], first: int, last: int) -> dict:
    r = [x for x in records if first <= x["step"] <= last]
    if not r:
        return {}
    secs = sum(x["step_s"] for x in r)
    return {
        "steps": len(r),
        "tokens_per_s": round(sum(x["tokens"] for x in r) / secs, 1),
        "supervised_tokens_per_s": round(sum(x["supervised_tokens"] for x in r) / secs, 1),
        "seconds_per_step": round(secs / len(r), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", type=Path)
    ap.add_argument("--steps-per-epoch", type=int, required=True)
    ap.add_argument("--skip", type=int, default=20)
    args = ap.parse_args()
    recs = {}
    for line in args.metrics.read_text().splitlines():
        rec = json.loads(line)
        if not rec.get("eval") and "step" in rec:
            recs[int(rec["step"])] = rec  # a resumed run re-logs steps: keep the last
    records = [recs[k] for k in sorted(recs)]
    E, last = args.steps_per_epoch, max(recs)
    first_epoch = rates(records, args.skip + 1, E)
    later = rates(records, E + 1, last)
    out = {"metrics": str(args.metrics), "first_epoch": first_epoch, "later_epochs": later}
    if first_epoch and later:
        out["later_vs_first"] = round(later["tokens_per_s"] / first_epoch["tokens_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
