"""The eval report: report.json (everything), report.md (a table to read), acceptance.png (by position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.common import atomic_write_bytes, atomic_write_json, save_figure
from eyas.specdec.metrics import DEFINITIONS


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    modes = report["modes"]
    lines = [
        "# eyas eval",
        "",
        f"- drafter: `{report['drafter']['path']}` ({report['drafter']['format']} layout, aux layers "
        f"{report['drafter']['aux_layer_ids']} in convention {report['drafter']['convention']})",
        f"- target: `{report['target']['path']}`",
        f"- prompts: {report['prompts']['source']}: {report['prompts']['conversations']} conversations, "
        f"{report['generation']['sequences']} sequences, {report['generation']['generated_tokens']} generated tokens "
        f"(max {report['settings']['max_new_tokens']} per turn, greedy)",
        "",
        "| mode | settings | tau (acceptance length) | accepted / drafted | rounds | "
        + " | ".join(f"pos {j}" for j in range(max(len(m["per_position_acceptance"]) for m in modes.values())))
        + " |",
        "|---|---|---|---|---|" + "---|" * max(len(m["per_position_acceptance"]) for m in modes.values()),
    ]
    width = max(len(m["per_position_acceptance"]) for m in modes.values())
    for name, m in modes.items():
        pos = [_fmt(x) for x in m["per_position_acceptance"]] + [""] * (width - len(m["per_position_acceptance"]))
        lines.append(
            f"| {name} | {m['settings']} | {_fmt(m['acceptance_length'])} | {_fmt(m['accepted_per_drafted'])} | "
            f"{m['rounds']} | " + " | ".join(pos) + " |"
        )
    if any(m.get("per_turn") for m in modes.values()):
        lines += [
            "",
            "tau by turn: "
            + "; ".join(
                f"{name} " + ", ".join(f"turn {t} {_fmt(v['acceptance_length'])}" for t, v in m["per_turn"].items())
                for name, m in modes.items()
            ),
        ]
    cats = {c for m in modes.values() for c in m.get("per_category", {})}
    if cats:
        lines += [
            "",
            "| category | " + " | ".join(f"tau {name}" for name in modes) + " |",
            "|---|" + "---|" * len(modes),
        ]
        for c in sorted(cats):
            lines.append(
                f"| {c} | "
                + " | ".join(
                    _fmt(m.get("per_category", {}).get(c, {}).get("acceptance_length")) for m in modes.values()
                )
                + " |"
            )
    t = report["timings"]
    lines += ["", "timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), "", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, m in report["modes"].items():
        xs = list(range(len(m["per_position_acceptance"])))
        per_pos = [float("nan") if v is None else v for v in m["per_position_acceptance"]]
        axes[0].plot(xs, per_pos, marker="o", label=f"{name} (tau {_fmt(m['acceptance_length'], 2)})")
        cond = [float("nan") if v is None else v for v in m["conditional_acceptance"]]
        axes[1].plot(xs, cond, marker="o", label=name)
    axes[0].set(
        title="rounds accepting draft position j",
        xlabel="draft position j",
        ylabel="fraction of rounds",
        ylim=(0, 1.02),
    )
    axes[1].set(
        title="accepted at j, given 0..j-1 accepted",
        xlabel="draft position j",
        ylabel="conditional rate",
        ylim=(0, 1.02),
    )
    width = max(len(m["per_position_acceptance"]) for m in report["modes"].values())
    for ax in axes:
        ax.set_xticks(range(width))
        ax.set_xlim(-0.3, width - 0.7)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def write_report(out: Path, report: dict[str, Any], sequences: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "report.md", markdown(report).encode())
    plot(report, out / "acceptance.png")
    atomic_write_bytes(out / "sequences.jsonl", "".join(json.dumps(s) + "\n" for s in sequences).encode())
