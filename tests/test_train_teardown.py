"""`eyas train` tears its process group down when training raises, not only at the end of a run.

On an error (a bad batch, an EyasError, an interrupt, a collective that fails because another rank
stopped) `loop.run` clears the failed run's frames (the DDP/FSDP module holds the group) and calls
`dist.abort`: gloo is destroyed, NCCL aborted (a destroy can block while peers sit in a collective),
a failure there is a warning, and the error that stopped the run is what propagates.

In-process tests run the real loop on a one-process gloo group standing in for a multi-rank one
(`Dist` says 2 ranks, so the loop wraps DDP/FSDP2 and tears the group down as under torchrun); the
two-rank tests start both ranks as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and read each
one's exit status and last words.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as tdist
from test_train_ddp import _args
from test_train_loop import _cfg, world  # noqa: F401  (fixture)

from eyas.errors import EyasError, Interrupted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STILL_HELD = "still referenced after destroy_process_group"


@pytest.fixture
def fake_ranks(monkeypatch, tmp_path):
    """dd.setup makes a one-process gloo group and says 2 ranks; yields the weakrefs to the groups made."""
    from eyas.train import dist as dd

    refs: list[weakref.ref] = []
    destroy = tdist.destroy_process_group  # (a test may break the patched one)

    def setup(device):
        dd.init_group("gloo", init_method=f"file://{tmp_path}/rendezvous-{len(refs)}", rank=0, world_size=1)
        refs.append(weakref.ref(tdist.group.WORLD))
        return dd.Dist(rank=0, world=2, local_rank=0, device=torch.device("cpu"))

    monkeypatch.setattr(dd, "setup", setup)
    yield refs
    if tdist.is_initialized():  # a failed test leaves no group behind for the next one
        destroy()


def _fail_at_step(monkeypatch, n: int, exc: BaseException):
    """loop._clip (called once a step, after the backward) raises exc at step n."""
    from eyas.train import loop

    calls, real = [], loop._clip

    def clip(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(loop, "_clip", clip)


def _assert_gone(refs):
    assert refs, "setup never ran"
    assert not tdist.is_initialized(), "the process group outlived the run"
    assert refs[-1]() is None, "the group was destroyed but is still referenced (its threads outlive it)"


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_an_error_in_a_step_tears_the_group_down_and_propagates(world, tmp_path, fake_ranks, monkeypatch, capfd, fsdp):  # noqa: F811
    from eyas.train.loop import run

    _fail_at_step(monkeypatch, 2, EyasError("bad batch t3: loss is NaN"))
    with pytest.raises(EyasError, match="^bad batch t3: loss is NaN$"):
        run(_cfg(world, tmp_path / "out", data=world["prep"], steps=3, batch_size=1, fsdp=fsdp))
    _assert_gone(fake_ranks)
    assert STILL_HELD not in capfd.readouterr().err


def test_an_interrupt_tears_the_group_down_and_says_what_was_saved(world, tmp_path, fake_ranks, monkeypatch):  # noqa: F811
    from eyas.train.loop import run

    _fail_at_step(monkeypatch, 2, KeyboardInterrupt())  # a second Ctrl-C: no clean stop after the step
    with pytest.raises(Interrupted, match="no training step was saved"):
        run(_cfg(world, tmp_path / "out", data=world["prep"], steps=3, batch_size=1))
    _assert_gone(fake_ranks)


def test_a_failing_teardown_warns_and_the_error_still_propagates(world, tmp_path, fake_ranks, monkeypatch, capfd):  # noqa: F811
    from eyas.train.loop import run

    _fail_at_step(monkeypatch, 1, EyasError("bad batch t0"))

    def broken(*a, **k):
        raise RuntimeError("destroy broke")

    monkeypatch.setattr(tdist, "destroy_process_group", broken)
    with pytest.raises(EyasError, match="^bad batch t0$"):
        run(_cfg(world, tmp_path / "out", data=world["prep"], steps=3, batch_size=1))
    assert (
        "warning: tearing the process group down after the error failed (RuntimeError: destroy broke)"
        in capfd.readouterr().err
    )
    assert tdist.is_initialized()  # (the fixture destroys it)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_the_end_of_a_run_frees_the_group(world, tmp_path, fake_ranks, capfd, fsdp):  # noqa: F811
    """At the end the group is destroyed once the DDP/FSDP module is gone: freed, its threads joined
    (destroyed while the module still held it, it stayed alive into interpreter exit)."""
    from eyas.train.loop import run

    s = run(_cfg(world, tmp_path / "out", data=world["prep"], steps=2, batch_size=1, fsdp=fsdp))
    assert s["world"] == 2 and s["steps"] == 2
    _assert_gone(fake_ranks)
    assert STILL_HELD not in capfd.readouterr().err


def test_a_setup_failure_leaves_a_callers_group_alone(world, tmp_path, monkeypatch):  # noqa: F811
    """A group that existed before run() and that setup did not take is the caller's: kept on an error."""
    from eyas.train import dist as dd
    from eyas.train.loop import run

    dd.init_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)

    def setup(device):
        raise EyasError("no such device")

    monkeypatch.setattr(dd, "setup", setup)
    try:
        with pytest.raises(EyasError, match="no such device"):
            run(_cfg(world, tmp_path / "out", data=world["prep"], steps=1, batch_size=1))
        assert tdist.is_initialized()
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


# -- which call ends the group after an error --------------------------------------------------


@pytest.fixture
def group(tmp_path):
    from eyas.train import dist as dd

    dd.init_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    ref = weakref.ref(tdist.group.WORLD)
    destroy = tdist.destroy_process_group
    yield ref
    if tdist.is_initialized():
        destroy()


