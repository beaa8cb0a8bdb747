"""eyas.locks: one writer per output folder. A second writer (another real process) is refused with exit 2 naming
the folder and the holder's PID, readers of a store being written say it is incomplete, a killed holder leaves no
stale lock, and a process re-entering its own lock (eyas pipeline's stages) is not refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.errors import EyasError
from eyas.locks import command_scope, hold, holder, lock_file, require_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_HOLD = """
import sys, time
from eyas.locks import command_scope, hold
with command_scope():
    hold(sys.argv[1])
    print("held", flush=True)
    time.sleep(300)
"""


@contextlib.contextmanager
def held_elsewhere(path: Path):
    """Another process holding the lock of `path` (as a writing eyas command does); yields its PID."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _run(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_second_writer_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    with held_elsewhere(out) as proc:
        info = holder(out)
        assert info is not None and info["pid"] == proc.pid
        with (
            command_scope(),
            pytest.raises(
                EyasError,
                match=rf"--out .*run is being written by another eyas process "
                rf"\(pid {proc.pid}: eyas ",
            ),
        ):
            hold(out)
        with pytest.raises(
            EyasError,
            match=rf"store .*run is incomplete: another eyas process is writing it now "
            rf"\(pid {proc.pid}",
        ):
            require_idle(out, what="store")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert holder(out) is None  # the kernel dropped the lock with its process
    with command_scope():
        hold(out)
        hold(out)  # re-entrant within the process (a pipeline's stage)
        assert holder(out) is None  # (its own lock is no other process's)
        assert lock_file(out).is_file()
    assert not lock_file(out).exists()  # released and removed when the command ends


def test_two_names_of_one_folder_share_a_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with held_elsewhere(tmp_path / "real") as proc, command_scope(), pytest.raises(EyasError, match=f"pid {proc.pid}"):
        hold(tmp_path / "link")


def test_a_lock_is_only_checked_outside_a_command(tmp_path):
    """A library call (no CLI scope) checks for another writer but holds nothing after it returns."""
    hold(tmp_path / "x")
    assert not lock_file(tmp_path / "x").exists()
    with held_elsewhere(tmp_path / "x"), pytest.raises(EyasError, match="being written by another eyas process"):
        hold(tmp_path / "x")


