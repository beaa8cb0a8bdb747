"""lab/scripts/specforge_side_by_side.py --eyas-variant: what a method ablation may change, checked before any work
(the end-to-end run with a variant is in tests/test_specforge_side_by_side.py, where SpecForge is importable)."""

from __future__ import annotations

import pytest

from lab.tests.conftest import load_script


def test_variants_parse_as_toml_values_and_refuse_what_would_change_the_budget():
    parse = load_script("specforge_side_by_side").parse_variants
    assert parse(["decay1:ttt_decay=1.0", "lr3:lr=3e-4,warmup_steps=5", "t05:teacher_temperature=0.5"]) == {
        "decay1": {"ttt_decay": 1.0},
        "lr3": {"lr": 3e-4, "warmup_steps": 5},
        "t05": {"teacher_temperature": 0.5},
    }
    for bad, why in (
        (["steps:steps=100"], "'steps' is not a TrainConfig setting a variant may change"),
        (["b:batch_size=32"], "'batch_size' is not"),
        (["w:draft_intermediate_size=6144"], "'draft_intermediate_size' is not"),
        (["x:no_such_key=1"], "'no_such_key' is not"),
        (["nocolon"], "expected a new NAME"),
        (["a:lr=1e-4", "a:lr=2e-4"], "expected a new NAME"),
        (["a/b:lr=1e-4"], "expected a new NAME"),
    ):
        with pytest.raises(SystemExit, match=why):
            parse(bad)


def test_a_variant_may_force_a_kernel_while_it_trains(monkeypatch):
    """kernels.NAME=true|false: parsed as a bool, refused when it names no kernel, and set only inside the variant's
    context (EYAS_KERNELS)."""
    from eyas import kernels

    monkeypatch.delenv(kernels.ENV, raising=False)
    sbs = load_script("specforge_side_by_side")
    sets = sbs.parse_variants(["p:align_topk=4,kernels.teacher_stats=false"])["p"]
    assert sets == {"align_topk": 4, "kernels.teacher_stats": False}
    with sbs.module_flags(sets):
        assert kernels.setting("teacher_stats") == "off"
    assert kernels.setting("teacher_stats") == "auto"
    for bad, why in (
        (["p:kernels.ce=1"], "takes true or false"),
        (["p:kernels.no_such=true"], "expected kernels.NAME"),
        (["p:ttt.PRUNE_UNREACHED=true"], "expected kernels.NAME"),
    ):
        with pytest.raises(SystemExit, match=why):
            sbs.parse_variants(bad)


def test_an_eval_is_reused_for_the_same_drafter_reached_through_a_link(tmp_path):
    """side_by_side_lr (quality_session.sh) links the lr3e-4 variant's drafter and eval into its own root: the
    eval is reused there, not run again; a different drafter or setting is run."""
    import json

    from eyas.specdec.run import EvalConfig

    same_eval = load_script("specforge_side_by_side").same_eval
    real, other = tmp_path / "sbs" / "eyas-lr3e-4-sglang", tmp_path / "sbs" / "eyas-sglang"
    real.mkdir(parents=True)
    other.mkdir()
    link = tmp_path / "sbs-lr3e-4" / "eyas-sglang"
    link.parent.mkdir()
    link.symlink_to(real)
    cfg = EvalConfig(drafter=real, target="t", prompts="mtbench", limit=2, max_new_tokens=8)
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps(
            {"settings": {"drafter": str(real), "target": "t", "prompts": "mtbench", "limit": 2, "max_new_tokens": 8}}
        )
    )
    assert same_eval(report, cfg)
    assert same_eval(report, EvalConfig(drafter=link, target="t", prompts="mtbench", limit=2, max_new_tokens=8))
    assert not same_eval(report, EvalConfig(drafter=other, target="t", prompts="mtbench", limit=2, max_new_tokens=8))
    assert not same_eval(report, EvalConfig(drafter=link, target="t", prompts="mtbench", limit=3, max_new_tokens=8))
