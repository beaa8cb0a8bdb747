"""Turn-by-turn driving, failure accounting and exact resume, with a scripted fake engine."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eyas.data.sources import iter_conversations
from eyas.errors import EyasError
from eyas.regen.driver import Regenerator, RegenOptions
from eyas.regen.output import CHATS, META, ChatsWriter, read_chats
from eyas.regen.requests import CONTEXT_OVERFLOW, Result
from eyas.regen.sampling import Sampling


class Crash(Exception):
    pass


class FakeEngine:
    """Answers `A<turn>(<user text>)`; user texts script failures. Checks every prompt it gets."""

    def __init__(self, batch=3, crash_after=None):
        self.batch, self.crash_after, self.delivered = batch, crash_after, 0
        self.prompts = []

    def answer(self, req):
        msgs = req.messages
        assert msgs[-1]["role"] == "user"
        # later turns see the regenerated earlier answers, never the source's
        users = [m for m in msgs if m["role"] == "user"]
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                prev_user = [u for u in msgs[:k] if u["role"] == "user"][-1]["content"]
                assert m["content"].startswith("A") and prev_user in m["content"], m
        assert req.key[1] == len(users) - 1
        text = msgs[-1]["content"]
        if "OVERFLOW" in text:
            return Result(req.key, failure=CONTEXT_OVERFLOW, detail="too long")
        ans = "" if "EMPTY" in text else f"A{req.key[1]}({text})"
        return Result(req.key, text=ans, new_tokens=len(ans), truncated="TRUNC" in text)

    def run(self, pull, deliver):
        while True:
            reqs = pull(self.batch)
            if not reqs:
                return
            self.prompts += reqs
            for r in reqs:
                if self.crash_after is not None and self.delivered >= self.crash_after:
                    raise Crash("killed")
                self.delivered += 1
                deliver(self.answer(r))

    def describe(self):
        return {"engine": "fake"}


def _conv(i, users, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for u in users:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": f"ORIGINAL answer to {u}"}]
    return {"id": f"c{i}", "messages": msgs}


@pytest.fixture
def source(tmp_path):
    records = [
        _conv(0, ["hi", "more", "again"], system="be brief"),
        _conv(1, ["one"]),
        _conv(2, ["OVERFLOW first"]),
        _conv(3, ["fine", "OVERFLOW later", "never asked"]),
        _conv(4, ["EMPTY please"]),
        _conv(5, ["TRUNC me", "after trunc"]),
        {"id": "c6", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
    ] + [_conv(i, [f"q{i}", f"r{i}"]) for i in range(7, 30)]
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SETTINGS = {"target": "fake", "max_new_tokens": 5}


def _drive(source, out, *, engine, options=None, settings=SETTINGS):
    writer = ChatsWriter(out, settings=settings, extra_meta={"engine": engine.describe()})
    opts = options or RegenOptions(max_new_tokens=5, commit_every=4, max_in_flight=5)
    drv = Regenerator(enumerate(iter_conversations(source)), writer, sampling=Sampling(), options=opts, total=30)
    drv.run(engine)
    return writer


def test_turn_by_turn_records_and_counts(source, tmp_path):
    out = tmp_path / "out"
    _drive(source, out, engine=FakeEngine())
    recs = {r["id"]: r["messages"] for r in read_chats(out)}
    assert recs["c0"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "A0(hi)"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "A1(more)"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "A2(again)"},
    ]
    assert recs["c1"][-1] == {"role": "assistant", "content": "A0(one)"}
    assert "c2" not in recs and "c4" not in recs and "c6" not in recs
    # a later overflow keeps the answered turns and drops the unanswered user turn
    assert [m["content"] for m in recs["c3"]] == ["fine", "A0(fine)"]
    # a truncated answer is marked and ends the conversation
    assert recs["c5"] == [
        {"role": "user", "content": "TRUNC me"},
        {"role": "assistant", "content": "A0(TRUNC me)", "truncated": True},
    ]
    meta = json.loads((out / META).read_text())
    assert meta["complete"] is True and meta["schema"] == "eyas.chats/1"
    c = meta["counts"]
    assert c["conversations"] == 30 and c["written"] == 27
    assert c["skipped"] == {"context_overflow": 1, "empty_answer": 1, "roles_not_alternating": 1}
    assert c["failed_turns"] == {"context_overflow": 2, "empty_answer": 1}
    assert c["truncated_turns"] == 1
    assert c["assistant_turns"] == 3 + 1 + 1 + 1 + 2 * 23
    assert len(recs) == 27


def test_max_turns_and_continue_after_truncated(source, tmp_path):
    eng = FakeEngine()
    _drive(source, tmp_path / "o", engine=eng, options=RegenOptions(max_turns=1, continue_after_truncated=True))
    recs = {r["id"]: r["messages"] for r in read_chats(tmp_path / "o")}
    assert all(sum(m["role"] == "user" for m in msgs) == 1 for msgs in recs.values())
    assert max(r.key[1] for r in eng.prompts) == 0
    _drive(source, tmp_path / "o2", engine=FakeEngine(), options=RegenOptions(continue_after_truncated=True))
    recs2 = {r["id"]: r["messages"] for r in read_chats(tmp_path / "o2")}
    assert [m.get("truncated", False) for m in recs2["c5"] if m["role"] == "assistant"] == [True, False]


def test_killed_run_resumes_without_duplicates(source, tmp_path):
    ref = {r["id"]: r for r in read_chats(_drive(source, tmp_path / "ref", engine=FakeEngine()).out)}
    out = tmp_path / "out"
    with pytest.raises(Crash):
        _drive(source, out, engine=FakeEngine(crash_after=17))
    first = read_chats(out)
    assert 0 < len(first) < len(ref)
    meta = json.loads((out / META).read_text())
    assert meta["complete"] is False
    # a torn record after the last commit (the kill hit mid-write) must not survive
    with open(out / CHATS, "a") as f:
        f.write('{"id": "c9", "messages": [{"role": "us')
    eng = FakeEngine()
    w = _drive(source, out, engine=eng)
    assert w.resumed
    done_before = {r["id"] for r in first}
    asked = {f"c{r.key[0]}" for r in eng.prompts}  # source index i holds id c<i>
    assert asked and not done_before & asked  # nothing redone ...
    final = read_chats(out)
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == len(ref)  # ... nothing duplicated, nothing lost
    assert {r["id"]: r for r in final} == ref
    text = (out / CHATS).read_text()
    assert all(json.loads(line) for line in text.splitlines())
    assert json.loads((out / META).read_text())["counts"]["conversations"] == 30


def test_resume_with_other_settings_is_refused(source, tmp_path):
    out = tmp_path / "out"
    _drive(source, out, engine=FakeEngine())
    with pytest.raises(EyasError, match="different settings.*max_new_tokens"):
        ChatsWriter(out, settings={**SETTINGS, "max_new_tokens": 6}, extra_meta={})
    (out / "NOTES.txt").write_text("mine")
    w = ChatsWriter(out, settings={**SETTINGS, "max_new_tokens": 6}, extra_meta={}, overwrite=True)
    assert not w.resumed and read_chats(out) == []
    assert (out / "NOTES.txt").read_text() == "mine"  # --overwrite removes only what regenerate wrote


def test_changed_source_is_detected_on_resume(source, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Crash):
        _drive(source, out, engine=FakeEngine(crash_after=10))
    lines = source.read_text().splitlines()
    source.write_text("\n".join([lines[1], lines[0]] + lines[2:]) + "\n")
    with pytest.raises(EyasError, match="source changed"):
        _drive(source, out, engine=FakeEngine())


def test_not_an_output_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("hi")
    with pytest.raises(EyasError, match="not a regenerate output"):
        ChatsWriter(tmp_path / "x", settings=SETTINGS, extra_meta={})
    with pytest.raises(EyasError, match="refusing to delete"):
        ChatsWriter(tmp_path / "x", settings=SETTINGS, extra_meta={}, overwrite=True)
    assert (tmp_path / "x" / "file").read_text() == "hi"


def test_bounded_in_flight(source, tmp_path):
    class Watch(FakeEngine):
        def run(self, pull, deliver):
            self.max_open = 0
            super().run(lambda n: (setattr(self, "max_open", max(self.max_open, len(drv.open))), pull(n))[1], deliver)

    eng = Watch(batch=50)
    writer = ChatsWriter(tmp_path / "o", settings=SETTINGS, extra_meta={})
    drv = Regenerator(
        enumerate(iter_conversations(source)), writer, sampling=Sampling(), options=RegenOptions(max_in_flight=4)
    )
    drv.run(eng)
    assert eng.max_open <= 4
    assert Counter(r.key[0] for r in eng.prompts)[0] == 3  # c0's three turns


def _two_turn_source(path, n):
    recs = [_conv(i, [f"question {i} " + "word " * (3 * (i % 7)), f"and then {i}?"]) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_multi_turn_refill_keeps_batch_full(tiny_target_dir, smol_tokenizer, tmp_path):
    """2 user turns a conversation, every answer runs to max_new_tokens (a random target): new
    conversations and next turns must keep every row busy until the source runs dry."""
    import torch
    from transformers import AutoModelForCausalLM

    from eyas.regen.local import StaticEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    src = _two_turn_source(tmp_path / "src.jsonl", 24)
    eng = StaticEngine(
        model, smol_tokenizer, sampling=Sampling(), max_len=256, batch=4, max_new_tokens=16, sync_every=4, refill_min=1
    )
    writer = ChatsWriter(tmp_path / "o", settings=SETTINGS, extra_meta={})
    opts = RegenOptions(max_new_tokens=16, max_turns=2, continue_after_truncated=True, max_in_flight=4)
    drv = Regenerator(enumerate(iter_conversations(src)), writer, sampling=Sampling(), options=opts, total=24)
    drv.run(eng)
    stats = eng.stats()
    assert stats["requests"] == 48 and writer.counts()["assistant_turns"] == 48
    # A row is idle for at most the rest of a chunk after its answer ends (the answer's 15 decode
    # steps end 1 step into a chunk of 4), plus the tail once no conversation is left to start.
    assert stats["occupancy"] >= 0.85, stats
    assert stats["decode_steps"] <= 48 * 16 / 4 + 2 * 16, stats


def test_lookahead_starts_longer_conversations_first(source, tmp_path):
    """Read ahead, the 3-turn conversations start first and the 1-turn ones last; in source order
    with lookahead 1. The records do not depend on the order."""
    firsts, recs = {}, {}
    for lookahead in (1, 64):
        eng = FakeEngine()
        out = tmp_path / f"o{lookahead}"
        _drive(source, out, engine=eng, options=RegenOptions(max_new_tokens=5, max_in_flight=5, lookahead=lookahead))
        firsts[lookahead] = [r.key[0] for r in eng.prompts if r.key[1] == 0]
        recs[lookahead] = {r["id"]: r for r in read_chats(out)}
    assert firsts[1] == sorted(firsts[1])
    assert firsts[64][:2] == [0, 3] and set(firsts[64][-3:]) == {1, 2, 4}, firsts[64]
    assert sorted(firsts[64]) == firsts[1]
    assert recs[64] == recs[1]
    with pytest.raises(ValueError, match="lookahead"):
        RegenOptions(lookahead=0)
