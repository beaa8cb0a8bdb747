"""benchmarks/train_bench.py's module settings: --flag MODULE.NAME[=0] for the smol suite's real `eyas train`, and
the 8B suite's variants that change one setting while their step runs."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


def test_flags_name_existing_boolean_settings_and_variants_restore_them(monkeypatch):
    import eyas.drafter.ttt as ttt
    from eyas import packing

    tb = load_benchmark("train_bench")
    monkeypatch.setattr(packing, "GQA_FLASH", False)
    tb.set_flag("packing.GQA_FLASH")
    assert packing.GQA_FLASH is True
    tb.set_flag("packing.GQA_FLASH=0")
    assert packing.GQA_FLASH is False
    for bad in ("nomodule.X", "ttt.NO_SUCH_SETTING", "ttt.CAST_ONCE_MIN_HIDDEN", "packing.GQA_FLASH=2"):
        with pytest.raises(SystemExit, match="--flag"):
            tb.set_flag(bad)
    seen = []
    step = tb.with_flag(lambda: seen.append(ttt.GROUPED_DIAGONALS), "ttt.GROUPED_DIAGONALS", not ttt.GROUPED_DIAGONALS)
    before = ttt.GROUPED_DIAGONALS
    step()
    assert seen == [not before] and ttt.GROUPED_DIAGONALS is before  # changed only while the step ran


def test_paired_ratio_is_the_median_of_the_per_round_ratios():
    tb = load_benchmark("train_bench")
    ours = {"rounds_ms": [80.0, 70.0, 100.0]}
    peer = {"rounds_ms": [112.0, 119.0, 130.0]}  # per round 1.4, 1.7, 1.3: median 1.4 (the medians' ratio: 119 / 80)
    assert tb._paired_ratio(ours, peer) == pytest.approx(1.4)
    assert tb._paired_ratio({"rounds_ms": [80.0, 70.0]}, peer) is None  # a variant that failed in a round
    assert tb._paired_ratio({}, peer) is None
