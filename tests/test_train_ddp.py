"""Issue 7, CPU part: `torchrun --nproc_per_node 2` (gloo) trains exactly like one process with the
same global batch, with DDP and with FSDP2, and a 2-process checkpoint resumes in 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_train_loop import AUX, VOCAB_CAP, _train_records, world  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _args(world, out, *extra):  # noqa: F811
    return [
        "train",
        "--target",
        str(world["target"]),
        "--data",
        str(world["prep"]),
        "--out",
        str(out),
        "--draft-vocab",
        str(VOCAB_CAP),
        "--aux-layers",
        ",".join(map(str, AUX)),
        "--device",
        "cpu",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "1",
        "--max-length",
        "64",
        "--eval-samples",
        "4",
        *extra,
    ]


def _run(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _torchrun(*args):
    return _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "eyas", *args]
    )


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def test_two_processes_equal_one(world, tmp_path):  # noqa: F811
    from test_train_loop import _cfg

    from eyas.train.loop import run

    # AdamW set for one process and DDP: the default under --fsdp (which cannot run Muon), so the three compare
    one = tmp_path / "one"
    s_one = run(_cfg(world, one, data=world["prep"], steps=3, batch_size=2, optimizer="adamw"))  # global batch 2
    ddp = tmp_path / "ddp"
    s_ddp = _torchrun(
        *_args(world, ddp, "--steps", "3", "--batch-size", "1", "--save-every", "2", "--optimizer", "adamw")
    )
    fsdp = tmp_path / "fsdp"
    s_fsdp = _torchrun(*_args(world, fsdp, "--steps", "3", "--batch-size", "1", "--fsdp"))
    assert s_ddp["world"] == 2 and s_fsdp["world"] == 2
    ref = _train_records(one)
    assert s_one["eval"]["acc_per_step"][0] > 0  # a teacher the drafter can agree with
    for s in (s_ddp, s_fsdp):  # eval is sharded over ranks and summed: same figures
        assert s["eval"]["acc_per_step"] == pytest.approx(s_one["eval"]["acc_per_step"])
        assert s["eval"]["acceptance_length"] == pytest.approx(s_one["eval"]["acceptance_length"])
    for other in (ddp, fsdp):
        got = _train_records(other)
        assert len(got) == 3
        for a, b in zip(ref, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (other.name, a["step"])
            assert b["acc_per_step"] == pytest.approx(a["acc_per_step"])
            assert b["tokens"] == a["tokens"]
        wa, wb = _weights(one), _weights(other)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=f"{other.name} {k}")
    # the DDP run's step-2 checkpoint, resumed by ONE process, reproduces step 3
    (ddp / "checkpoints" / "step-000003.safetensors").unlink()
    lines = (ddp / "metrics.jsonl").read_text().splitlines()
    (ddp / "metrics.jsonl").write_text("\n".join(x for x in lines if json.loads(x)["step"] <= 2) + "\n")
    run(_cfg(world, ddp, data=world["prep"], steps=3, batch_size=2, resume="auto", overwrite=True))
    assert _train_records(ddp)[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=1e-5)


def test_token_batches_across_an_epoch_end_and_a_one_process_checkpoint_on_two(world, tmp_path):  # noqa: F811
    """1 process x --grad-accum 2 and 2 processes see the same token-packed micro-batches, also at an
    epoch's end where one slot is empty (that rank trains on a loss-free filler), and a checkpoint
    written by ONE process resumes on TWO."""
    from test_train_loop import _cfg

    from eyas.data.prepared import PreparedDataset
    from eyas.train.loop import run
    from eyas.train.plans import TokenPlan

    lengths = [int(x) for x in PreparedDataset(world["prep"]).split("train").lengths]
    budget = next(
        b
        for b in range(64, 200)
        if len(TokenPlan(lengths=lengths, tokens_per_batch=b, accum=1, world=1, seed=0).micro_batches(0)) % 2
    )
    plan = TokenPlan(lengths=lengths, tokens_per_batch=budget, accum=2, world=1, seed=0)
    steps = plan.steps_per_epoch + 1  # the epoch's last step has an empty slot, then the next epoch
    assert [] in plan.micro_indices(plan.steps_per_epoch - 1, 0)
    one = tmp_path / "one"
    run(
        _cfg(
            world,
            one,
            data=world["prep"],
            steps=steps,
            tokens_per_batch=budget,
            batch_size=None,
            grad_accum=2,
            save_every=1,
        )
    )
    two = tmp_path / "two"
    _torchrun(*_args(world, two, "--steps", str(steps), "--tokens-per-batch", str(budget)))
    ref, got = _train_records(one), _train_records(two)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["tokens"] == a["tokens"]
    # the 1-process run cut back to its step-(steps - 2) checkpoint, resumed by two processes
    k = steps - 2
    for f in (one / "checkpoints").iterdir():
        if f.name != f"step-{k:06d}.safetensors":
            f.unlink()
    lines = (one / "metrics.jsonl").read_text().splitlines()
    (one / "metrics.jsonl").write_text("\n".join(x for x in lines if json.loads(x)["step"] <= k) + "\n")
    _torchrun(
        *_args(world, one, "--steps", str(steps), "--tokens-per-batch", str(budget), "--resume", "auto", "--overwrite")
    )
    resumed = _train_records(one)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    assert [r["loss"] for r in resumed[k:]] == pytest.approx([r["loss"] for r in ref[k:]], rel=1e-5)


def test_bf16_gradient_reduce_trains_like_fp32_within_bf16_rounding(world, tmp_path):  # noqa: F811
    """--grad-reduce bf16: the hook runs (weights differ from the fp32 all-reduce's) and the run stays
    within bf16 rounding of one process with the same global batch."""
    from test_train_loop import _cfg

    from eyas.train.loop import run

    one = tmp_path / "one"  # (AdamW: the bounds below are Adam's; Muon's normalized update has others)
    run(_cfg(world, one, data=world["prep"], steps=3, batch_size=2, optimizer="adamw"))
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    _torchrun(*_args(world, fp32, "--steps", "3", "--batch-size", "1", "--optimizer", "adamw"))
    s = _torchrun(
        *_args(world, bf16, "--steps", "3", "--batch-size", "1", "--grad-reduce", "bf16", "--optimizer", "adamw")
    )
    assert s["world"] == 2
    ref, got = _train_records(one), _train_records(bf16)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=2e-2)
    wa, w32, w16 = _weights(one), _weights(fp32), _weights(bf16)
    assert any(not torch.equal(w16[k], w32[k]) for k in w32)  # the gradients really went through bf16
    lr = 3e-3  # _args: Adam moves a weight by about lr a step at most, whatever its gradient's scale
    for k in wa:
        d = (w16[k].float() - wa[k].float()).abs()
        assert d.max() <= 3 * lr, k  # 3 steps
        # only gradients that bf16 rounding flips (near zero) move Adam's step noticeably
        assert (d > lr / 10).float().mean() < 0.01, (k, (d > lr / 10).float().mean())


RANK1_SIGTERM = """
import os, signal, sys
from eyas.train import loop

calls, real = [], loop._clip


def clip(*a, **k):  # rank 1 alone is told to stop, during step 2
    calls.append(1)
    if len(calls) == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)


