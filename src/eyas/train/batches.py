"""Packed batches, the training layout: a micro-batch's samples laid end to end in one row (eyas/packing.py),
optionally padded to a fixed length by one extra segment with loss mask 0, plus the rows that carry a loss
at each TTT step. Made from either source (data.py): stored states read on the host (`store_packed`), or
the online target's states, from its StateCache where it holds them (`online_packed`).

Shape legend: N packed tokens, A aux layers, D target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.errors import EyasError
from eyas.train.data import Item, OnlineSource, StoreSource


@dataclass
class PackedBatch:
    input_ids_N: torch.Tensor
    seg: object
    """eyas.packing.Segments of the row (the samples, then a padding segment if padded)."""
    rows: list[torch.Tensor]
    """[K] positions carrying a loss at TTT step k (drafter/ttt/masks.py supervised_rows)."""
    aux_NAD: torch.Tensor
    final_ND: torch.Tensor
    tokens: int
    """Real (sample) tokens in the row."""
    padded_tokens: int
    """Tokens in the row including the padding tail (what the drafter computes on)."""
    supervised: int
    """Loss-mask positions of the samples (answer tokens)."""
    target_timing: object = None
    """(start, end) CUDA events around the online target forward, or its seconds on the CPU."""
    live: torch.Tensor | None = None
    """Positions carrying a loss at some step (drafter/ttt/masks.py live_positions): made from `rows` when they are on
    the host (pinned when they are), else given; None leaves every position in every step."""

    def __post_init__(self):
        if self.live is None and self.rows and self.rows[0].device.type == "cpu":
            from eyas.drafter.ttt.masks import live_positions

            self.live = live_positions(self.rows, self.input_ids_N.shape[0])
            if self.rows[0].is_pinned():
                self.live = self.live.pin_memory()


def pack_tokens(items: list[Item], *, steps: int, pad_to: int | None):
    """(ids_N, mask_N, Segments, rows) on the host for `items` laid end to end (+ padding tail)."""
    from eyas.drafter.ttt.masks import supervised_rows
    from eyas.packing import Segments, pad_lengths

    lengths = pad_lengths([it.input_ids.shape[0] for it in items], pad_to)
    pad = sum(lengths) - sum(it.input_ids.shape[0] for it in items)
    ids = torch.cat([it.input_ids for it in items] + [torch.zeros(pad, dtype=torch.long)])
    mask = torch.cat([it.loss_mask.bool() for it in items] + [torch.zeros(pad, dtype=torch.bool)])
    seg = Segments.from_lengths(lengths)
    return ids, mask, seg, supervised_rows(mask, seg.ends_N, steps)


def _packed_to(b: PackedBatch, device) -> PackedBatch:
    nb = torch.device(device).type == "cuda"
    mv = lambda t: t.to(device, non_blocking=nb)  # noqa: E731
    return PackedBatch(
        mv(b.input_ids_N),
        b.seg.to(device),
        [mv(r) for r in b.rows],
        mv(b.aux_NAD),
        mv(b.final_ND),
        b.tokens,
        b.padded_tokens,
        b.supervised,
        b.target_timing,
        None if b.live is None else mv(b.live),
    )


def store_packed(
    src: StoreSource, items: list[Item], *, steps: int, pad_to: int | None, pin: bool = False
) -> PackedBatch:
    """A packed batch of stored states on the host (safe in a background thread)."""
    ids, mask, seg, rows = pack_tokens(items, steps=steps, pad_to=pad_to)
    auxs, finals = [], []
    for it in items:
        aux, final = src.reader.get(it.id, dtype=src.dtype)
        T = it.input_ids.shape[0]
        if aux.shape[0] < T:
            raise EyasError(
                f"store {src.reader.path}: sample {it.id} has {aux.shape[0]} rows, the prepared "
                f"dataset has {T} tokens; the store does not match its prepared dataset"
            )
        auxs.append(aux[:T])
        finals.append(final[:T])
    pad = seg.total - sum(a.shape[0] for a in auxs)
    if pad:
        auxs.append(auxs[0].new_zeros(pad, *auxs[0].shape[1:]))
        finals.append(finals[0].new_zeros(pad, *finals[0].shape[1:]))
    aux, final = torch.cat(auxs), torch.cat(finals)
    if pin:
        aux, final, ids = aux.pin_memory(), final.pin_memory(), ids.pin_memory()
        seg, rows = seg.pin_memory(), [r.pin_memory() for r in rows]
    n = sum(it.input_ids.shape[0] for it in items)
    return PackedBatch(ids, seg, rows, aux, final, n, seg.total, int(mask.sum()))


def online_packed(src: OnlineSource, items: list[Item], device, *, steps: int, pad_to: int | None) -> PackedBatch:
    """The packed row's states: read from the source's StateCache where it holds the samples, the
    target run over the others (and the cache filled with them)."""
    from eyas.drafter.ttt.masks import live_positions

    ids, mask, seg, rows = pack_tokens(items, steps=steps, pad_to=pad_to)
    dev = torch.device(device)
    nb = dev.type == "cuda"
    live = live_positions(rows, seg.total)
    if nb:  # pinned first: a copy from pageable memory waits for the work queued before it
        ids, seg, rows, live = ids.pin_memory(), seg.pin_memory(), [r.pin_memory() for r in rows], live.pin_memory()
    ids_d, seg_d = ids.to(dev, non_blocking=nb), seg.to(dev)
    cache = src.cache
    if cache is None:
        aux, final = _target_states(src, items, ids_d, seg_d, dev)
    else:
        todo = cache.missing(items)
        if todo:
            if len(todo) == len(items):
                a, f = _target_states(src, items, ids_d, seg_d, dev)
            else:
                t_ids, _, t_seg, _ = pack_tokens(todo, steps=steps, pad_to=None)
                a, f = _target_states(src, todo, t_ids.to(dev, non_blocking=nb), t_seg.to(dev), dev)
            cache.put(todo, a, f)
        aux, final = cache.gather(items, seg.total)
    n = sum(it.input_ids.shape[0] for it in items)
    return PackedBatch(
        ids_d,
        seg_d,
        [r.to(dev, non_blocking=nb) for r in rows],
        aux,
        final,
        n,
        seg.total,
        int(mask.sum()),
        live=live.to(dev, non_blocking=nb),
    )


def _target_states(src: OnlineSource, items: list[Item], ids_d, seg_d, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over the packed row on `dev` (varlen attention where the model allows it,
    else one padded forward whose real rows are gathered into the row): (aux_NAD, final_ND)."""
    from eyas.packing import packed_unsupported_reason, target_forward_packed
    from eyas.target import forward_capture

    src.target_forwards += 1
    if getattr(src, "_packed_ok", None) is None:
        reason = packed_unsupported_reason(src.model)
        src._packed_ok = reason is None
        if reason:
            from eyas.common import log

            log(f"online target: packed forward unavailable ({reason}); using padded forwards")
    if src._packed_ok:
        with torch.profiler.record_function("eyas.target_forward"):  # (a named range in profiles)
            aux, final = target_forward_packed(src.model, ids_d, seg_d, layer_ids=src.layer_ids)
    else:
        tok, _ = src._token_batch(items, dev)
        lengths = torch.tensor([it.input_ids.shape[0] for it in items], device=dev)
        attn = (torch.arange(tok.shape[1], device=dev)[None] < lengths[:, None]).long()
        a, f = forward_capture(src.model, tok, attn, layer_ids=src.layer_ids)
        keep = attn.bool()
        aux, final = a[keep], f[keep]
        pad = seg_d.total - aux.shape[0]
        if pad:
            aux = torch.cat([aux, aux.new_zeros(pad, *aux.shape[1:])])
            final = torch.cat([final, final.new_zeros(pad, *final.shape[1:])])
    return aux, final
