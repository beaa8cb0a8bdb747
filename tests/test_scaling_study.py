"""benchmarks/scaling_study.py's scheduler with fake children (no process, no model): one child per
slot at a time, a failure that leaves the others' results, and the deadline stopping every child."""

from __future__ import annotations

from tests.conftest import load_benchmark


def _study():
    return load_benchmark("scaling_study")


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

    out = mod.schedule(items, slots, launch, on_exit, deadline=deadline, clock=clock, sleep=clock.sleep,
                       poll_s=1.0, start_margin_s=30.0, grace_s=60.0)
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
        assert all(not _overlap(x, y) for i, x in enumerate(mine) for y in mine[i + 1:])
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
    out, launched, exits = _run(mod, ["a", "b", "c", "d"], ["0", "1"], {"a": 500, "b": 60, "c": 500, "d": 5},
                                deadline=200)
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
