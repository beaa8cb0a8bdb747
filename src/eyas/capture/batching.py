"""Batching by length under a token budget, with right padding; no sample is ever dropped.

Samples are sorted longest first (ties keep dataset order), then packed greedily: a batch of B
samples padded to its longest, T_max, is kept within `token_budget` = B x T_max. Sorting first keeps
padding small and puts the largest batch first, so an out-of-memory error shows in the first
seconds. A sample longer than the budget goes alone in its own batch (logged, never dropped).

Right padding: sample b occupies input_ids_BT[b, :len_b]; its real rows in the flattened [B*T]
view are b*T + 0 .. b*T + len_b - 1. `rows_index` lists them in batch order, so the captured rows
come out sample by sample, exactly the order the store writes them. Example, lengths [3, 2], T=3:

    input_ids_BT = [[a b c], [d e PAD]]   rows_index = [0 1 2 3 4]   (row 5, the PAD, is never stored)

No attention mask is needed: attention is causal, so a real token never sees the pads that follow
it, and the pad rows' outputs are dropped. Running without a mask lets SDPA use its causal (flash)
kernel, and avoids the padding-mask paths some model implementations get wrong (DeepSeek-V3's MLA
with SDPA fails on a padding mask in transformers 5.24). Tests check padded rows equal the
unbatched reference for every supported family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    ids: list[str]  # sample ids, in row order
    lengths: list[int]  # real tokens per sample
    input_ids_BT: torch.Tensor  # int64, right-padded
    rows_index: torch.Tensor | None  # int64 [N] flat indices of real rows; None when no padding

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.input_ids_BT.numel()


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into batches with len(batch) x max length <= token_budget.

    Every index appears in exactly one batch; samples longer than the budget go alone.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget: {token_budget} must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        t_max = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) + 1) * t_max > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def make_batch(ids: Sequence[str], token_lists: Sequence[torch.Tensor], *, pad_token_id: int = 0) -> Batch:
    """Right-pad 1-D int64 token tensors into one Batch."""
    lengths = [int(t.numel()) for t in token_lists]
    if min(lengths) <= 0:
        raise ValueError(f"empty sample among {list(ids)[:5]}")
    b, t = len(lengths), max(lengths)
    input_ids_BT = torch.full((b, t), pad_token_id, dtype=torch.int64)
    for row, toks in enumerate(token_lists):
        input_ids_BT[row, : toks.numel()] = toks
    if all(n == t for n in lengths):
        return Batch(list(ids), lengths, input_ids_BT, None)
    rows_index = torch.cat([row * t + torch.arange(n) for row, n in enumerate(lengths)])
    return Batch(list(ids), lengths, input_ids_BT, rows_index)
