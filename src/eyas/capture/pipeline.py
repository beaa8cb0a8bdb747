"""The capture pipeline: forward -> device-to-host copy -> disk, overlapped so the GPU never waits.

On CUDA, per batch:

    main thread   [forward b+1 .............][forward b+2 ...]      (default stream: compute only)
    copy stream        [D2H b -> pinned slot]                        (waits on an event after forward b)
    writer thread            [wait copy event b][hash + write + fadvise b][commit shard when full]

The forward writes the stored bytes of the batch into one contiguous device buffer (see hooks.py);
a side stream copies it into one of `queue_depth` pinned host slots (contiguous pinned memory copies
at full link speed) and records an event; the writer thread waits for that event, hands the slot to
StoreWriter.add_packed (hashing on a thread pool, writing, starting writeback) and frees the slot.
The main thread blocks only when every pinned slot is still queued for disk, i.e. when the disk
is the bottleneck: back-pressure, not a copy or a sync, is the only wait. The device buffer is
marked as used by the copy stream (record_stream), so the allocator cannot hand it to the next
forward before the copy is done.

On CPU the same pipeline runs without streams: the writer thread writes batch b while the model
computes batch b+1.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from eyas.capture.batching import Batch
from eyas.capture.hooks import forward_capture_packed
from eyas.store.format import stored_dtype
from eyas.store.writer import StoreWriter


@dataclass
class PipelineStats:
    batches: int = 0
    samples: int = 0
    rows: int = 0  # real tokens captured (padding excluded)
    padded_tokens: int = 0  # tokens the forward computed, padding included
    seconds: float = 0.0
    main_wait_s: float = 0.0  # time the main thread waited for a free pinned slot (disk-bound)
    writer_busy_s: float = 0.0  # time the writer thread spent hashing/writing/committing
    extra: dict = field(default_factory=dict)


class CapturePipeline:
    """Run batches through the target and into a StoreWriter, overlapping copies and writes."""

    def __init__(
        self, model, *, layer_ids: list[int], dtype: str, hidden_size: int, max_rows: int, queue_depth: int = 3
    ):
        if queue_depth < 1:
            raise ValueError(f"queue_depth: {queue_depth} must be >= 1")
        self.model = model
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.sd = stored_dtype(dtype)
        self.slots = len(self.layer_ids) + 1
        self.hidden_size = hidden_size
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.queue_depth = queue_depth
        self.max_rows = max_rows
        self._host: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            for _ in range(queue_depth):
                self._host.append(self._pinned(max_rows))

    def _pinned(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = torch.empty((rows, self.slots, self.hidden_size), dtype=self.sd.torch_dtype, pin_memory=True)
        s = torch.empty((rows, self.slots), dtype=torch.float32, pin_memory=True) if self.sd.scaled else None
        return h, s

    def run(
        self, batches: Iterable[Batch], writer: StoreWriter, *, on_batch: Callable[[Batch], None] | None = None
    ) -> PipelineStats:
        """Capture every batch into `writer` (not closed here). Raises the writer's error, if any."""
        stats = PipelineStats()
        work: queue.Queue = queue.Queue()
        free: queue.Queue = queue.Queue()
        for slot in range(self.queue_depth):
            free.put(slot)
        failure: list[BaseException] = []

        def writer_loop():
            while True:
                item = work.get()
                if item is None:
                    return
                event, slot, batch, hidden, scale = item
                try:
                    if not failure:
                        if event is not None:
                            event.synchronize()
                        t0 = time.perf_counter()
                        writer.add_packed(batch.ids, batch.lengths, hidden, scale)
                        stats.writer_busy_s += time.perf_counter() - t0
                        if on_batch is not None:
                            on_batch(batch)
                except BaseException as exc:  # handed to the main thread
                    failure.append(exc)
                finally:
                    free.put(slot)

        thread = threading.Thread(target=writer_loop, name="eyas-store-writer", daemon=True)
        start = time.perf_counter()
        thread.start()
        try:
            for batch in batches:
                t0 = time.perf_counter()
                slot = free.get()
                stats.main_wait_s += time.perf_counter() - t0
                if failure:
                    break
                work.put(self._capture_one(batch, slot))
                stats.batches += 1
                stats.samples += len(batch.ids)
                stats.rows += batch.rows
                stats.padded_tokens += batch.padded_tokens
        finally:
            work.put(None)
            thread.join()
        stats.seconds = time.perf_counter() - start
        if failure:
            raise failure[0]
        return stats

    def _capture_one(self, batch: Batch, slot: int):
        ids_BT, index = batch.input_ids_BT, batch.rows_index
        if not self.cuda:
            hidden, scale = forward_capture_packed(
                self.model, ids_BT.to(self.device), None, index, layer_ids=self.layer_ids, dtype=self.dtype
            )
            return None, slot, batch, hidden.contiguous(), None if scale is None else scale.contiguous()
        # Pinned inputs + non_blocking: no host sync before the forward is queued.
        move = lambda x: None if x is None else x.pin_memory().to(self.device, non_blocking=True)  # noqa: E731
        hidden_dev, scale_dev = forward_capture_packed(
            self.model, move(ids_BT), None, move(index), layer_ids=self.layer_ids, dtype=self.dtype
        )
        n = batch.rows
        host_h, host_s = self._host[slot]
        if n > host_h.shape[0]:  # a sample longer than the planned maximum: a one-off pinned slot
            host_h, host_s = self._pinned(n)
        done_forward = torch.cuda.Event()
        done_forward.record()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(done_forward)
            host_h[:n].copy_(hidden_dev, non_blocking=True)
            if scale_dev is not None:
                host_s[:n].copy_(scale_dev, non_blocking=True)
            done_copy = torch.cuda.Event()
            done_copy.record(self.copy_stream)
        hidden_dev.record_stream(self.copy_stream)
        if scale_dev is not None:
            scale_dev.record_stream(self.copy_stream)
        return done_copy, slot, batch, host_h[:n], None if host_s is None else host_s[:n]
