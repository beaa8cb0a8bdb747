"""eyas/train/report.py: the step log line's eta leaves out the run's first step (the compilation's)."""

from __future__ import annotations

import torch

from eyas.train import report


class _Metrics:
    def __init__(self):
        self.records = []

    def last(self):
        return None, []

    def write(self, rec):
        self.records.append(rec)


class _Dist:
    is_main = True


def test_the_eta_starts_after_the_first_step(monkeypatch):
    """A first step of 100 s (compiling) and then 1 s a step: the first line says no eta, the next ones the
    remaining steps at 1 s each, not at the run's mean; the records keep the run's whole wall time."""
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    lines = []
    monkeypatch.setattr(report, "log", lines.append)
    metrics = _Metrics()
    r = report.Reporter(metrics, d=_Dist(), K=2, weights=[1.0, 1.0], total=10, start=0, online=False)
    r.begin()
    stats = torch.tensor([2.0, 2.0, 1.0, 1.0, 2.0, 2.0])
    for step, t in enumerate((100.0, 101.0, 102.0)):
        now[0] = t
        r.step(step, stats, torch.tensor([8, 8, 6, 0]), torch.tensor([2.0, 2.0]), 1.0, 1e-3, [])
    assert [line.rsplit("| eta ", 1)[1] for line in lines] == ["-", "8s", "7s"]
    assert [round(x["step_s"]) for x in metrics.records] == [100, 1, 1]
    assert metrics.records[-1]["tokens_per_s"] == 24 / 102
