"""Metrics of a training run: one JSON object per line (metrics.jsonl) and a PNG of the curves.

Training records carry `step`, `loss`, `loss_per_step`, `acc_per_step`, `lr`, `grad_norm`,
`tokens`, `tokens_per_s`; eval records add `"eval": true` and `acceptance_length` (simulated,
including the bonus token; see train/loop.py).

Resume: with `append=True` the file is kept, and the first record written after the resume
truncates every line at or past its step (the steps after the last checkpoint that the crashed run
had already logged), so a resumed run's metrics.jsonl holds each step once. The writer also claims
the run directory (eyas's marker file) and refuses a metrics.jsonl that eyas did not write.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path, *, enabled: bool, append: bool):
        self.path, self.enabled = Path(path), enabled
        self._pending_trim = append
        if enabled:
            from eyas.common import claim_output_dir

            claim_output_dir(self.path.parent, kind="train")
            if not append:
                self.path.write_text("")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._pending_trim and "step" in record:
            self.truncate_from(int(record["step"]))
        self._pending_trim = False
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def truncate_from(self, step: int) -> int:
        """Drop lines whose step is >= `step` (and a torn last line); returns how many were dropped."""
        if not self.path.is_file():
            return 0
        keep, dropped = [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                rec = None  # a line torn by a kill mid-write
            if rec is None or int(rec.get("step", 0)) >= step:
                dropped += bool(line.strip())
                continue
            keep.append(line)
        if dropped:
            from eyas.common import atomic_write_bytes

            atomic_write_bytes(self.path, "".join(x + "\n" for x in keep).encode())
        return dropped

    def last(self) -> tuple[dict | None, list[dict]]:
        """(the last training record, all eval records) already in the file: a rerun of a finished
        run reports these instead of nothing."""
        if not self.path.is_file():
            return None, []
        train, evals = read_metrics(self.path)
        return (train[-1] if train else None), evals


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
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
