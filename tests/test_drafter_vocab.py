"""The draft vocabulary: frequency order, ties, d2t offsets, t2d mask, coverage."""

from __future__ import annotations

import pytest
import torch

from eyas.data.prepared import Sample
from eyas.drafter.vocab import build_draft_vocab, count_assistant_tokens


def test_counts_only_loss_masked_tokens():
    s = [
        Sample("a", torch.tensor([5, 5, 7, 9, 9, 9]), torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.bool)),
        {"input_ids": torch.tensor([3, 7]), "loss_mask": torch.tensor([True, True])},
    ]
    c = count_assistant_tokens(s, 12)
    assert c.tolist() == [0, 0, 0, 1, 0, 0, 0, 2, 0, 2, 0, 0]
    with pytest.raises(ValueError):
        count_assistant_tokens([Sample("b", torch.tensor([12]), torch.tensor([True]))], 12)


def test_most_frequent_sorted_with_offsets():
    counts = torch.tensor([0, 4, 9, 0, 4, 1, 7, 0])
    v = build_draft_vocab(counts, 4)
    # top by count: 2 (9), 6 (7), then 1 and 4 tie at 4 -> both fit; ascending order
    assert v.used.tolist() == [1, 2, 4, 6]
    assert v.d2t.tolist() == [1, 1, 2, 3]  # target = draft + d2t[draft]
    assert (torch.arange(4) + v.d2t).tolist() == v.used.tolist()
    assert v.t2d.tolist() == [False, True, True, False, True, False, True, False]
    assert v.coverage() == pytest.approx(24 / 25)
    # tie broken toward the lower id
    v3 = build_draft_vocab(counts, 3)
    assert v3.used.tolist() == [1, 2, 6]
    # more slots than seen ids: unseen ids fill in id order
    v6 = build_draft_vocab(counts, 6)
    assert v6.used.tolist() == [0, 1, 2, 4, 5, 6]
    assert v6.report()["distinct_assistant_tokens"] == 5
    with pytest.raises(ValueError, match="draft-vocab"):
        build_draft_vocab(counts, 9)