loop._clip = clip
from eyas.cli import main

sys.argv = ["eyas", *sys.argv[1:]]
main()
"""


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_one_checkpoint(world, tmp_path):  # noqa: F811
    """SIGTERM reaching rank 1 only, during step 2: both ranks finish the same step (2, or 3 when the statistics
    that carry the stop are read one step late), rank 0 alone writes its checkpoint, both exit
    130 saying so; one process resumes from it and ends where an uninterrupted run ends."""
    from test_train_loop import _cfg

    from eyas.train.loop import run

    last = 3

    one = tmp_path / "one"
    run(_cfg(world, one, data=world["prep"], steps=4, batch_size=2))
    script = tmp_path / "rank1_sigterm.py"
    script.write_text(RANK1_SIGTERM)
    two = tmp_path / "two"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            *_args(world, two, "--steps", "4", "--batch-size", "1"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode != 0
    assert res.stderr.count(f"interrupted: stopped after step {last} of 4, saved in ") == 2, res.stderr[-3000:]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [f"step-{last:06d}.safetensors"]
    assert [r["step"] for r in _train_records(two)] == list(range(1, last + 1))
    run(_cfg(world, two, data=world["prep"], steps=4, batch_size=2, resume="auto"))
    assert [r["loss"] for r in _train_records(two)] == pytest.approx([r["loss"] for r in _train_records(one)], rel=1e-5)


def test_muon_on_two_processes_equals_one(world, tmp_path):  # noqa: F811
    """--optimizer muon under DDP: every rank orthogonalizes the same all-reduced gradients, so two processes train
    exactly like one with the same global batch."""
    from test_train_loop import _cfg

    from eyas.train.loop import run

    one, ddp = tmp_path / "one", tmp_path / "ddp"
    run(_cfg(world, one, data=world["prep"], steps=3, batch_size=2, optimizer="muon"))
    _torchrun(*_args(world, ddp, "--steps", "3", "--batch-size", "1", "--optimizer", "muon"))
    ref, got = _train_records(one), _train_records(ddp)
    assert len(got) == 3
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    wa, wb = _weights(one), _weights(ddp)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
