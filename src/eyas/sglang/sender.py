"""The capture's loop in one process: request threads send the samples, each checks and encodes its own, one
thread stores them.

`concurrency` requests at each server (its gate); as many more samples again are being read and checked, or wait for
a slot, so that a server never waits for this process to read a dump. `StateBudget` bounds the states held between
a sample's request and its write into the store, so a disk slower than the servers bounds memory instead of filling it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.common import log
from eyas.sglang.request import Outcome, capture_one
from eyas.sglang.server import ServerPlan


class StateBudget:
    """The bytes of states the client holds at once, from a sample's request to its write into the store.

    A sample is sent only when its states fit beside those held (or when none are held, so a sample larger
    than the budget still goes, alone): a disk slower than the servers then bounds the client's memory
    instead of filling it. The request threads hold up to a few transient copies of the sample they check."""

    def __init__(self, limit_bytes: int):
        self.limit, self.held, self.peak = int(limit_bytes), 0, 0
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> bool:
        with self._cv:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give(self, nbytes: int) -> None:
        with self._cv:
            self.held -= nbytes
            self._cv.notify_all()

    def wait_for_room(self, nbytes: int, timeout: float) -> None:
        """Until `nbytes` more would fit (or `timeout` seconds)."""
        with self._cv:
            self._cv.wait_for(lambda: not self.held or self.held + nbytes <= self.limit, timeout)


def default_memory_bytes() -> int:
    """An eighth of this machine's memory: what the capture client's states may take by default."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): a fixed 4 GiB
        return 4 << 30


