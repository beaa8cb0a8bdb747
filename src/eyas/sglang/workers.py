"""`eyas capture --sglang-procs N`: the capture's loop (eyas.sglang.sender) in N worker processes.

Each worker sends its share of the samples through its share of every server's slots, reads, checks and encodes
their dumps, and hands each verified sample's stored rows back in a file on /dev/shm (a pipe would take the parent's
GIL once per pipe buffer); the parent only stores.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eyas.sglang.request import Outcome
from eyas.sglang.sender import StateBudget, send_all, short_switch_interval


class Workers:
    """The --sglang-procs worker processes (`_capture_worker`), started before the store is opened: each imports
    torch and eyas, seconds that then pass beside the set-up. `run` gives each an equal share of the samples, of
    each server's slots and of the memory budget, and stores what they hand over; `close` ends them and removes
    the spool (a directory of this run's own on /dev/shm, else the temp dir)."""

    def __init__(self, n: int, slots: int, budget: StateBudget, row_bytes: int, lengths):
        """`n` workers for `slots` requests in flight in all; half of `budget` bounds the samples waiting in the
        spool (of the mean of `lengths` tokens, `row_bytes` each: a store slower than the servers then holds
        the workers back), the other half the states the workers hold."""
        import multiprocessing
        import tempfile

        ctx = multiprocessing.get_context("spawn")  # a forked copy of a threaded process can deadlock
        sample_bytes = row_bytes * (float(lengths.mean()) if len(lengths) else 1.0)
        self.spooled = int(min(max(budget.limit // 2 // max(sample_bytes, 1), 1), 2 * slots))
        self.results = ctx.Queue(maxsize=self.spooled)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_dead_spools(shm)
        self.spool_dir = tempfile.mkdtemp(prefix=f"eyas-spool-{os.getpid()}-", dir=shm)
        self.tasks = [ctx.SimpleQueue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_capture_worker,
                args=(k, self.tasks[k], self.results, self.spool_dir),
                daemon=True,
                name=f"eyas-capture-{k}",
            )
            for k in range(n)
        ]
        for w in self.procs:
            w.start()

    def run(self, plans, split, todo, writer, tally, bar, *, concurrency: int, budget, **task) -> None:
        n = len(self.procs)
        for k, q in enumerate(self.tasks):
            q.put(
                {
                    **task,
                    "plans": plans,
                    "source": (str(split.root), split.name),
                    "todo": todo[k::n],
                    "concurrency": concurrency // n + (k < concurrency % n),
                    "memory_bytes": max(budget.limit // 2 // n, 1),
                }
            )
        running = set(range(n))
        while running:
            try:
                item = self.results.get(timeout=5.0)
            except queue.Empty:
                if dead := [k for k in running if not self.procs[k].is_alive() and self.results.empty()]:
                    raise RuntimeError(
                        f"capture worker {dead[0]} ended without a word (exit {self.procs[dead[0]].exitcode})"
                    ) from None
                continue
            if isinstance(item, _WorkerEnd):
                if item.error is not None:
                    raise RuntimeError(f"capture worker {item.worker}: {item.error}")
                running.discard(item.worker)
                budget.peak += item.peak_bytes  # the workers' peaks summed: at least what was held at once
                continue
            if item.encoded is not None:
                spooled = item.encoded
                item = replace(item, encoded=spooled.load())
                os.unlink(spooled.path)
            tally.ingest(item, writer)
            bar.update(item.tokens)

    @classmethod
    def start(cls, procs: int, concurrency: int, servers: int, budget, row_bytes: int, lengths) -> Workers | None:
        """`procs` workers (at most `concurrency`, each server's slots), or None for none."""
        return cls(min(procs, concurrency), concurrency * servers, budget, row_bytes, lengths) if procs else None

    def close(self) -> None:
        for w, q in zip(self.procs, self.tasks):
            if w.is_alive():
                q.put(None)
        for w in self.procs:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()  # mid-task after an error: its requests end with it, its dumps are removed as stale
                w.join(timeout=30)
        shutil.rmtree(self.spool_dir, ignore_errors=True)


@dataclass(frozen=True)
class _WorkerEnd:
    """A capture worker's last message: None, or the error that ended it; the most bytes of states it held."""

    worker: int
    error: str | None
    peak_bytes: int = 0


class _Spooler:
    """A capture worker's tally: each outcome goes to the parent, its rows in a file (`EncodedSample.spool`: a
    pipe would take the parent's GIL once per pipe buffer). The bounded queue holds the worker back when the
    parent's store is slower than the servers."""

    def __init__(self, results, spool_dir: str):
        self.results, self.spool_dir, self.n = results, spool_dir, 0

    def ingest(self, res: Outcome, writer) -> None:
        if res.encoded is not None:
            self.n += 1
            res = replace(res, encoded=res.encoded.spool(os.path.join(self.spool_dir, f"{os.getpid()}-{self.n}")))
        self.results.put(res)

    def update(self, n: int) -> None:  # the progress bar's part: the parent counts
        pass


def _capture_worker(k: int, tasks, results, spool_dir: str) -> None:
    """One of --sglang-procs processes: for each task (`Workers.run`), sends its share of the samples through its
    share of each server's slots, reads, checks and encodes their dumps, and hands every outcome to the parent
    (`_Spooler`); then a `_WorkerEnd`. None ends it, and so does the parent's end (killed, it cannot say so)."""
    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    while (task := tasks.get()) is not None:
        budget = StateBudget(task.pop("memory_bytes"))
        try:
            _worker_task(task, budget, _Spooler(results, spool_dir))
            results.put(_WorkerEnd(k, None, budget.peak))
        except BaseException as exc:  # the parent raises it
            results.put(_WorkerEnd(k, f"{type(exc).__name__}: {exc}", budget.peak))


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _worker_task(task: dict[str, Any], budget: StateBudget, spooler: _Spooler) -> None:
    from eyas.data.prepared import PreparedDataset

    path, split_name = task.pop("source")
    split = PreparedDataset(path, check=False).split(split_name)  # the parent checked its fingerprint
    with short_switch_interval():  # as the parent's loop runs
        send_all(task.pop("plans"), split, task.pop("todo"), None, spooler, spooler, budget=budget, **task)


def remove_dead_spools(where: str) -> None:
    """Remove the spool directories of captures whose process is gone (killed before it could clean up)."""
    for d in Path(where).glob("eyas-spool-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def closed_on_error(*started):
    """Closes each of `started` (Workers, an Apart; None: nothing) when the block raises (the capture's own clean-up
    comes after it)."""
    try:
        yield
    except BaseException:
        for thing in started:
            if thing is not None:
                thing.close()
        raise
