"""The draft vocabulary: the V most frequent target tokens at loss-masked (assistant) positions.

The drafter's lm_head only scores these V ids (32000 of Llama-3's 128256 by default), which cuts the
largest matmul of the drafter by 4x at the price of never proposing the rare rest. The choice is
written as SGLang/vLLM expect it:

    used  [V]  target ids, sorted ascending       e.g. used = [2, 5, 9]
    d2t   [V]  int64 OFFSETS: target = draft + d2t[draft]      d2t  = [2, 4, 7]
    t2d   [Vt] bool mask over the target vocab                 t2d  = [F F T F F T F F F T ...]

Ties in frequency go to the lower target id, and ids never seen fill any remaining slots in id
order, so the vocabulary is a deterministic function of the counts. `coverage` is the fraction of
assistant tokens whose id is in the draft vocab (the best top-1 accuracy any drafter can reach).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def vocab_maps(used_V: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one derivation of the engines' maps from the draft vocabulary's target ids (ascending):
    d2t [V] int64 offsets (target = draft + d2t[draft]) and t2d [Vt] bool membership. CPU tensors."""
    used = torch.as_tensor(used_V, dtype=torch.int64).cpu()
    d2t = used - torch.arange(used.numel(), dtype=torch.int64, device="cpu")  # explicit: callers may run under
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")  # a `with torch.device("cuda")` context
    t2d[used] = True
    return d2t, t2d


def target_ids_of(d2t_V: torch.Tensor) -> torch.Tensor:
    """The inverse reading: [V] target id of each draft id = draft id + d2t[draft id]."""
    return torch.arange(d2t_V.numel(), device=d2t_V.device) + d2t_V.to(torch.int64)


@dataclass(kw_only=True)
class DraftVocab:
    used: torch.Tensor
    """[V] int64 target ids, ascending."""
    counts: torch.Tensor
    """[Vt] int64 assistant-token counts the choice was made from."""

    @property
    def size(self) -> int:
        return int(self.used.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return vocab_maps(self.used, self.counts.numel())[0]

    @property
    def t2d(self) -> torch.Tensor:
        return vocab_maps(self.used, self.counts.numel())[1]

    def coverage(self) -> float:
        total = int(self.counts.sum())
        return float(self.counts[self.used].sum()) / total if total else 0.0

    def report(self) -> dict:
        return {
            "draft_vocab_size": self.size,
            "target_vocab_size": int(self.counts.numel()),
            "assistant_tokens": int(self.counts.sum()),
            "distinct_assistant_tokens": int((self.counts > 0).sum()),
            "coverage": round(self.coverage(), 6),
        }


def count_assistant_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """[Vt] counts of token ids at loss-masked positions; `samples` yield .input_ids/.loss_mask
    (prepared Sample) or dicts with those keys (store records)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s["input_ids"] if isinstance(s, dict) else s.input_ids
        mask = s["loss_mask"] if isinstance(s, dict) else s.loss_mask
        sel = torch.as_tensor(ids)[torch.as_tensor(mask, dtype=torch.bool)]
        if sel.numel():
            if int(sel.max()) >= vocab_size or int(sel.min()) < 0:
                raise ValueError(f"token id {int(sel.max())} outside the target vocab of {vocab_size}")
            counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Pick the `size` most frequent ids (ties -> lower id), returned sorted ascending."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    Vt = counts.numel()
    if not 0 < size <= Vt:
        raise ValueError(f"--draft-vocab: size {size} must be in 1..{Vt} (the target vocab)")
    # stable sort by count descending keeps ascending id order within equal counts
    order = torch.sort(-counts, stable=True).indices
    used = torch.sort(order[:size]).values
    return DraftVocab(used=used, counts=counts)
