"""Render the ledger (benchmarks/results.jsonl, one JSON line per measured figure) into docs/performance.md (the latest
figure of every metric, grouped by capability) and the README's results table (the headline metrics, between the
`<!-- results:begin -->` and `<!-- results:end -->` markers). The ledger is the only place a figure is written.

    python benchmarks/render_results.py           # rewrite both files
    python benchmarks/render_results.py --check   # exit 1 when either file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "benchmarks" / "results.jsonl"
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

GROUPS = [  # (capability, metric prefixes), first match wins
    ("training speed", ("train_",)),
    ("drafter quality (MT-bench tau)", ("tau_", "recipe_", "sbs_", "scaling_")),
    ("speculative decoding", ("specdec_", "generate_")),
    ("regeneration", ("regen",)),
    (
        "serving (SGLang / vLLM with the drafter)",
        (
            "sglang_accept",
            "sglang_speedup",
            "sglang_7_",
            "sglang_3_",
            "sglang_5_",
            "sglang_6_",
            "eval_export",
            "store41_",
        ),
    ),
    ("capture", ("capture", "sglang_")),
    ("evaluation and verification", ("eval", "verify", "invariant")),
]

HEADLINES = [  # (what, metric, a piece of the command that picks the row, or "" for the latest)
    ("the recipe's drafter, MT-bench tau tree (one run)", "recipe_tau_tree_mtbench", ""),
    ("the recipe's drafter, MT-bench tau chain (one run)", "recipe_tau_chain_mtbench", ""),
    ("SmolLM2 `eyas train` online, supervised tokens/s", "train_smol_supervised_tok_s", ""),
    ("8B-shaped training step against SpecForge 0.2.0", "train_8b_vs_specforge", ""),
    ("drafter trained on an SGLang server's states, MT-bench tau chain (6,000 records)", "sglang_store_tau_chain", ""),
    ("SGLang EAGLE-3 serving, accept length / eval's chain tau", "sglang_accept_len_vs_eval_chain7", ""),
]


def read_ledger(path: Path = LEDGER) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            missing = {"metric", "value", "unit", "date", "commit", "device", "command"} - set(row)
            if missing:
                raise SystemExit(f"{path}:{n}: missing {', '.join(sorted(missing))}")
            rows.append(row)
    return rows


def latest(rows: list[dict]) -> dict[str, dict]:
    """metric -> its latest row (by date, then by position in the ledger)."""
    out: dict[str, dict] = {}
    for row in rows:
        cur = out.get(row["metric"])
        if cur is None or row["date"] >= cur["date"]:
            out[row["metric"]] = row
    return out


def group_of(metric: str) -> str:
    for name, prefixes in GROUPS:
        if metric.startswith(prefixes):
            return name
    return "other"


def _value(row: dict) -> str:
    v = row["value"]
    return (
        f"{v:,.0f}" if isinstance(v, (int, float)) and abs(v) >= 1000 else f"{v:g}" if isinstance(v, float) else str(v)
    )


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_performance(rows: list[dict]) -> str:
    last = latest(rows)
    lines = [
        "# Performance",
        "",
        "Rendered from `benchmarks/results.jsonl` by `python benchmarks/render_results.py`; do not edit by hand.",
        "The latest figure of each metric, with the commit it measured and how. The history before the ledger:",
        "[lab/archive/RESULTS.md](../lab/archive/RESULTS.md).",
        "",
    ]
    names = [g for g, _ in GROUPS] + ["other"]
    for name in names:
        metrics = sorted(m for m in last if group_of(m) == name)
        if not metrics:
            continue
        lines += [
            f"## {name}",
            "",
            "| metric | value | unit | date | commit | device | command |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in metrics:
            r = last[m]
            lines.append(
                f"| {m} | {_value(r)} | {_cell(r['unit'])} | {r['date']} | {r['commit']} | "
                f"{_cell(r['device'])} | {_cell(r['command'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def headline_rows(rows: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for what, metric, piece in HEADLINES:
        found = [r for r in rows if r["metric"] == metric and piece in r["command"]]
        if found:
            out.append((what, sorted(found, key=lambda r: r["date"])[-1]))  # the latest date, then the last line
    return out


def render_table(rows: list[dict]) -> str:
    lines = [BEGIN, "| what | measured | at | device |", "|---|---|---|---|"]
    for what, r in headline_rows(rows):
        lines.append(
            f"| {what} | {_value(r)} {_cell(r['unit'])} | {r['commit']} ({r['date']}) | {_cell(r['device'])} |"
        )
    lines += ["", "Every figure with its command: [docs/performance.md](docs/performance.md).", END]
    return "\n".join(lines)


def with_table(readme: str, table: str) -> str:
    a, b = readme.find(BEGIN), readme.find(END)
    if a < 0 or b < a:
        raise SystemExit(f"README.md: no {BEGIN} ... {END} block")
    return readme[:a] + table + readme[b + len(END) :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a rendered file differs from the ledger's")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # tests: another tree
    args = ap.parse_args(argv)
    ledger, perf, readme = (args.root / p.relative_to(ROOT) for p in (LEDGER, PERFORMANCE, README))
    rows = read_ledger(ledger)
    want = {perf: render_performance(rows), readme: with_table(readme.read_text(), render_table(rows))}
    stale = [p for p, text in want.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(args.root)} (run python benchmarks/render_results.py)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(want[p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