@dataclass(kw_only=True)
class Tally:
    """What the send/ingest loop counts, for the summary."""

    retries: int
    rejected: list[dict[str, Any]] = field(default_factory=list)
    captured: int = 0
    tokens: int = 0
    spent: dict[str, float] = field(
        default_factory=lambda: {
            "gate": 0.0,
            "request": 0.0,
            "dump": 0.0,
            "check": 0.0,
            "encode": 0.0,
            "ingest": 0.0,
        }
    )
    """Seconds summed over samples, per part of a sample's way (`gate`: waiting for a slot at a server)."""
    t0: float = field(default_factory=time.time)
    """When the loop began (time.time())."""
    stored_by_s: list[int] = field(default_factory=list)
    """Tokens stored in each second since `t0`: where the loop stalled."""

    def timeline(self, buckets: int = 120) -> dict[str, Any]:
        """`stored_by_s` in at most `buckets` buckets of whole seconds (a long capture's summary stays short)."""
        width = max(1, -(-len(self.stored_by_s) // buckets))
        tokens = [sum(self.stored_by_s[i : i + width]) for i in range(0, len(self.stored_by_s), width)]
        return {"bucket_s": width, "tokens": tokens}

    def ingest(self, res: Outcome, writer) -> None:
        """Count one sample's outcome; store it when it passed every check."""
        self.retries += res.retries
        for part, secs in res.seconds.items():
            self.spent[part] += secs
        if res.reason is not None:
            self.rejected.append({"id": res.sample_id, "tokens": res.tokens, "reason": res.reason})
            log(f"eyas: rejected {res.sample_id}: {res.reason}")
        else:
            t_add = time.perf_counter()
            writer.add_encoded(res.encoded)
            self.spent["ingest"] += time.perf_counter() - t_add
            self.captured += 1
            self.tokens += res.tokens
            second = max(int(time.time() - self.t0), 0)
            self.stored_by_s.extend([0] * (second + 1 - len(self.stored_by_s)))
            self.stored_by_s[second] += res.tokens


@dataclass(kw_only=True)
class Sender:
    """Hands the samples still to capture to the servers, each to the least loaded one."""

    pool: cf.ThreadPoolExecutor
    plans: Sequence[ServerPlan]
    gates: Sequence[threading.BoundedSemaphore]
    split: Any
    todo: Any
    """Iterator over the indices of the samples still to send."""
    rid_tag: str
    layer_ids: Sequence[int]
    max_retries: int
    backoff_s: float
    request_timeout_s: float
    dump_wait_s: float
    budget: StateBudget
    """Bytes of states held at once, taken when a sample is sent and given back once it is stored."""
    row_bytes: int
    """A token's states in bytes (the budget's unit)."""
    encode: Any = None
    """The store writer's SampleEncoder, run on the request threads."""
    futures: dict[cf.Future, tuple[int, int]] = field(default_factory=dict)
    """Future -> (index of its server, the bytes it took from the budget)."""
    load: list[int] = field(init=False)
    """Samples taken per server: the least loaded gets the next one."""
    done: bool = False
    """Every sample has been sent."""
    held_back_bytes: int = 0
    """The states of the sample waiting for room in the budget."""
    _held_back: int | None = None

    def __post_init__(self):
        self.load = [0] * len(self.plans)

    def submit_next(self) -> bool:
        """Send the next sample; False when none is left or its states do not fit the budget yet."""
        i, self._held_back = (self._held_back, None) if self._held_back is not None else (next(self.todo, None), None)
        if i is None:
            self.done = True
            return False
        s = self.split[i]
        nbytes = int(s.input_ids.shape[0]) * self.row_bytes
        if not self.budget.take(nbytes):
            self._held_back, self.held_back_bytes = i, nbytes
            return False
        k = min(range(len(self.plans)), key=self.load.__getitem__)
        self.futures[
            self.pool.submit(
                capture_one,
                self.plans[k],
                s.id,
                s.input_ids,
                f"{self.rid_tag}-{i}",
                layer_ids=self.layer_ids,
                max_retries=self.max_retries,
                backoff_s=self.backoff_s,
                request_timeout_s=self.request_timeout_s,
                dump_wait_s=self.dump_wait_s,
                gate=self.gates[k],
                encode=self.encode,
            )
        ] = (k, nbytes)
        self.load[k] += 1
        return True

    def retire(self, f: cf.Future) -> int:
        """Forget a finished future and send the next sample in its place; the bytes it holds."""
        k, nbytes = self.futures.pop(f)
        self.load[k] -= 1
        self.submit_next()
        return nbytes


SWITCH_INTERVAL_S = 0.001
"""Python's thread switch interval (at most) while the capture's threads run, where Python's default is 5 ms: a
thread back from a read, a write or a torch op (each lets go of the GIL) waits until the thread running Python is
told to let go, and the capture's threads do little else (benchmarks/capture_path.py, its switch stages)."""


@contextlib.contextmanager
def short_switch_interval():
    """SWITCH_INTERVAL_S for the block (a shorter one already set is kept), the interval before it restored."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def send_all(plans, split, todo, writer, tally, bar, *, concurrency: int, **sender_kw) -> None:
    """The request threads on `todo`: `concurrency` slots at each server, as many samples again being read and
    checked; each outcome to `tally.ingest(outcome, writer)`. `sender_kw`: the rest of Sender's fields."""
    queued = 2 * concurrency * len(plans)
    # one intra-op thread per request thread: each checks and encodes a sample at a time, and torch's own
    # thread team per thread would oversubscribe the cores many times over
    with cf.ThreadPoolExecutor(max_workers=queued, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        sender = Sender(
            pool=pool,
            plans=plans,
            gates=[threading.BoundedSemaphore(concurrency) for _ in plans],
            split=split,
            todo=iter(todo),
            **sender_kw,
        )
        _send_and_ingest(sender, writer, tally, bar, queued=queued)


def _send_and_ingest(sender: Sender, writer, tally: Tally, bar, *, queued: int) -> None:
    """Keep `queued` samples in flight until none is left, storing each verified one as it comes back.

    This thread only sends: a finished sample's slot is refilled at once and the sample handed to one
    ingesting thread, so a slow store write (a shard's fsync) never leaves the servers without work."""
    futures = sender.futures
    # unbounded: the samples waiting here hold their states' share of the budget, so a disk slower than the servers
    # (or a store still being opened) holds the sender back once the budget is full, not after a fixed count
    done_q: queue.Queue = queue.Queue()
    failed: list[BaseException] = []

    def ingest_all() -> None:
        while (item := done_q.get()) is not None:
            res, nbytes = item
            if failed:
                continue  # drain: the sender stops at the first failure
            try:
                tally.ingest(res, writer)
                bar.update(res.tokens)
            except BaseException as exc:  # re-raised by the sending thread
                failed.append(exc)
            finally:
                sender.budget.give(nbytes)  # stored (or rejected): its states are no longer held

    def fill() -> None:
        while len(futures) < queued and sender.submit_next():
            pass

    ingester = threading.Thread(target=ingest_all, name="eyas-capture-ingest", daemon=True)
    ingester.start()
    try:
        fill()
        while not failed:
            if not futures:
                if sender.done:
                    break
                sender.budget.wait_for_room(sender.held_back_bytes, 1.0)  # the disk has the rest: wait for it
                fill()
                continue
            finished, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED, timeout=1.0)
            for f in finished:
                nbytes = sender.retire(f)  # the next sample goes out before this one is stored
                done_q.put((f.result(), nbytes))
            fill()
        if failed:
            raise failed[0]
    except BaseException:
        for f in futures:
            f.cancel()  # requests not started yet; running ones end within their timeouts
        raise
    finally:
        done_q.put(None)
        ingester.join()
