"""`eyas demo` end to end on the real embedded default, at a size CI can afford."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from eyas.cli import app


def test_demo_runs_the_whole_pipeline_and_resumes(tmp_path):
    args = [
        "demo",
        "--out",
        str(tmp_path / "demo"),
        "--chats",
        "24",
        "--max-length",
        "160",
        "--train-steps",
        "4",
        "--draft-vocab",
        "1024",
        "--eval-questions",
        "1",
        "--max-new-tokens",
        "12",
    ]
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
        assert _dtypes(tmp_path / "demo" / "export" / fmt / "model.safetensors") <= {"BF16", "I64", "BOOL"}
    assert "F32" in _dtypes(tmp_path / "demo" / "train" / "drafter" / "model.safetensors")  # the one fp32 copy
    ckpts = sorted(p.name for p in (tmp_path / "demo" / "train" / "checkpoints").iterdir())
    assert ckpts == ["step-000003.safetensors", "step-000004.safetensors"]  # 4 saved, the latest 2 kept
    assert s["drafter"] in res.output and "eyas eval --drafter" in res.output
    # a rerun resumes: the prepared data and the store are reused, training resumes from its checkpoint
    res2 = CliRunner().invoke(app, args)
    assert res2.exit_code == 0, res2.output
    s2 = json.loads(res2.stdout.strip().splitlines()[-1])
    assert s2["capture"]["resumed_samples"] == s["capture"]["samples"]
    assert s2["data"] == s["data"]


def _dtypes(path):
    import struct

    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_the_demo_ends_with_what_to_do_next():
    """Where the drafter is, what its tau means, and runnable eval / export / serve commands on the demo's paths."""
    from pathlib import Path

    from eyas.demo import next_steps

    s = {
        "out": "runs/demo",
        "eval": {"tau_tree": 1.3, "tau_chain": 1.1},
        "drafter": "runs/demo/train/drafter",
        "export": {"sglang": "runs/demo/export/sglang", "vllm": "runs/demo/export/vllm"},
        "data": {"train_samples": 154},
    }
    text = "\n".join(next_steps(s, target=Path("/cache/smollm2")))
    assert "Drafter: runs/demo/train/drafter" in text and "tree 1.3, chain 1.1" in text and "154 chats" in text
    assert "eyas eval --drafter runs/demo/train/drafter --limit" in text
    assert "eyas export --drafter runs/demo/train/drafter --format sglang" in text
    assert "--model-path /cache/smollm2" in text and "--speculative-draft-model-path runs/demo/export/sglang" in text
    assert '"model": "runs/demo/export/vllm"' in text
