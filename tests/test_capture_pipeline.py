"""CapturePipeline: disk writes overlap the next forward; a writer failure stops the run."""

from __future__ import annotations

import time

import pytest
import torch

import eyas.capture.pipeline as pipeline_mod
from eyas.capture.batching import make_batch
from eyas.capture.pipeline import CapturePipeline


class SlowWriter:
    def __init__(self, delay, fail_at=None):
        self.delay, self.fail_at, self.calls = delay, fail_at, []

    def add_packed(self, ids, lengths, hidden, scale):
        time.sleep(self.delay)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.calls.append((list(ids), hidden.clone()))


def fake_forward(delay):
    def forward(model, ids_BT, mask, rows_index, *, layer_ids, dtype):
        time.sleep(delay)
        rows = ids_BT.reshape(-1) if rows_index is None else ids_BT.reshape(-1)[rows_index]
        hidden = rows.to(torch.bfloat16)[:, None, None].expand(-1, len(layer_ids) + 1, 4).contiguous()
        return hidden, None

    return forward


@pytest.fixture
def model():
    return torch.nn.Linear(4, 4)  # only its device is used


def batches(n):
    return [
        make_batch([f"b{i}a", f"b{i}b"], [torch.tensor([i, i + 1, i + 2]), torch.tensor([i + 3])]) for i in range(n)
    ]


def test_writes_overlap_forwards_and_keep_order(model, monkeypatch):
    monkeypatch.setattr(pipeline_mod, "forward_capture_packed", fake_forward(0.05))
    writer = SlowWriter(0.05)
    pipe = CapturePipeline(model, layer_ids=[1, 2], dtype="bf16", hidden_size=4, max_rows=8, queue_depth=2)
    t0 = time.perf_counter()
    stats = pipe.run(batches(12), writer)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.95  # serial would be 12 x (0.05 + 0.05) = 1.2 s; overlapped about 0.65 s
    assert [c[0] for c in writer.calls] == [[f"b{i}a", f"b{i}b"] for i in range(12)]
    assert stats.rows == 12 * 4 and stats.padded_tokens == 12 * 6
    # Padding rows were dropped: batch i holds rows i, i+1, i+2, i+3 (not the PAD after i+3).
    assert writer.calls[5][1][:, 0, 0].tolist() == [5.0, 6.0, 7.0, 8.0]


def test_writer_failure_stops_the_run(model, monkeypatch):
    monkeypatch.setattr(pipeline_mod, "forward_capture_packed", fake_forward(0.0))
    writer = SlowWriter(0.01, fail_at=2)
    pipe = CapturePipeline(model, layer_ids=[1], dtype="bf16", hidden_size=4, max_rows=8, queue_depth=2)
    seen = []

    def source():
        for b in batches(50):
            seen.append(b)
            yield b

    with pytest.raises(OSError, match="No space"):
        pipe.run(source(), writer)
    assert len(writer.calls) == 2 and len(seen) < 10  # stopped soon after the failure, not after 50 batches
