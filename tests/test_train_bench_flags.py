"""benchmarks/train_bench.py's kernel settings: --flag KERNEL[=0] for the smol suite's real `eyas train`, and the 8B
suite's variants that change one kernel while their step runs."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


def test_flags_name_kernels_and_variants_restore_them(monkeypatch):
    """--flag KERNEL[=0] sets EYAS_KERNELS for the run; a module setting or an unknown kernel is refused; a
    variant's kernel setting holds only while its step runs."""
    from eyas import kernels

    tb = load_benchmark("train_bench")
    monkeypatch.setenv(kernels.ENV, "")  # (restored after the test: set_flag writes the environment itself)
    tb.set_flag("teacher_stats=0")
    assert kernels.setting("teacher_stats") == "off" and kernels.setting("ce") == "auto"
    tb.set_flag("ce")
    assert kernels.setting("ce") == "on" and kernels.setting("teacher_stats") == "off"
    for bad in ("ttt.TEACHER_STATS_KERNEL=0", "packing.GQA_FLASH", "no_such_kernel", "ce=2"):
        with pytest.raises(SystemExit, match="--flag"):
            tb.set_flag(bad)
    monkeypatch.setenv(kernels.ENV, "")
    seen = []
    step = tb.with_kernel(lambda: seen.append(kernels.setting("gqa_flash")), "gqa_flash", "off")
    step()
    assert seen == ["off"] and kernels.setting("gqa_flash") == "auto"  # changed only while the step ran


def test_paired_ratio_is_the_median_of_the_per_round_ratios():
    tb = load_benchmark("train_bench")
    ours = {"rounds_ms": [80.0, 70.0, 100.0]}
    peer = {"rounds_ms": [112.0, 119.0, 130.0]}  # per round 1.4, 1.7, 1.3: median 1.4 (the medians' ratio: 119 / 80)
    assert tb._paired_ratio(ours, peer) == pytest.approx(1.4)
    assert tb._paired_ratio({"rounds_ms": [80.0, 70.0]}, peer) is None  # a variant that failed in a round
    assert tb._paired_ratio({}, peer) is None


def test_rounds_report_the_hosts_wait_per_step_where_a_step_counts_it():
    """measure_rounds: a step that records its waits for the GPU (`waited`, as make_fast_step's) gets their median
    per step in ms (here 1.5 ms a call); a step without it (SpecForge's) gets none; patched steps keep the count."""
    import torch

    tb = load_benchmark("train_bench")

    def make():
        waited = [0.0]

        def step():
            waited[0] += 0.0015
            return torch.tensor(1.0)

        step.waited = waited
        return step

    wrapped = tb.with_kernel(make(), "gqa_flash", "off")
    assert wrapped.waited is not None
    runs = {}
    tb.measure_rounds(
        [("eyas", make), ("peer", lambda: lambda: torch.tensor(1.0)), ("wrapped", lambda: wrapped)],
        runs,
        rounds=3,
        warmup=1,
        steps=2,
        device=torch.device("cpu"),
        tokens_per_step=10,
    )
    assert runs["eyas"]["wait_ms"] == pytest.approx(1.5) and runs["wrapped"]["wait_ms"] == pytest.approx(1.5)
    assert "wait_ms" not in runs["peer"] and runs["peer"]["tokens_per_s"] > 0


def test_the_smol_suites_steady_rate_and_wait_come_from_the_records_after_skip(tmp_path):
    """_steady: tokens/s over the timed steps' own seconds, and the median of their host waits in ms (a record
    written before host_wait_s counts 0)."""
    import json

    tb = load_benchmark("train_bench")
    recs = [
        dict(step=1, tokens=999, supervised_tokens=999, padded_tokens=999, step_s=9.0, host_wait_s=5.0, loss=3.0),
        dict(step=2, tokens=100, supervised_tokens=60, padded_tokens=125, step_s=0.5, host_wait_s=0.002, loss=2.0),
        dict(step=3, tokens=300, supervised_tokens=140, padded_tokens=375, step_s=0.5, host_wait_s=0.010, loss=1.0),
        dict(step=4, tokens=200, supervised_tokens=100, padded_tokens=200, step_s=1.0, loss=0.5),
    ]
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs) + json.dumps({"eval": True, "loss": 9}) + "\n")
    r = tb._steady(f, skip=1)
    assert r["steps_timed"] == 3
    assert r["tokens_per_s"] == pytest.approx(600 / 2.0) and r["supervised_tokens_per_s"] == pytest.approx(150.0)
    assert r["useful_fraction"] == pytest.approx(600 / 700)
    assert r["wait_ms"] == pytest.approx(2.0)  # median of 2, 10 and 0 ms
    assert r["final_loss"] == 0.5


def test_the_muon_variant_steps_with_muon_and_moves_other_weights_than_adamw(monkeypatch):
    """make_fast_step(optimizer="muon") (the 8b variant eyas-muon) builds MuonAdamW and its steps run; from the same
    start, its weights after two steps differ from AdamW's (it is not AdamW under another name)."""
    import torch

    from eyas.train import optim

    tb = load_benchmark("train_bench")
    built = []
    monkeypatch.setattr(
        optim.MuonAdamW, "step", lambda self, *a, _s=optim.MuonAdamW.step: built.append(1) or _s(self, *a)
    )
    c = tb.shapes(True)
    weights = {}
    for kind in ("adamw", "muon"):
        torch.manual_seed(0)
        step = tb.make_fast_step(c, B=1, T=64, K=2, device=torch.device("cpu"), optimizer=kind)
        step()
        step()
        fc = [cell.cell_contents for cell in step.__closure__ if isinstance(cell.cell_contents, torch.nn.Module)]
        weights[kind] = [p.detach().clone() for p in fc[0].parameters() if p.requires_grad and p.ndim == 2]
    assert built == [1, 1]  # two Muon steps, none for AdamW
    assert any(not torch.equal(a, b) for a, b in zip(weights["adamw"], weights["muon"]))
