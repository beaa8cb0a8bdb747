"""The host and the GPU kept busy together: the next packed batch prepared while the current one trains
(`PackedPrefetcher`, with `AheadUploader` and `hand_over` for the side streams), and a step's statistics
copied back without waiting for the work queued after them (`HostCopies`).
"""

from __future__ import annotations

import torch

from eyas.train.batches import PackedBatch, _packed_to, online_packed, store_packed
from eyas.train.data import StoreSource


class HostCopies:
    """`values` with their CUDA tensors copied to pinned host memory behind the work queued so far, without
    waiting for it. `get()` waits for those copies alone (an event), not for the work queued after them: reading
    the device tensor itself (`.tolist()`, `float()`) queues its copy behind everything on the stream, so a step's
    statistics read once the next step is queued would wait for that next step too, and the GPU would idle while
    the host prepares the one after. Other values (and tensors on other devices) pass through."""

    def __init__(self, values):
        self.event = None
        out = []
        for v in values:
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                h = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                h.copy_(v, non_blocking=True)
                v = h
                self.event = self.event or torch.cuda.Event()
            out.append(v)
        if self.event is not None:
            self.event.record()
        self.values = tuple(out)

    def get(self) -> tuple:
        if self.event is not None:
            self.event.synchronize()
        return self.values


def _batch_tensors(b: PackedBatch) -> tuple[torch.Tensor, ...]:
    return (
        b.input_ids_N,
        b.aux_NAD,
        b.final_ND,
        b.seg.cu_seqlens,
        b.seg.positions_N,
        b.seg.ends_N,
        *b.rows,
        *([] if b.live is None else [b.live]),
    )


def hand_over(b: PackedBatch, done, device) -> PackedBatch:
    """A batch made on a side stream (`done`: the event recorded after it), for the current stream: it waits for
    the event, and the batch's tensors are marked as used there (freed only once its work is done)."""
    main = torch.cuda.current_stream(device)
    main.wait_event(done)
    for t in _batch_tensors(b):
        t.record_stream(main)
    return b


class AheadUploader:
    """Host batches (pinned) copied to the GPU on a side stream, one batch ahead: the next batch's copy overlaps
    the current step's compute instead of queueing in front of it on the compute stream."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)
        self._ahead = None

    def start(self, host: PackedBatch) -> None:
        """Queue `host`'s copy behind the work queued so far (the batch before it may still be in use)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            b = _packed_to(host, self.device)
            done = torch.cuda.Event()
            done.record()
        self._ahead = (b, done)

    @property
    def started(self) -> bool:
        return self._ahead is not None

    def take(self) -> PackedBatch:
        """The started batch, ready for the current stream."""
        b, done = self._ahead
        self._ahead = None
        return hand_over(b, done, self.device)


class PackedPrefetcher:
    """Packed batches in consumption order, the next one prepared while the current one trains.

    Offline: a background thread reads and packs stored states into pinned host memory; on CUDA the batch after
    the one handed out is copied to the GPU on a side stream when it is ready (AheadUploader).
    Online on CUDA: the target's forward for batch i+1 is enqueued on a side stream before the
    drafter's step on batch i, so the two overlap on the GPU; the side stream's start/end events
    give the time the target took. Online on the CPU: sequential. (Online batches' host parts made ahead by a
    thread, as the offline reader makes its batches, gained nothing.)
    """

    def __init__(self, src, schedule, device, *, steps: int, pad_to: int | None, depth: int = 2):
        import queue
        import threading

        self.src, self.device, self.steps, self.pad_to = src, torch.device(device), steps, pad_to
        self.offline = isinstance(src, StoreSource)
        self._schedule = iter(schedule)
        if self.offline:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True)
            self._thread.start()
            self._uploader = AheadUploader(self.device) if self.device.type == "cuda" else None
        else:
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._pending = None
            self._launch()

    # offline -------------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            for items in self._schedule:
                if self._stop.is_set():
                    return
                self._q.put(
                    store_packed(self.src, items, steps=self.steps, pad_to=self.pad_to, pin=self.device.type == "cuda")
                )
        except BaseException as exc:  # surfaced in the main thread
            self._q.put(exc)

    # online --------------------------------------------------------------------------------------
    def _launch(self) -> None:
        import time

        items = next(self._schedule, None)
        if items is None:
            self._pending = None
            return
        if self._stream is None:
            t0 = time.perf_counter()
            b = online_packed(self.src, items, self.device, steps=self.steps, pad_to=self.pad_to)
            b.target_timing = time.perf_counter() - t0
            self._pending = b
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)  # the target's weights and inputs are ready
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            b = online_packed(self.src, items, self.device, steps=self.steps, pad_to=self.pad_to)
            end.record()
        b.target_timing = (start, end)
        self._pending = b

    def next_batch(self) -> PackedBatch:
        if self.offline:
            up = self._uploader
            if up is None:
                return _packed_to(self._host(self._q.get()), self.device)
            if not up.started:
                up.start(self._host(self._q.get()))
            b = up.take()
            if not self._q.empty():  # the next batch is packed already: its copy overlaps this batch's step
                up.start(self._host(self._q.get()))
            return b
        b = self._pending
        if b is None:
            raise StopIteration("the training schedule ran out of batches")
        if self._stream is not None:
            hand_over(b, b.target_timing[1], self.device)
        self._launch()  # the next target forward overlaps this batch's drafter step
        return b

    @staticmethod
    def _host(got):
        if isinstance(got, BaseException):  # the reader thread's error, surfaced here
            raise got
        return got

    def close(self) -> None:
        if self.offline:
            self._stop.set()
            while not self._q.empty():
                self._q.get_nowait()


def target_seconds(t) -> float:
    """Seconds the online target took for a batch, from its `target_timing` (0 offline); call after the step
    synchronised."""
    if t is None:
        return 0.0
    if isinstance(t, float):
        return t
    return t[0].elapsed_time(t[1]) / 1000.0
