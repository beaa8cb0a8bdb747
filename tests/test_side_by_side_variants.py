"""benchmarks/specforge_side_by_side.py --eyas-variant: what a method ablation may change, checked before any work
(the end-to-end run with a variant is in tests/test_specforge_side_by_side.py, where SpecForge is importable)."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


def test_variants_parse_as_toml_values_and_refuse_what_would_change_the_budget():
    parse = load_benchmark("specforge_side_by_side").parse_variants
    assert parse(["decay1:ttt_decay=1.0", "lr3:lr=3e-4,warmup_steps=5"]) == \
        {"decay1": {"ttt_decay": 1.0}, "lr3": {"lr": 3e-4, "warmup_steps": 5}}
    for bad, why in ((["steps:steps=100"], "'steps' is not a TrainConfig setting a variant may change"),
                     (["b:batch_size=32"], "'batch_size' is not"),
                     (["w:draft_intermediate_size=6144"], "'draft_intermediate_size' is not"),
                     (["x:no_such_key=1"], "'no_such_key' is not"),
                     (["nocolon"], "expected a new NAME"),
                     (["a:lr=1e-4", "a:lr=2e-4"], "expected a new NAME"),
                     (["a/b:lr=1e-4"], "expected a new NAME")):
        with pytest.raises(SystemExit, match=why):
            parse(bad)
