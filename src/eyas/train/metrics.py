"""Metrics of a training run: one JSON object per line (metrics.jsonl) and a PNG of the curves.

Training records carry `step`, `loss`, `loss_per_step`, `acc_per_step`, `lr`, `grad_norm`,
`tokens`, `tokens_per_s`; eval records add `"eval": true` and `acceptance_length` (simulated,
including the bonus token; see train/loop.py).
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path, *, enabled: bool, append: bool):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            (evals if rec.get("eval") else train).append(rec)
    return train, evals


def plot_curves(metrics_path: Path, out_png: Path) -> Path | None:
    """Loss and per-step top-1 accuracy against the optimizer step (train lines, eval markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    if not train:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    ax1.plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted TTT loss")
    ax1.legend()
    K = len(train[0]["acc_per_step"])
    for k in range(K):
        ax2.plot(steps, [r["acc_per_step"][k] for r in train], alpha=0.6, label=f"train k={k}")
    for k in range(K):
        if evals:
            ax2.plot([r["step"] for r in evals], [r["acc_per_step"][k] for r in evals], "o--", label=f"eval k={k}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 agreement with target")
    ax2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
