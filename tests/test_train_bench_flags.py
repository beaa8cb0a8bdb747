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
