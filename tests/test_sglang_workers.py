"""eyas/sglang/workers.py: `--sglang-procs`, the capture's loop in worker processes (against the stand-in server)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from eyas.errors import EyasError
from eyas.sglang.client import capture_from_sglang
from tests.sglang_helpers import (
    LAYERS,
    LENGTHS,
    check_store_against_reference,
    hide_the_prefix_cache,
    serve,
    spools,
)


def test_capture_processes_store_the_same_states_and_reject_what_one_process_rejects(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path, monkeypatch
):
    # --sglang-procs: worker processes send, read, check and encode, this one stores; the store must be the
    # reference's, and a sample the checks refuse must be refused there too (here the plugin's rejection of a
    # prompt served from a prefix, which only the dump can tell)
    import eyas.sglang.client as client
    import eyas.sglang.sender as sender

    class NoSender:  # this process must send nothing: the spawned workers import their own, unpatched
        def __init__(self, **kw):
            raise AssertionError("the parent process sent the samples itself")

    monkeypatch.setattr(sender, "Sender", NoSender)
    before = spools()
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=8) as srv:
        truthful = hide_the_prefix_cache(srv)
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=3, procs=2, calibrate=0
        )
        assert sorted(r["id"] for r in out["rejected"]) == ["s5", "s7"]
        assert all("plugin rejected it" in r["reason"] for r in out["rejected"])
        assert out["captured"] == len(LENGTHS) - 2 and out["memory"]["peak_bytes"] > 0 and out["procs"] == 2
        truthful()
        spooled = []

        class Recorded(client.Workers):
            def __init__(self, *a):
                super().__init__(*a)
                spooled.append(self.spooled)

        monkeypatch.setattr(client, "Workers", Recorded)
        # the tightest memory: one sample at a time in each worker and one waiting in the spool, still through
        again = capture_from_sglang(
            [srv.url],
            sglang_prepared,
            "train",
            tmp_path / "store",
            LAYERS,
            target=tiny_target_dir,
            procs=2,
            memory_bytes=1,
        )
    assert spooled == [1] and again["memory"]["limit_bytes"] == 1
    assert again["captured"] == 2 and again["store_complete"] and again["rejected_count"] == 0
    assert sorted(again["seconds_summed"]) == ["check", "dump", "encode", "gate", "ingest", "request"]
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)
    assert list((tmp_path / "dumps").iterdir()) == [] and spools() == before  # no dump or spooled rows left
    with pytest.raises(EyasError, match="--sglang-procs"):
        capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s2", LAYERS, procs=-1)


def test_a_capture_worker_that_fails_ends_the_capture_with_its_error(
    tiny_target_dir, sglang_prepared, tmp_path, monkeypatch
):
    # a worker process that cannot go on (here: its prepared split is not there) stops the capture with its
    # reason; and a set-up that fails after the workers started ends them: neither they nor the spool outlive it
    import multiprocessing
    import types

    import numpy

    from eyas.sglang import client
    from eyas.sglang.sender import StateBudget

    before = spools()
    with serve(tiny_target_dir, tmp_path) as srv:
        plans, layer_ids, _ = client._reach_servers(
            [srv.url],
            LAYERS,
            torch.arange(100, 116),
            job="j",
            laps=client._Laps(0.0),
            cache_bypass="auto",
            dump_dir=None,
            probe_kw={"dump_wait_s": 5.0, "max_retries": 0, "backoff_s": 0.1},
        )

        def run_two_workers(source: str, todo: list[int], kill_second: bool = False) -> None:
            workers = client.Workers(2, 2, StateBudget(1 << 20), 8, numpy.array([10]))
            try:
                if kill_second:
                    workers.procs[1].kill()
                    workers.procs[1].join()
                workers.run(
                    plans,
                    types.SimpleNamespace(root=source, name="train"),  # a split as the workers find it
                    todo,
                    None,  # the store's writer, tally and progress: not reached
                    None,
                    None,
                    encode=None,
                    concurrency=2,
                    budget=StateBudget(1 << 20),
                    row_bytes=1,
                    rid_tag="t",
                    layer_ids=layer_ids,
                    max_retries=0,
                    backoff_s=0.1,
                    request_timeout_s=5.0,
                    dump_wait_s=5.0,
                )
            finally:
                workers.close()

        with pytest.raises(RuntimeError, match=r"capture worker \d: .*no-such-prepared"):
            run_two_workers(str(tmp_path / "no-such-prepared"), [0, 1, 2])
        assert multiprocessing.active_children() == [] and spools() == before
        # a worker killed outright (the kernel's OOM killer) cannot say so: its silence is an error too (nothing
        # to send here: worker 0 ends at once, worker 1 is gone)
        with pytest.raises(RuntimeError, match=r"capture worker 1 ended without a word \(exit -9\)"):
            run_two_workers(str(sglang_prepared), [], kill_second=True)
        assert multiprocessing.active_children() == [] and spools() == before
        started = []

        class Counted(client.Workers):
            def __init__(self, *a):
                super().__init__(*a)
                started.append(len(self.procs))

        monkeypatch.setattr(client, "Workers", Counted)
        (tmp_path / "taken").mkdir()
        (tmp_path / "taken" / "notes.txt").write_text("not a store")
        with pytest.raises(EyasError, match="taken"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "taken", LAYERS, procs=2)
    assert started == [2] and multiprocessing.active_children() == [] and spools() == before
    assert (tmp_path / "taken" / "notes.txt").read_text() == "not a store"


def test_spools_of_dead_captures_are_removed_and_workers_end_with_their_parent(tmp_path):
    # a capture killed before its clean-up leaves its spool: the next one removes it, and only it; a worker
    # whose parent is gone ends itself instead of waiting for a task forever
    import subprocess

    from eyas.sglang.workers import remove_dead_spools

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"eyas-spool-{int(gone.stdout)}-abc"
    live = tmp_path / f"eyas-spool-{os.getpid()}-xyz"
    other = tmp_path / "eyas-spool-notes"
    for d in (dead, live, other):
        d.mkdir()
        (d / "1-1").write_bytes(b"rows")
    remove_dead_spools(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
    ended = subprocess.run(
        [sys.executable, "-c", "from eyas.sglang.client import _exit_with_parent; _exit_with_parent(-1, 0.01)"],
        timeout=60,
    )
    assert ended.returncode == 1