def _spies(monkeypatch, *, nccl: bool, have_abort_all: bool):
    """Record destroy / _abort_process_group / ProcessGroup.abort calls (each still does the real work,
    ending the gloo group); with nccl the group reports the NCCL backend."""
    from torch.distributed import distributed_c10d as c10d

    calls: list[str] = []
    destroy = tdist.destroy_process_group
    monkeypatch.setattr(tdist, "destroy_process_group", lambda *a, **k: (calls.append("destroy"), destroy(*a, **k))[1])
    if have_abort_all:
        monkeypatch.setattr(
            c10d, "_abort_process_group", lambda *a, **k: (calls.append("_abort_process_group"), destroy())[1]
        )
    else:
        monkeypatch.delattr(c10d, "_abort_process_group", raising=False)
    monkeypatch.setattr(tdist.ProcessGroup, "abort", lambda self: calls.append("ProcessGroup.abort"))
    if nccl:
        monkeypatch.setattr(tdist, "get_backend", lambda *a, **k: "nccl")
    return calls


@pytest.mark.parametrize(
    ("nccl", "have_abort_all", "expected"),
    [
        (True, True, ["_abort_process_group"]),
        (True, False, ["ProcessGroup.abort", "destroy"]),
        (False, True, ["destroy"]),
    ],
    ids=["nccl", "nccl-older-torch", "gloo"],
)
def test_abort_aborts_nccl_and_destroys_gloo(group, monkeypatch, nccl, have_abort_all, expected):
    from eyas.train import dist as dd

    calls = _spies(monkeypatch, nccl=nccl, have_abort_all=have_abort_all)
    dd.abort(dd.Dist(rank=0, world=2, local_rank=0, device=torch.device("cpu")))
    assert calls == expected
    assert not tdist.is_initialized() and group() is None


def test_abort_leaves_a_one_process_run_alone_and_never_raises(group, monkeypatch, capfd):
    from eyas.train import dist as dd

    calls = _spies(monkeypatch, nccl=False, have_abort_all=True)
    dd.abort(dd.Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu")))  # not its group
    assert calls == [] and tdist.is_initialized()

    def broken(*a, **k):
        raise KeyboardInterrupt  # even a second Ctrl-C inside the teardown does not replace the error

    monkeypatch.setattr(tdist, "destroy_process_group", broken)
    dd.abort(None)
    assert "warning: tearing the process group down after the error failed (KeyboardInterrupt" in capfd.readouterr().err


# -- two ranks -------------------------------------------------------------------------------------

RANK_SCRIPT = """
import os, sys, weakref
import torch.distributed as tdist
from eyas.errors import EyasError
from eyas.train import dist as dd, loop

what, where = sys.argv[1], sys.argv[2]  # what step 2 raises, on which rank ("both": on each)
rank = os.environ["RANK"]
refs, real_setup = [], dd.setup


def setup(device):
    d = real_setup(device)
    refs.append(weakref.ref(tdist.group.WORLD))
    return d


calls, real_clip = [], loop._clip


def clip(*a, **k):
    calls.append(1)
    if len(calls) == 2 and where in (rank, "both"):
        if what == "error":
            raise EyasError(f"bad batch on rank {rank}")
        raise KeyboardInterrupt
    return real_clip(*a, **k)


dd.setup, loop._clip = setup, clip
from eyas.cli import main

sys.argv = ["eyas", *sys.argv[3:]]
try:
    main()
finally:
    state = "alive" if tdist.is_initialized() else "destroyed"
    held = "never made" if not refs else "held" if refs[0]() is not None else "freed"
    print(f"rank {rank}: group {state}, {held}", file=sys.stderr, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(script, args, *, timeout=60):
    """Both ranks as torchrun starts them; [(exit status, stderr)] per rank and the seconds they took."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            out.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not exit within {timeout} s (a teardown blocked?)")
    return out, time.monotonic() - t0


@pytest.mark.parametrize(("what", "where"), [("error", "1"), ("error", "both"), ("interrupt", "1")])
def test_two_ranks_exit_promptly_with_the_error_and_no_group_left(world, tmp_path, what, where):  # noqa: F811
    """A step that raises on rank 1 (or on both): that rank prints its own error and exits with its
    status (2 for an EyasError, 130 for an interrupt); a rank left waiting in the step's all-reduce is
    released at once (its peer's teardown closes the connection: "closed" or "reset by peer") and exits 2, saying that
    another rank stopped first. Every rank has
    destroyed and freed its group before its interpreter exits."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks, took = _two_ranks(
        script, [what, where, *_args(world, tmp_path / "out", "--steps", "3", "--batch-size", "1")]
    )
    for r, (code, err) in enumerate(ranks):
        tail = err[-3000:]
        assert f"rank {r}: group destroyed, freed" in err, tail
        assert "terminate called" not in err and STILL_HELD not in err, tail
        if where in (str(r), "both"):
            if what == "error":
                assert code == 2 and f"error: bad batch on rank {r}\n" in err, tail
            else:
                assert code == 130 and "interrupted: no training step was saved" in err, tail
        else:  # the peer left waiting: its collective failed when rank 1 tore its group down; it says so, and
            # not "internal error ... a bug"
            assert code == 2 and f"error: rank {r}: stopped because another rank of this job stopped first" in err, tail
            assert "by peer" in err and "internal error" not in err, tail  # (closed or reset)
    assert took < 60


def test_only_a_collective_failed_by_a_departed_peer_is_called_the_other_ranks_doing():
    from eyas.train.loop import _peer_stopped

    assert _peer_stopped(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:123"))
    assert _peer_stopped(RuntimeError("NCCL communicator was aborted on rank 0."))
    assert not _peer_stopped(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not _peer_stopped(ValueError("Connection closed by peer"))  # not a collective's error type
