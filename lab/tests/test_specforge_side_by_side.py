"""lab/scripts/specforge_side_by_side.py end to end on the CPU: capture, `eyas train`, conversion,
`specforge train` (lab/scripts/specforge_cpu.py), SpecForge's exporter and `eyas eval` of both drafters.

The target is a tiny random Llama with tied embeddings (SmolLM2's layout: no lm_head.weight, so the
shadow target names the embedding as SpecForge's head); the chats are its own greedy answers, so the
draft vocabulary covers what the target predicts and both trainers have a loss to lower. Skipped where
SpecForge 0.2.0 is not importable (CI). About 30 s on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_target

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "scripts" / "specforge_side_by_side.py"
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("specforge", "yaml", "pydantic")),
    reason="SpecForge 0.2.0 (with pyyaml, pydantic) is not importable",
)

STEPS, BATCH, SAMPLES, VOCAB = 4, 2, 8, 32


@pytest.fixture(scope="module")
def sbs_inputs(tmp_path_factory, smol_tokenizer):
    """(tiny tied target, prepared dataset of its own greedy answers to 8 chat prompts)."""
    from transformers import AutoModelForCausalLM

    from eyas.data.prepared import write_prepared
    from eyas.target import load_tokenizer, tokenizer_hash

    root = tmp_path_factory.mktemp("sbs_inputs")
    target = make_tiny_target(root / "target", smol_tokenizer, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    rows = []
    for i in range(SAMPLES):
        prompt = smol_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Question {i}: what is {i} x 7?"}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=smol_tokenizer.pad_token_id
            )[0].tolist()
        rows.append((f"s{i:03d}", ids, [k >= len(prompt) for k in range(len(ids))]))
    prepared = write_prepared(
        root / "prepared",
        {"train": rows, "eval": [("e0", *rows[0][1:])]},
        {"tokenizer_hash": tokenizer_hash(load_tokenizer(target))},
    )
    return target, prepared


def _run(target: Path, prepared: Path, out: Path, *extra: str) -> tuple[dict, str]:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--prepared",
        str(prepared),
        "--target",
        str(target),
        "--root",
        str(out),
        "--samples",
        str(SAMPLES),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--max-length",
        "128",
        "--draft-vocab",
        str(VOCAB),
        "--device",
        "cpu",
        "--eval-limit",
        "1",
        "--eval-max-new-tokens",
        "12",
        "--eval-tree-topk",
        "4",
        "--eval-tree-depth",
        "3",
        "--eval-tree-tokens",
        "8",
        *extra,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stdout.splitlines()
    # SpecForge's own prints go to stderr: stdout is the JSON line alone
    assert len(lines) == 1, f"stdout must be one JSON line, got: {res.stdout[-2000:]}"
    return json.loads(lines[0]), res.stderr


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_side_by_side_runs_end_to_end_on_cpu(tmp_path, sbs_inputs):
    import yaml

    target, prepared = sbs_inputs
    root = tmp_path / "sbs"
    result, err = _run(target, prepared, root)
    assert "specforge_error" not in result, err[-4000:]

    # both drafters evaluated, with the same (requested) settings
    assert set(result["eval"]) == {"eyas", "specforge"}
    reports = {n: json.loads((root / f"eval-{n}" / "report.json").read_text()) for n in ("eyas", "specforge")}
    settings = {n: {k: v for k, v in r["settings"].items() if k != "drafter"} for n, r in reports.items()}
    assert settings["eyas"] == settings["specforge"] == result["eval_settings"]
    s = result["eval_settings"]
    assert (s["limit"], s["max_new_tokens"], s["chain_k"], s["tree_topk"], s["tree_depth"], s["tree_tokens"]) == (
        1,
        12,
        7,
        4,
        3,
        8,
    )
    assert reports["eyas"]["drafter"]["path"] == str(root / "eyas-sglang")
    assert reports["specforge"]["drafter"]["path"] == str(root / "specforge-sglang")
    # taus present, finite, and the ratios are their quotients
    for name in ("eyas", "specforge"):
        for mode in ("chain", "tree"):
            tau = result["eval"][name][f"tau_{mode}"]
            assert tau is not None and math.isfinite(tau) and tau >= 1.0
            assert tau == round(reports[name]["modes"][mode]["acceptance_length"], 4)
    for mode in ("chain", "tree"):
        a, b = result["eval"]["eyas"][f"tau_{mode}"], result["eval"]["specforge"][f"tau_{mode}"]
        assert result[f"tau_{mode}_vs_specforge"] == round(a / b, 4)

    # SpecForge got the requested budget and trained every step of it, on all the samples
    cfg = yaml.safe_load((root / "specforge-run" / "specforge.yaml").read_text())
    t = cfg["training"]
    assert (t["max_steps"], t["batch_size"], t["ttt_length"], t["learning_rate"]) == (STEPS, BATCH, 7, 1e-4)
    assert cfg["data"]["max_length"] == 128
    assert (t["fsdp_sharding"], t["attention_backend"]) == ("NO_SHARD", "sdpa")  # the CPU-only settings
    assert cfg["model"]["lm_head_key"] == "model.embed_tokens.weight"  # tied target: the embedding is the head
    state = torch.load(root / "specforge-run" / f"sbs-step{STEPS}" / "training_state.pt", weights_only=False, mmap=True)
    assert state["global_step"] == STEPS and state["batch_size"] == BATCH and state["eagle3_ttt_length"] == 7
    assert state["dataset_size"] == SAMPLES == result["data"]["samples"] == result["data"]["specforge_files"]
    assert result["specforge_train"]["step"] == STEPS and math.isfinite(result["specforge_train"]["loss"])
    assert result["specforge_train"]["loss"] > 0
    assert (root / "eyas-train" / "checkpoints" / f"step-{STEPS:06d}.safetensors").is_file()
    assert math.isfinite(result["eyas_train"]["final_loss"]) and result["eyas_train"]["final_loss"] > 0

    # one draft vocabulary: eyas's, in SpecForge's mapping file, its checkpoint and its export
    eyas_w = _safetensors(root / "eyas-sglang" / "model.safetensors")
    sf_w = _safetensors(root / "specforge-sglang" / "model.safetensors")
    vm = torch.load(root / "specforge-features" / "vocab_mapping.pt")
    for d2t, t2d in (
        (sf_w["d2t"], sf_w["t2d"]),
        (vm["d2t"], vm["t2d"]),
        (state["draft_state_dict"]["d2t"], state["draft_state_dict"]["t2d"]),
    ):
        assert torch.equal(d2t.long(), eyas_w["d2t"].long()) and torch.equal(t2d.bool(), eyas_w["t2d"].bool())
    assert eyas_w["d2t"].numel() == VOCAB
    # SpecForge trained the drafter eyas exported (same shape), and its weights moved
    assert {k: v.shape for k, v in sf_w.items()} == {k: v.shape for k, v in eyas_w.items() if "embed" not in k}
    eyas_cfg, sf_cfg = (json.loads((root / d / "config.json").read_text()) for d in ("eyas-sglang", "specforge-sglang"))
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "draft_vocab_size",
        "vocab_size",
        "eagle_config",
        "target_hidden_size",
    ):
        assert sf_cfg[key] == eyas_cfg[key], key

    # a repeated call (as after a device call that ended early) redoes nothing and reports the same
    again, err2 = _run(target, prepared, root)
    for name in ("eyas train", "eyas export", "specforge train", "specforge export", "eval eyas", "eval specforge"):
        assert f"side by side: {name}: SKIPPED" in err2, name
    assert again["eval"] == result["eval"] and again["specforge_train"] == result["specforge_train"]

    # a method ablation against the same SpecForge drafter: only the variant trains and is evaluated
    ablation, err3 = _run(target, prepared, root, "--eyas-variant", "decay1:ttt_decay=1.0,lr=3e-4")
    for name in ("eyas train", "specforge train", "eval eyas", "eval specforge"):
        assert f"side by side: {name}: SKIPPED" in err3, name
    assert "side by side: eyas train, variant decay1 {'ttt_decay': 1.0, 'lr': 0.0003}: running" in err3
    # the variants come after both evals: a session cut short still has the main ratio
    assert err3.index("side by side: eval specforge: SKIPPED") < err3.index("side by side: eyas train, variant decay1")
    v = ablation["variants"]["decay1"]
    assert v["settings"] == {"ttt_decay": 1.0, "lr": 3e-4}
    for mode in ("chain", "tree"):
        a, b = ablation["eval"]["eyas-decay1"][f"tau_{mode}"], ablation["eval"]["specforge"][f"tau_{mode}"]
        assert v[f"tau_{mode}_vs_specforge"] == round(a / b, 4)
    assert ablation["eval"]["eyas"] == result["eval"]["eyas"]  # the default drafter's report, reused
    cfg_v = json.loads((root / "eyas-decay1-sglang" / "config.json").read_text())
    assert cfg_v == eyas_cfg  # the same drafter shape: only the training differs
    w_v = _safetensors(root / "eyas-decay1-sglang" / "model.safetensors")
    assert any(not torch.equal(w_v[k], eyas_w[k]) for k in eyas_w if "embed" not in k and k in w_v)