def test_torchrun_ranks_other_than_0_leave_the_lock_to_rank_0(tmp_path, monkeypatch):
    with held_elsewhere(tmp_path / "x") as other:  # rank 0 (here: another process) holds it
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        with command_scope():
            hold(tmp_path / "x")  # a rank other than 0 takes no lock: no error although it is held
        assert holder(tmp_path / "x")["pid"] == other.pid
        monkeypatch.delenv("RANK")
        with command_scope(), pytest.raises(EyasError, match=str(other.pid)):
            hold(tmp_path / "x")  # rank 0 itself is refused


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_target_dir, smol_tokenizer):
    """What each writing command needs to reach its --out check: a prepared dataset, a drafter, chats, prompts."""
    from transformers import AutoConfig

    from eyas.data.prepared import write_prepared
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import tokenizer_hash

    root = tmp_path_factory.mktemp("lock_inputs")
    g = torch.Generator().manual_seed(0)
    samples = [
        (f"s{i}", torch.randint(0, 300, (16,), generator=g).tolist(), [False] * 4 + [True] * 12) for i in range(4)
    ]
    prep = write_prepared(
        root / "prep",
        {"train": samples, "eval": [(f"e{i}", *s[1:]) for i, s in enumerate(samples[:2])]},
        {"tokenizer_hash": tokenizer_hash(smol_tokenizer)},
    )
    dcfg = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(tiny_target_dir), draft_vocab_size=64, aux_layer_ids=[1, 2, 3]
    )
    drafter = Eagle3Drafter(dcfg)
    drafter.reset_parameters(seed=0)
    drafter.set_vocab(torch.arange(64))
    drafter.save(root / "drafter")
    chats = root / "chats.jsonl"
    chats.write_text(
        json.dumps({"id": "c0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
        + "\n"
    )
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    return {
        "target": tiny_target_dir,
        "prep": prep,
        "drafter": root / "drafter",
        "chats": chats,
        "prompts": prompts,
        "root": root,
    }


CASES = {
    "train": ["train", "--target", "{target}", "--data", "{prep}", "--out", "{out}", "--device", "cpu"],
    "regenerate": ["regenerate", "--target", "{target}", "--source", "{chats}", "--out", "{out}", "--device", "cpu"],
    "prepare": ["prepare", "--target", "{target}", "--source", "{chats}", "--out", "{out}", "--overwrite"],
    "capture": ["capture", "--target", "{target}", "--data", "{prep}", "--out", "{out}", "--device", "cpu"],
    "eval": [
        "eval",
        "--target",
        "{target}",
        "--drafter",
        "{drafter}",
        "--prompts",
        "{prompts}",
        "--out",
        "{out}",
        "--device",
        "cpu",
    ],
    "export": ["export", "--drafter", "{drafter}", "--format", "sglang", "--out", "{out}"],
    "generate": [
        "generate",
        "--target",
        "{target}",
        "--drafter",
        "{drafter}",
        "--prompts",
        "{prompts}",
        "--out",
        "{out}",
        "--device",
        "cpu",
    ],
}


@pytest.mark.parametrize("command", list(CASES))
def test_every_writer_refuses_an_output_another_process_writes(command, inputs, tmp_path, monkeypatch):
    import eyas.target

    def no_load(*a, **k):
        raise AssertionError("a model loaded before the lock was checked")

    monkeypatch.setattr(eyas.target, "load_target", no_load)
    out = tmp_path / ("out.jsonl" if command == "generate" else "out")
    args = [a.format(out=out, **inputs) for a in CASES[command]]
    with held_elsewhere(out) as proc:
        r = _run(args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert f"is being written by another eyas process (pid {proc.pid}" in r.stderr and str(out) in r.stderr, r.stderr


def test_verify_and_train_call_a_store_being_written_incomplete(inputs, tmp_path):
    store = tmp_path / "store"
    store.mkdir()  # (a capture's first shard is not committed yet)
    with held_elsewhere(store) as proc:
        for args in (
            ["verify", "--store", store],
            ["train", "--target", inputs["target"], "--store", store, "--out", tmp_path / "run", "--device", "cpu"],
        ):
            r = _run(args)
            assert (
                r.exit_code == 2
                and f"store {store} is incomplete: another eyas process is writing it now (pid {proc.pid}" in r.stderr
            ), r.stderr


def test_pipeline_refuses_a_workdir_another_pipeline_runs_in(tmp_path, inputs):
    recipe = tmp_path / "r.toml"
    wd = tmp_path / "wd"
    recipe.write_text(
        f'workdir = "{wd}"\ntarget = "{inputs["target"]}"\ndevice = "cpu"\n\n[prepare]\nsource = "{inputs["chats"]}"\n'
    )
    with held_elsewhere(wd) as proc:
        r = _run(["pipeline", recipe])
    assert r.exit_code == 2 and f"workdir {wd} is being written by another eyas process (pid {proc.pid}" in r.stderr, (
        r.stderr
    )


def test_two_train_processes_on_one_out(inputs, tmp_path):
    """Two real `eyas train` on one --out: the second (a new run, or --resume auto) is refused while the first runs."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [
        sys.executable,
        "-m",
        "eyas",
        "train",
        "--target",
        str(inputs["target"]),
        "--data",
        str(inputs["prep"]),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--batch-size",
        "1",
        "--draft-vocab",
        "64",
        "--ttt-steps",
        "1",
    ]
    first = subprocess.Popen(
        [*base, "--steps", "100000", "--save-every", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while holder(out) is None:
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.2)
        for extra in ([], ["--resume", "auto"], ["--overwrite"]):
            second = subprocess.run(
                [*base, "--steps", "2", *extra], capture_output=True, text=True, env=env, timeout=120
            )
            assert second.returncode == 2, second.stderr
            assert (
                f"--out {out} is being written by another eyas process (pid {first.pid}: eyas train" in second.stderr
            ), second.stderr
        assert first.poll() is None  # the first run went on
    finally:
        first.kill()
        first.wait()
