"""Batching by length: every sample exactly once, budget kept, real rows indexed in order."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from eyas.capture.batching import make_batch, plan_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 1000))
def test_plan_covers_every_sample_once_within_budget(lengths, budget):
    plan = plan_batches(lengths, budget)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in plan:
        t_max = max(lengths[i] for i in b)
        assert len(b) * t_max <= budget or len(b) == 1  # only a lone over-long sample may exceed it


def test_plan_sorts_longest_first_and_packs():
    plan = plan_batches([5, 9, 3, 9, 1], token_budget=20)
    assert plan == [[1, 3], [0, 2, 4]]  # 2 x 9 <= 20; then 3 x 5 <= 20
    assert plan_batches([50, 2], token_budget=10) == [[0], [1]]


def test_make_batch_right_pads_and_indexes_real_rows():
    b = make_batch(["a", "b"], [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], pad_token_id=0)
    assert b.input_ids_BT.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b.rows_index.tolist() == [0, 1, 2, 3, 4]  # flat row 5 is the PAD: never stored
    assert b.input_ids_BT.reshape(-1)[b.rows_index].tolist() == [1, 2, 3, 4, 5]
    full = make_batch(["a", "b"], [torch.tensor([1, 2]), torch.tensor([3, 4])])
    assert full.rows_index is None and full.rows == 4
