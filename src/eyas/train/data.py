"""Training data for the drafter: two sources, one batch format, one deterministic order.

- `StoreSource` (offline): hidden states read from an `eyas capture` store (StoreReader), token ids
  and loss masks from the prepared dataset the store's manifest names (fingerprint checked).
- `OnlineSource`: the target in the loop; `forward_capture` runs on each batch, nothing is written.

Both produce `Batch(input_ids_BT, loss_mask_BT, aux_BTAD, final_BTD, tokens)`, right-padded to the
longest sample of the micro-batch (padding has loss mask 0, and attention is causal within a row,
so padding never changes a real position's result).

Order: optimizer step s of a run with global batch G over n samples reads
`perm_e[i*G : (i+1)*G]` where e = s // ceil(n/G), i = s % ceil(n/G) and perm_e is a permutation
seeded by (seed, e). The last batch of an epoch may be smaller: no sample is silently dropped.
The G ids are laid out [accum][world][micro] so one process with micro-batch 2 and two processes
with micro-batch 1 see the same samples. The step number is therefore the whole data position.

Shape legend: B batch, T tokens, A aux layers, D target hidden size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError


@dataclass
class Batch:
    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    aux_BTAD: torch.Tensor
    final_BTD: torch.Tensor
    tokens: int
    """Real (unpadded) tokens in the batch."""


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
    """The target runs on every batch (`forward_capture`): nothing is stored."""

    def __init__(self, split, order, *, model, layer_ids: list[int], max_length: int):
        super().__init__(split, order, max_length=max_length)
        self.model, self.layer_ids = model, layer_ids

    def batch(self, items: list[Item], device) -> Batch:
        from eyas.target import forward_capture

        ids, mask = self._token_batch(items, device)
        lengths = torch.tensor([it.input_ids.shape[0] for it in items], device=device)
        attn = (torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]).long()
        aux, final = forward_capture(self.model, ids, attn, layer_ids=self.layer_ids)
        return Batch(ids, mask, aux, final, int(lengths.sum()))


class StoreSource(_TokenSource):
    """Hidden states from a store; ids and masks from the prepared split it was captured from."""

    def __init__(self, reader, split, order, *, max_length: int, dtype: torch.dtype):
        super().__init__(split, order, max_length=max_length)
        self.reader, self.dtype = reader, dtype

    def load(self, items: list[Item], *, pin: bool = False) -> Batch:
        """The batch on the CPU (pinned when `pin`): safe to run in a background thread."""
        ids, mask = self._token_batch(items, "cpu")
        auxs, finals = [], []
        for it in items:
            aux, final = self.reader.get(it.id, dtype=self.dtype)
            T = it.input_ids.shape[0]
            if aux.shape[0] < T:
                raise EyasError(f"store {self.reader.path}: sample {it.id} has {aux.shape[0]} rows, the prepared "
                                f"dataset has {T} tokens; the store does not match its prepared dataset")
            auxs.append(aux[:T])
            finals.append(final[:T])
        aux, final = _pad(auxs), _pad(finals)
        if pin:
            aux, final = aux.pin_memory(), final.pin_memory()
        return Batch(ids, mask, aux, final, sum(it.input_ids.shape[0] for it in items))

    def batch(self, items: list[Item], device) -> Batch:
        return to_device(self.load(items), device)


def to_device(b: Batch, device) -> Batch:
    nb = torch.device(device).type == "cuda"
    return Batch(b.input_ids_BT.to(device, non_blocking=nb), b.loss_mask_BT.to(device, non_blocking=nb),
                 b.aux_BTAD.to(device, non_blocking=nb), b.final_BTD.to(device, non_blocking=nb), b.tokens)


class Prefetcher:
    """Loads the next `depth` store batches in a background thread while the GPU trains.

    `schedule` yields item lists in consumption order; `next_batch()` returns them in that order
    on `device`. Sources without `load` (online: the target runs on the device) are not threaded.
    """

    def __init__(self, src, schedule, device, *, depth: int = 2):
        import queue
        import threading

        self.src, self.device = src, torch.device(device)
        self.threaded = hasattr(src, "load")
        self._schedule = iter(schedule)
        if self.threaded:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            for items in self._schedule:
                if self._stop.is_set():
                    return
                self._q.put(self.src.load(items, pin=self.device.type == "cuda"))
        except BaseException as exc:  # surfaced in the main thread
            self._q.put(exc)

    def next_batch(self) -> Batch:
        if not self.threaded:
            return self.src.batch(next(self._schedule), self.device)
        got = self._q.get()
        if isinstance(got, BaseException):
            raise got
        return to_device(got, self.device)

    def close(self) -> None:
        if self.threaded:
            self._stop.set()
            while not self._q.empty():
                self._q.get_nowait()


def open_store(path: Path):
    """(StoreReader, PreparedSplit, manifest): the store joined with the prepared split it was
    captured from (eyas.store.dataset.HiddenStateDataset checks the split's fingerprint)."""
    from eyas.store.dataset import HiddenStateDataset

    ds = HiddenStateDataset(path)
    return ds.store, ds.split, ds.store.manifest


def store_order(reader, split) -> list[int]:
    """Indices into the prepared split of the store's samples, in store order."""
    return [split.index_of(sid) for sid in reader.sample_ids]


# ----------------------------------------------------------------------------------------------
# order


@dataclass(kw_only=True)
class Plan:
    """Which samples each rank reads at each optimizer step."""

    n: int
    """Samples in the training source."""
    micro_batch: int
    """Samples per micro-batch per rank."""
    accum: int
    """Micro-batches per optimizer step."""
    world: int
    """Data-parallel ranks."""
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.world

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.global_batch)

    def step_indices(self, step: int) -> list[int]:
        """The global batch of optimizer step `step` (0-based)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.n, generator=g)
        G = self.global_batch
        return perm[i * G:(i + 1) * G].tolist()

    def micro_indices(self, step: int, rank: int) -> list[list[int]]:
        """[accum] lists of indices for `rank` (a list may be empty at the end of an epoch)."""
        idx = self.step_indices(step)
        B, W = self.micro_batch, self.world
        return [idx[(m * W + rank) * B:(m * W + rank + 1) * B] for m in range(self.accum)]


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
                for name, suffix in (("embed", "embed_tokens.weight"), ("lm_head", "lm_head.weight"),
                                     ("final_norm", "model.norm.weight")):
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
            raise EyasError(f"target {target_dir}: config says tie_word_embeddings=false but there is no lm_head.weight")
        out["lm_head"] = out["embed"]
    return out
