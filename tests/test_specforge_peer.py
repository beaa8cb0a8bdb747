"""benchmarks/specforge_peer.py: the SpecForge training step train_bench.py compares against.

SpecForge is not installed in CI: there the only check is that its absence is reported as a reason
(never raised); the training check runs only where SpecForge is importable.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def peer():
    return load_benchmark("specforge_peer")


def test_availability_is_reported_not_raised(peer):
    reason = peer.specforge_available()
    if importlib.util.find_spec("specforge") is None:
        assert isinstance(reason, str) and "specforge" in reason and "\n" not in reason
    else:
        assert reason is None


def test_specforge_step_trains_tiny_drafter(peer, one_torch_thread):
    reason = peer.specforge_available()
    if reason is not None:
        pytest.skip(f"SpecForge not importable: {reason}")
    step = peer.build_specforge_step(peer.TINY, seq=64, ttt_steps=3, device="cpu", lr=1e-3)
    losses = [float(step()) for _ in range(6)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert step.info["attention"] == "sdpa" and step.info["teacher"] == "full"
