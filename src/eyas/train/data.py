"""Training data for the drafter: two sources of the same samples, and the target's own tensors.

- `StoreSource` (offline): hidden states read from an `eyas capture` store (StoreReader), token ids
  and loss masks from the prepared dataset the store's manifest names (fingerprint checked).
- `OnlineSource`: the target in the loop; it runs on each batch, nothing is written. With a
  `StateCache` it keeps the states of the samples it has seen, and later epochs read them back.

What the sources feed: packed batches (batches.py), made ahead of the step that trains on them
(prefetch.py), in the order of a plan (plans.py). `read_target_tensors` reads the target's embedding,
lm_head and final norm without loading the whole model.

Shape legend: N packed tokens, A aux layers, D target hidden size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError


@dataclass
class Item:
    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def _pad(seqs: list[torch.Tensor], value=0) -> torch.Tensor:
    T = max(s.shape[0] for s in seqs)
    out = seqs[0].new_full((len(seqs), T, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


class _TokenSource:
    """Items (ids + loss mask, truncated to max_length) from a prepared split, by index."""

    def __init__(self, split, order: list[int], *, max_length: int):
        self.split, self.order, self.max_length = split, order, max_length

    def __len__(self) -> int:
        return len(self.order)

    def item(self, i: int) -> Item:
        s = self.split[self.order[i]]
        L = self.max_length
        return Item(s.id, s.input_ids[:L], s.loss_mask[:L])

    def _token_batch(self, items: list[Item], device):
        ids = _pad([it.input_ids for it in items]).to(device)
        mask = _pad([it.loss_mask for it in items], False).to(device)
        return ids, mask


class OnlineSource(_TokenSource):
    """The target runs on a batch's samples the first time they are read; with a `StateCache` it
    keeps their states and later epochs read them back instead of running the target again."""

    def __init__(self, split, order, *, model, layer_ids: list[int], max_length: int):
        super().__init__(split, order, max_length=max_length)
        self.model, self.layer_ids = model, layer_ids
        self.cache: StateCache | None = None
        self.target_forwards = 0
        """Target forwards run so far (a batch read wholly from the cache runs none)."""


class StateCache:
    """The online target's states (aux [A, D] and final [D] per token) of every training sample,
    kept on the training device once computed, in the target's dtype.

    One row block per sample, at a fixed offset; row `total` stays zero and stands for padding. A
    batch gathers its rows with one index per token, so a cached batch costs two gathers instead of
    a target forward. Filled as samples are first read: the first epoch runs the target, the later
    ones only where a sample was not yet seen (each process caches the samples it reads)."""

    def __init__(self, ids: list[str], lengths: list[int], *, n_aux: int, hidden: int, dtype, device):
        self.offset, off = {}, 0
        for sid, n in zip(ids, lengths):
            self.offset[sid] = off
            off += int(n)
        self.total = off
        self.aux = torch.zeros(off + 1, n_aux, hidden, dtype=dtype, device=device)
        self.final = torch.zeros(off + 1, hidden, dtype=dtype, device=device)
        self.filled: set[str] = set()

    @staticmethod
    def bytes_needed(lengths: list[int], *, n_aux: int, hidden: int, dtype) -> int:
        return (sum(int(n) for n in lengths) + 1) * (n_aux + 1) * hidden * torch.empty((), dtype=dtype).element_size()

    def missing(self, items: list[Item]) -> list[Item]:
        return [it for it in items if it.id not in self.filled]

    def _index(self, items: list[Item], total: int | None = None) -> torch.Tensor:
        parts = [torch.arange(self.offset[it.id], self.offset[it.id] + it.input_ids.shape[0]) for it in items]
        n = sum(p.shape[0] for p in parts)
        if total is not None and total > n:
            parts.append(torch.full((total - n,), self.total))  # the zero row
        idx = torch.cat(parts)
        return idx.to(self.aux.device, non_blocking=self.aux.device.type == "cuda")

    def put(self, items: list[Item], aux_NAD: torch.Tensor, final_ND: torch.Tensor) -> None:
        """Store the states of `items`, laid end to end in that order (rows past them are ignored)."""
        idx = self._index(items)
        n = idx.shape[0]
        self.aux.index_copy_(0, idx, aux_NAD[:n].to(self.aux.dtype))
        self.final.index_copy_(0, idx, final_ND[:n].to(self.final.dtype))
        self.filled.update(it.id for it in items)

    def gather(self, items: list[Item], total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_NAD, final_ND) of `items` end to end, zero rows up to `total`; all must be filled."""
        idx = self._index(items, total)
        return self.aux.index_select(0, idx), self.final.index_select(0, idx)


class StoreSource(_TokenSource):
    """Hidden states from a store; ids and masks from the prepared split it was captured from."""

    def __init__(self, reader, split, order, *, max_length: int, dtype: torch.dtype):
        super().__init__(split, order, max_length=max_length)
        self.reader, self.dtype = reader, dtype


def open_store(path: Path, *, prepared: Path | None = None):
    """(StoreReader, PreparedSplit, manifest): the store joined with the prepared split it was
    captured from (at `prepared` when it moved; eyas.store.dataset.HiddenStateDataset checks the split's fingerprint)."""
    from eyas.store.dataset import HiddenStateDataset

    ds = HiddenStateDataset(path, prepared_path=prepared)
    return ds.store, ds.split, ds.store.manifest


def store_order(reader, split) -> list[int]:
    """Indices into the prepared split of the store's samples, in store order."""
    return [split.index_of(sid) for sid in reader.sample_ids]


# ----------------------------------------------------------------------------------------------
# the target's embedding / lm_head / final norm without loading the whole model


def read_target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    """{'embed', 'lm_head', 'final_norm'} read straight from the target's safetensors.

    lm_head falls back to the embedding when the target ties them (no lm_head.weight stored).
    """
    from safetensors import safe_open

    target_dir = Path(target_dir)
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise EyasError(f"target {target_dir}: no *.safetensors files (eyas reads the embedding and lm_head from them)")
    found: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118  (safe_open is not a dict)
                for name, suffix in (
                    ("embed", "embed_tokens.weight"),
                    ("lm_head", "lm_head.weight"),
                    ("final_norm", "model.norm.weight"),
                ):
                    if key.endswith(suffix) and ("layers." not in key) and name not in found:
                        found[name] = (f, key)
    if "embed" not in found:
        raise EyasError(f"target {target_dir}: no `*embed_tokens.weight` tensor in its safetensors files")
    out = {}
    for name, (f, key) in found.items():
        with safe_open(str(f), framework="pt") as fh:
            out[name] = fh.get_tensor(key)
    if "lm_head" not in out:
        cfg = json.loads((target_dir / "config.json").read_text())
        if not cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", True)):
            raise EyasError(
                f"target {target_dir}: config says tie_word_embeddings=false but there is no lm_head.weight"
            )
        out["lm_head"] = out["embed"]
    return out
