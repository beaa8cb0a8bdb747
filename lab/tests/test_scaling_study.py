"""lab/scripts/scaling_study.py's scheduler with fake children (no process, no model): one child per
slot at a time, a failure that leaves the others' results, and the deadline stopping every child."""

from __future__ import annotations

from lab.tests.conftest import load_script


def _study():
    return load_script("scaling_study")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeChild:
    """Exits with `rc` once the clock reaches `end`; on SIGTERM exits with -15 (or `rc_on_term`)."""

    def __init__(self, clock, item, slot, *, seconds, rc=0, rc_on_term=-15, ignores_term=False):
        self.clock, self.item, self.slot = clock, item, slot
        self.start, self.end, self.rc = clock(), clock() + seconds, rc
        self.rc_on_term, self.ignores_term = rc_on_term, ignores_term
        self.signals: list[str] = []
        self.exited: float | None = None

    def poll(self):
        if self.exited is None and "KILL" in self.signals:
            self.exited, self.rc = self.clock(), -9
        elif self.exited is None and "TERM" in self.signals and not self.ignores_term:
            self.exited, self.rc = self.clock(), self.rc_on_term
        elif self.exited is None and self.clock() >= self.end:
            self.exited = self.clock()
        return self.rc if self.exited is not None else None

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")


def _run(mod, items, slots, durations, *, deadline=1e9, rcs=None, **kw):
    clock = Clock()
    launched: list[FakeChild] = []
    exits: list[tuple] = []

    def launch(item, slot):
        c = FakeChild(clock, item, slot, seconds=durations[item], rc=(rcs or {}).get(item, 0), **kw)
        launched.append(c)
        return c

    def on_exit(item, child, rc):
        exits.append((item, rc, clock()))
        return rc == 0

    out = mod.schedule(
        items,
        slots,
        launch,
        on_exit,
        deadline=deadline,
        clock=clock,
        sleep=clock.sleep,
        poll_s=1.0,
        start_margin_s=30.0,
        grace_s=60.0,
    )
    return out, launched, exits


def _overlap(a, b) -> bool:
    return a.start < b.exited and b.start < a.exited


def test_at_most_one_child_per_slot_and_every_slot_used():
    mod = _study()
    items = ["a", "b", "c", "d", "e"]
    out, launched, exits = _run(mod, items, ["0", "1"], {"a": 100, "b": 10, "c": 10, "d": 50, "e": 5})
    assert not out.stopped and out.failed == 0
    assert [c.item for c in launched] == items  # started in order
    assert sorted(e[0] for e in exits) == items
    for slot in ("0", "1"):
        mine = [c for c in launched if c.slot == slot]
        assert all(not _overlap(x, y) for i, x in enumerate(mine) for y in mine[i + 1 :])
    # b, c, d ran on slot 1 while a held slot 0: concurrency, not a queue
    assert {c.slot for c in launched if c.item in "bcd"} == {"1"} and launched[0].slot == "0"
    assert max(c.exited for c in launched) < 100 + 10  # not 175 s, the sequential sum


def test_one_slot_without_pinning_runs_in_sequence():
    mod = _study()
    out, launched, _ = _run(mod, ["a", "b"], [None], {"a": 5, "b": 5})
    assert [c.slot for c in launched] == [None, None] and launched[1].start >= launched[0].exited


def test_a_failed_child_is_reported_and_the_others_finish():
    mod = _study()
    out, launched, exits = _run(mod, ["a", "b", "c"], ["0", "1"], {"a": 20, "b": 5, "c": 5}, rcs={"b": 3})
    assert out.failed == 1 and not out.stopped
    assert {(e[0], e[1]) for e in exits} == {("a", 0), ("b", 3), ("c", 0)}


def test_deadline_stops_every_running_child_and_starts_no_new_one():
    mod = _study()
    out, launched, exits = _run(
        mod, ["a", "b", "c", "d"], ["0", "1"], {"a": 500, "b": 60, "c": 500, "d": 5}, deadline=200
    )
    assert out.stopped and out.failed == 0
    assert [e[0] for e in exits] == ["b"]  # only the one that finished by itself reached on_exit
    assert [c.item for c in launched] == ["a", "b", "c"]  # d never started
    for c in launched[::2]:
        assert c.signals == ["TERM"] and c.exited is not None and c.exited >= 200


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    mod = _study()
    out, launched, exits = _run(mod, ["a"], ["0"], {"a": 10_000}, deadline=100, ignores_term=True)
    assert out.stopped and exits == []
    assert launched[0].signals == ["TERM", "KILL"] and launched[0].exited >= 100 + 60


def test_too_close_to_the_deadline_nothing_starts():
    mod = _study()
    out, launched, _ = _run(mod, ["a"], ["0"], {"a": 1}, deadline=10)
    assert out.stopped and launched == []


