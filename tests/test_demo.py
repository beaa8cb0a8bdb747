"""`eyas demo` end to end on the real embedded default, at a size CI can afford."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from eyas.cli import app


def test_demo_runs_the_whole_pipeline_and_resumes(tmp_path):
    args = ["demo", "--out", str(tmp_path / "demo"), "--chats", "24", "--max-length", "160", "--train-steps", "4",
            "--draft-vocab", "1024", "--eval-questions", "1", "--max-new-tokens", "12"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout.strip().splitlines()[-1])
    assert s["verify"]["ok"] and s["verify"]["numbers"]["checked"] > 0
    assert s["capture"]["samples"] == s["data"]["train_samples"] > 0
    assert s["train"]["steps"] == 4
    assert s["eval"]["sequences"] == 2 and s["eval"]["tau_chain"] >= 1.0 and s["eval"]["tau_tree"] >= 1.0
    for fmt in ("sglang", "vllm"):
        cfg = json.loads((tmp_path / "demo" / "export" / fmt / "config.json").read_text())
        assert cfg  # a serving config was written
    # a rerun resumes: the prepared data and the store are reused, training resumes from its checkpoint
    res2 = CliRunner().invoke(app, args)
    assert res2.exit_code == 0, res2.output
    s2 = json.loads(res2.stdout.strip().splitlines()[-1])
    assert s2["capture"]["resumed_samples"] == s["capture"]["samples"]
    assert s2["data"] == s["data"]
