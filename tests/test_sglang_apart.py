"""eyas/sglang/apart.py: the SGLang capture's transformers work in a child process (`Apart`)."""

from __future__ import annotations

import threading

import pytest

from eyas.errors import EyasError
from eyas.sglang import apart


def test_calls_run_in_order_and_their_errors_reach_the_caller(monkeypatch):
    seen = []

    def note(state, *, x):
        seen.append((threading.current_thread().name, x))
        state.setdefault("xs", []).append(x)
        return list(state["xs"])

    class Local(Exception):  # a class defined here does not pickle: the queue to a parent could not carry it
        pass

    def refuse(state, *, what):
        raise EyasError(what) if what == "user" else Local("not picklable")

    monkeypatch.setitem(apart.OPS, "note", note)
    monkeypatch.setitem(apart.OPS, "refuse", refuse)
    a = apart.Apart(start=apart.started_in_thread)
    try:
        futures = [a.call("note", x=k) for k in range(5)]
        assert [f.result(10) for f in futures][-1] == [0, 1, 2, 3, 4]  # in order, the state kept between calls
        assert {name for name, _ in seen} == {"eyas-capture-apart"}  # on the child's loop, not the caller's thread
        with pytest.raises(EyasError, match="user"):
            a.call("refuse", what="user").result(10)
        with pytest.raises(RuntimeError, match="refuse: Local: not picklable"):
            a.call("refuse", what="local").result(10)
        assert a.call("note", x=5).result(10)[-1] == 5  # an error leaves the loop serving
    finally:
        a.close()
    a._worker.join(10)
    assert not a._worker.is_alive()  # it ended on its own


@pytest.mark.capture_child
def test_a_child_that_dies_fails_the_call_instead_of_hanging_it(tiny_target_dir):
    import eyas.target

    a = apart.Apart()
    try:
        assert a._worker.name == "eyas-capture-apart" and hasattr(a._worker, "pid")  # a process
        want = eyas.target.tokenizer_hash(eyas.target.load_tokenizer(tiny_target_dir))
        assert a.call("tokenizer_hash", target=str(tiny_target_dir)).result(120) == want
        a._worker.kill()
        a._worker.join(10)
        with pytest.raises(RuntimeError, match=r"child process for tokenizer_hash ended \(exit -9;"):
            a.call("tokenizer_hash", target=str(tiny_target_dir)).result(30)
    finally:
        a.close()