def test_a_child_that_finishes_during_its_grace_keeps_its_result():
    mod = _study()
    out, launched, exits = _run(mod, ["a"], ["0"], {"a": 500}, deadline=100, rc_on_term=0)
    assert out.stopped and [(e[0], e[1]) for e in exits] == [("a", 0)]


# -- points measured elsewhere, held-out curves ------------------------------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _point(n, steps, chain, tree, **kw):
    return {
        "conversations": n,
        "steps": steps,
        "tokens_seen": steps * 65536,
        "tau_chain": chain,
        "tau_tree": tree,
        **kw,
    }


def test_heldout_curve_sums_the_tokens_up_to_each_eval_and_keeps_a_resumed_steps_last_record(tmp_path):
    mod = _study()
    recs = [
        {"step": 1, "tokens": 100},
        {"step": 2, "tokens": 110},
        {"eval": True, "step": 2, "acceptance_length": 1.5},
        {"step": 3, "tokens": 120},
        # a crash after step 3, resumed from step 2's checkpoint: step 3 logged again, with other tokens
        {"step": 3, "tokens": 130},
        {"step": 4, "tokens": 90},
        {"eval": True, "step": 4, "acceptance_length": 2.25},
    ]
    m = tmp_path / "metrics.jsonl"
    m.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    per_step, taus = mod.train_log(m)
    assert mod.heldout_curve(per_step, taus) == [[2, 210, 1.5], [4, 430, 2.25]]
    assert per_step == {1: 100, 2: 110, 3: 130, 4: 90} and taus == {2: 1.5, 4: 2.25}


def test_read_points_names_the_file_and_line_of_a_bad_record(tmp_path):
    mod = _study()
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(_point(2000, 2400, 2.0, 2.8)) + "\n\n" + json.dumps({"conversations": 6000}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:3: a point record needs steps, tokens_seen, tau_chain, tau_tree"):
        mod.read_points(f)
    f.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: not JSON"):
        mod.read_points(f)
    f.write_text(json.dumps(_point(2000, 2400, 2.0, 2.8)) + "\n")
    assert mod.read_points(f)[0]["source"] == str(f)  # a record without a source is named by its file


def test_a_point_measured_in_the_root_wins_over_an_added_one():
    mod = _study()
    added = [_point(2000, 2400, 1.0, 1.0, source="a"), _point(17293, 2400, 2.6, 3.7, source="a")]
    own = [_point(2000, 2400, 2.0, 2.8)]
    merged = {(p["conversations"], p["steps"]): p for p in mod.merge_points(own, added)}
    assert len(merged) == 2 and merged[(2000, 2400)]["tau_chain"] == 2.0 and merged[(17293, 2400)]["source"] == "a"


def _study_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, str(REPO / "lab" / "scripts" / "scaling_study.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_added_points_count_as_done_and_enter_the_table_and_trend(tmp_path):
    """--add-points: a grid whose points were all measured elsewhere runs nothing (no pipeline, so no model or
    data is needed) and writes the table and the trend from them; the root's own points.jsonl is not written."""
    f = tmp_path / "earlier.jsonl"
    f.write_text(
        json.dumps(_point(2000, 2400, 2.0, 2.5, source="session A"))
        + "\n"
        + json.dumps(_point(8000, 2400, 2.4, 3.3, source="session B"))
        + "\n"
    )
    root = tmp_path / "study"
    r = _study_cli(
        "--root",
        str(root),
        "--conversations",
        "2000,8000",
        "--steps",
        "2400",
        "--add-points",
        str(f),
        "--max-minutes",
        "1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["done"] and out["points_done"] == 2 and out["points_left"] == []
    # two doublings from 2,000 to 8,000: 0.2 chain and 0.4 tree per doubling
    assert out["trend"] == {"tau_chain_per_doubling_s2400": 0.2, "tau_tree_per_doubling_s2400": 0.4}
    table = (root / "scaling.md").read_text()
    assert "| 2,000 | 2,400 |" in table and "session B |" in table
    assert not (root / "points.jsonl").exists()


def test_a_bad_added_points_file_is_a_usage_error_naming_it(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"conversations": 2000, "steps": 2400}) + "\n")
    r = _study_cli("--root", str(tmp_path / "s"), "--add-points", str(f), cwd=tmp_path)
    assert r.returncode == 2 and "bad.jsonl:1: a point record needs tokens_seen, tau_chain, tau_tree" in r.stderr
    r = _study_cli("--root", str(tmp_path / "s"), "--add-points", str(tmp_path / "absent.jsonl"), cwd=tmp_path)
    assert r.returncode == 2 and "absent.jsonl" in r.stderr


def test_the_committed_points_are_readable():
    mod = _study()
    pts = mod.read_points(REPO / "lab" / "scripts" / "scaling_points.jsonl")
    assert {(p["conversations"], p["steps"]) for p in pts} >= {(17293, 2400)}
    for p in pts:
        assert all(c[0] % 200 == 0 for c in p.get("heldout_tau", []))
