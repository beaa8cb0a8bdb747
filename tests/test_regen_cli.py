"""`eyas regenerate` end to end on a tiny target, and `eyas prepare` reading what it wrote."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.regen.output import read_chats
from eyas.regen.run import RegenConfig, regenerate


@pytest.fixture
def chats(tmp_path):
    recs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Question {i}?"},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "And then?"},
                {"from": "gpt", "value": "old"},
            ],
        }
        for i in range(5)
    ]
    recs.append(
        {"id": "long", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "x"}]}
    )
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(recs))
    return path


def _last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_cli_regenerate_then_prepare(chats, tiny_target_dir, tmp_path):
    out = tmp_path / "regen"
    runner = CliRunner()
    args = [
        "regenerate",
        "--source",
        str(chats),
        "--target",
        str(tiny_target_dir),
        "--out",
        str(out),
        "--max-new-tokens",
        "5",
        "--max-length",
        "200",
        "--batch-size",
        "3",
        "--device",
        "cpu",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = _last_json(r.stdout)
    assert summary["engine"] == "static" and summary["written"] == 5
    assert summary["skipped"] == {"context_overflow": 1}
    assert summary["assistant_turns"] == 5  # random target: every first answer is truncated -> stop
    assert summary["truncated_turns"] == 5 and summary["answer_tokens"] == 25
    stats = summary["engine_stats"]
    assert stats["new_tokens"] == 25 and stats["requests"] == 5 and stats["decode_steps"] >= 5 * 4 / 3
    assert 0 < stats["occupancy"] <= 1 and 0 < stats["attention_efficiency"] <= 1
    assert stats["prefill_padding"] == 0.0 and stats["prefill_tokens"] > 0  # packed prompts, no padding
    assert stats["decode_tokens"] == 25 - 5 and stats["decode_tok_s"] > 0 and stats["prefill_tok_s"] > 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["target"]["path"] == str(tiny_target_dir.resolve())
    assert meta["settings"]["sampling"]["greedy"] is True
    assert meta["source_info"]["format"] == "json" and meta["engine"]["engine"] == "static"
    recs = read_chats(out)
    assert all(m.get("truncated") for r in recs for m in r["messages"] if m["role"] == "assistant")

    # the same command again: everything already decided, nothing regenerated
    again = _last_json(runner.invoke(app, args).stdout)
    assert again["resumed"] is True and again["tokens_this_run"] == 0 and again["written"] == 5

    # a different setting on the same --out is refused with a clear message (exit 2)
    r = runner.invoke(app, args[:-2] + ["--device", "cpu", "--temperature", "0.5"])
    assert r.exit_code == 2 and "different settings" in r.stderr

    prep = runner.invoke(
        app,
        [
            "prepare",
            "--source",
            str(out),
            "--target",
            str(tiny_target_dir),
            "--out",
            str(tmp_path / "prep"),
            "--eval-fraction",
            "0",
        ],
    )
    assert prep.exit_code == 0, prep.output


def test_sampled_run_is_reproducible(chats, tiny_target_dir, tmp_path):
    kw = dict(
        source=str(chats),
        target=str(tiny_target_dir),
        max_new_tokens=6,
        max_length=200,
        device="cpu",
        temperature=0.8,
        top_p=0.9,
        seed=3,
        continue_after_truncated=True,
    )
    a = regenerate(RegenConfig(out=tmp_path / "a", batch_size=2, **kw))
    b = regenerate(RegenConfig(out=tmp_path / "b", batch_size=4, **kw))
    assert a["assistant_turns"] == b["assistant_turns"] == 10
    assert read_chats(tmp_path / "a") == read_chats(tmp_path / "b")
    c = regenerate(RegenConfig(out=tmp_path / "c", batch_size=4, **{**kw, "seed": 4}))
    assert c["written"] == 5 and read_chats(tmp_path / "c") != read_chats(tmp_path / "a")


def test_empty_and_bad_inputs(tmp_path, tiny_target_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    runner = CliRunner()
    r = runner.invoke(
        app, ["regenerate", "--source", str(empty), "--target", str(tiny_target_dir), "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 2 and "empty" in r.stderr
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{not json\n')
    r = runner.invoke(
        app, ["regenerate", "--source", str(bad), "--target", str(tiny_target_dir), "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 2 and "line 2" in r.stderr
    r = runner.invoke(
        app,
        [
            "regenerate",
            "--source",
            str(bad),
            "--target",
            str(tiny_target_dir),
            "--out",
            str(tmp_path / "o"),
            "--top-p",
            "0",
        ],
    )
    assert r.exit_code == 2 and "--top-p" in r.stderr
    r = runner.invoke(
        app,
        [
            "regenerate",
            "--source",
            str(bad),
            "--target",
            str(tiny_target_dir),
            "--out",
            str(tmp_path / "o"),
            "--attention",
            "flex",
        ],
    )
    assert r.exit_code == 2 and "--attention" in r.stderr and "flex" in r.stderr
    assert not (tmp_path / "o").exists()


def test_sigterm_commits_finished_conversations_then_resume(chats, tiny_target_dir, tmp_path, monkeypatch):
    import os
    import signal

    from eyas.regen.driver import Regenerator

    kw = dict(
        source=str(chats), target=str(tiny_target_dir), max_new_tokens=4, max_length=200, device="cpu", batch_size=1
    )
    ref = regenerate(RegenConfig(out=tmp_path / "ref", **kw))
    real_deliver, seen = Regenerator.deliver, []

    def deliver(self, res):
        real_deliver(self, res)
        seen.append(res.key)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a cluster preempting the job would

    monkeypatch.setattr(Regenerator, "deliver", deliver)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        regenerate(RegenConfig(out=tmp_path / "out", **kw))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored
    assert len(read_chats(tmp_path / "out")) == 3  # committed on the way out (commit_every is 256)
    monkeypatch.setattr(Regenerator, "deliver", real_deliver)
    s = regenerate(RegenConfig(out=tmp_path / "out", **kw))
    assert s["resumed"] and s["written"] == ref["written"] == 5
    assert read_chats(tmp_path / "out") == read_chats(tmp_path / "ref")


def test_refusals_that_need_no_model_come_before_it_loads(chats, tiny_target_dir, tmp_path, monkeypatch):
    import eyas.regen.attention
    import eyas.target
    from eyas.errors import EyasError

    kw = dict(
        source=str(chats), target=str(tiny_target_dir), max_new_tokens=3, max_length=200, device="cpu", batch_size=2
    )
    regenerate(RegenConfig(out=tmp_path / "r", **kw))

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(eyas.target, "load_target", boom)
    with pytest.raises(EyasError, match=r"--out .*r holds a run with different settings \(max_new_tokens\)"):
        regenerate(RegenConfig(out=tmp_path / "r", **{**kw, "max_new_tokens": 5}))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match=r"--out .*mine exists and is not a regenerate output"):
        regenerate(RegenConfig(out=mine, **kw))
    monkeypatch.setattr(eyas.regen.attention, "triton_unavailable", lambda device: "triton is not importable (test)")
    with pytest.raises(
        EyasError, match=r"^--attention triton: triton is not importable \(test\); use --attention sdpa"
    ):
        regenerate(RegenConfig(out=tmp_path / "t", attention="triton", **kw))
    assert not (tmp_path / "t").exists()


def test_options_the_engine_would_ignore_are_refused(tmp_path):
    from eyas.errors import EyasError

    for engine in ("generate", "server"):
        urls = ["http://127.0.0.1:9"] if engine == "server" else []
        with pytest.raises(EyasError, match=rf"^--attention sdpa .*--engine {engine} does not use it"):
            RegenConfig(out=tmp_path / "o", engine=engine, attention="sdpa", server_urls=urls)
    with pytest.raises(EyasError, match=r"^--server-model foo .*pass --server-url too"):
        RegenConfig(out=tmp_path / "o", server_model="foo")
    RegenConfig(out=tmp_path / "o", server_model="foo", server_urls=["http://127.0.0.1:9"])
