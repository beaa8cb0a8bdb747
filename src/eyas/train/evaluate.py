"""Evaluation during and at the end of `eyas train`: per-step accuracy, loss and simulated acceptance length
(train/loop.py's module docstring says how tau is simulated)."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def evaluate(module, src, *, forward_batch, K: int, weights, d, tokens_per_batch: int, device) -> dict[str, Any]:
    """Per-step top-1 accuracy, loss and simulated acceptance length on the eval source (sharded by
    rank, packed into rows of at most `tokens_per_batch` tokens)."""
    from eyas.train.batches import _packed_to, online_packed, store_packed
    from eyas.train.data import StoreSource
    from eyas.train.dist import all_reduce_sum
    from eyas.train.plans import cut_by_tokens

    was = module.training
    module.eval()
    stats = torch.zeros(3 * K + 2, dtype=torch.float64, device=device)
    den = torch.zeros(K, dtype=torch.float64, device=device)
    mine = [src.item(i) for i in range(d.rank, len(src), d.world)]
    lengths = [int(it.input_ids.shape[0]) for it in mine]
    rows = [[mine[i] for i in run] for run in cut_by_tokens(list(range(len(mine))), lengths, tokens_per_batch)]
    n_rows = torch.tensor([len(rows)], dtype=torch.float64, device=device)
    if d.enabled:  # equal count on every rank (collectives inside the FSDP forward)
        import torch.distributed as tdist

        tdist.all_reduce(n_rows, op=tdist.ReduceOp.MAX)
    for b in range(int(n_rows)):
        items = rows[b] if b < len(rows) else [dummy_item(src.item(0))]
        if isinstance(src, StoreSource):
            batch = _packed_to(store_packed(src, items, steps=K, pad_to=None), device)
        else:
            batch = online_packed(src, items, device, steps=K, pad_to=None)
        dn = torch.tensor([float(len(r)) for r in batch.rows], dtype=torch.float64, device=device)
        _, st = forward_batch(batch, dn)
        stats += st.double()
        den += dn
    all_reduce_sum(stats, d)
    all_reduce_sum(den, d)
    module.train(was)
    ce, correct, valid = stats[:K], stats[K : 2 * K], stats[2 * K : 3 * K]
    accepted, rounds = float(stats[3 * K]), float(stats[3 * K + 1])
    loss_k = (ce / den.clamp_min(1)).tolist()
    return {
        "loss": sum(w * x for w, x in zip(weights, loss_k)),
        "loss_per_step": loss_k,
        "acc_per_step": (correct / valid.clamp_min(1)).tolist(),
        "acceptance_length": 1.0 + accepted / max(rounds, 1.0),
        "rounds": int(rounds),
        "samples": len(src),
    }


def dummy_item(item):
    """A sample with an empty loss mask: keeps a rank with no data in the collectives, adds nothing."""
    from eyas.train.data import Item

    return Item(item.id, item.input_ids, torch.zeros_like(item.loss_mask))
