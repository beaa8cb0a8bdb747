"""Training data for the drafter: two sources, one batch layout (packed rows), one deterministic order.

- `StoreSource` (offline): hidden states read from an `eyas capture` store (StoreReader), token ids
  and loss masks from the prepared dataset the store's manifest names (fingerprint checked).
- `OnlineSource`: the target in the loop; it runs on each batch, nothing is written.

Both produce `PackedBatch`: the micro-batch's samples laid end to end in one row (eyas/packing.py),
optionally padded to a fixed length by one extra segment with loss mask 0, plus the rows that carry
a loss at each TTT step. `PackedPrefetcher` prepares the next batch while the current one trains.

Order (`Plan`, by sample count): optimizer step s of a run with global batch G over n samples reads
`perm_e[i*G : (i+1)*G]` where e = s // ceil(n/G), i = s % ceil(n/G) and perm_e is a permutation
seeded by (seed, e). The last batch of an epoch may be smaller: no sample is silently dropped.
The G ids are laid out [accum][world][micro] so one process with micro-batch 2 and two processes
with micro-batch 1 see the same samples. The step number is therefore the whole data position.
`TokenPlan` cuts the same permutations into micro-batches of at most `tokens_per_batch` tokens.

Shape legend: N packed tokens, A aux layers, D target hidden size.
"""

from __future__ import annotations

import json
import math
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


# ----------------------------------------------------------------------------------------------
# packed batches (the training layout): samples end to end in one row, see eyas/packing.py


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
    return PackedBatch(mv(b.input_ids_N), b.seg.to(device), [mv(r) for r in b.rows], mv(b.aux_NAD), mv(b.final_ND),
                       b.tokens, b.padded_tokens, b.supervised, b.target_timing,
                       None if b.live is None else mv(b.live))


class HostCopies:
    """`values` with their CUDA tensors copied to pinned host memory behind the work queued so far, without
    waiting for it. `get()` waits for those copies alone (an event), not for the work queued after them: reading
    the device tensor itself (`.tolist()`, `float()`) queues its copy behind everything on the stream, so a step's
    statistics read once the next step is queued would wait for that next step too, and the GPU would idle while
    the host prepares the one after. Other values (and tensors on other devices) pass through."""

    def __init__(self, values):
        self.event = None
        out = []
        for v in values:
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                h = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                h.copy_(v, non_blocking=True)
                v = h
                self.event = self.event or torch.cuda.Event()
            out.append(v)
        if self.event is not None:
            self.event.record()
        self.values = tuple(out)

    def get(self) -> tuple:
        if self.event is not None:
            self.event.synchronize()
        return self.values


def _batch_tensors(b: PackedBatch) -> tuple[torch.Tensor, ...]:
    return (b.input_ids_N, b.aux_NAD, b.final_ND, b.seg.cu_seqlens, b.seg.positions_N, b.seg.ends_N, *b.rows,
            *([] if b.live is None else [b.live]))


def hand_over(b: PackedBatch, done, device) -> PackedBatch:
    """A batch made on a side stream (`done`: the event recorded after it), for the current stream: it waits for
    the event, and the batch's tensors are marked as used there (freed only once its work is done)."""
    main = torch.cuda.current_stream(device)
    main.wait_event(done)
    for t in _batch_tensors(b):
        t.record_stream(main)
    return b


class AheadUploader:
    """Host batches (pinned) copied to the GPU on a side stream, one batch ahead: the next batch's copy overlaps
    the current step's compute instead of queueing in front of it on the compute stream."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)
        self._ahead = None

    def start(self, host: PackedBatch) -> None:
        """Queue `host`'s copy behind the work queued so far (the batch before it may still be in use)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            b = _packed_to(host, self.device)
            done = torch.cuda.Event()
            done.record()
        self._ahead = (b, done)

    @property
    def started(self) -> bool:
        return self._ahead is not None

    def take(self) -> PackedBatch:
        """The started batch, ready for the current stream."""
        b, done = self._ahead
        self._ahead = None
        return hand_over(b, done, self.device)


def store_packed(src: StoreSource, items: list[Item], *, steps: int, pad_to: int | None, pin: bool = False) -> PackedBatch:
    """A packed batch of stored states on the host (safe in a background thread)."""
    ids, mask, seg, rows = pack_tokens(items, steps=steps, pad_to=pad_to)
    auxs, finals = [], []
    for it in items:
        aux, final = src.reader.get(it.id, dtype=src.dtype)
        T = it.input_ids.shape[0]
        if aux.shape[0] < T:
            raise EyasError(f"store {src.reader.path}: sample {it.id} has {aux.shape[0]} rows, the prepared "
                            f"dataset has {T} tokens; the store does not match its prepared dataset")
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
    return PackedBatch(ids_d, seg_d, [r.to(dev, non_blocking=nb) for r in rows], aux, final, n, seg.total,
                       int(mask.sum()), live=live.to(dev, non_blocking=nb))


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


class PackedPrefetcher:
    """Packed batches in consumption order, the next one prepared while the current one trains.

    Offline: a background thread reads and packs stored states into pinned host memory; on CUDA the batch after
    the one handed out is copied to the GPU on a side stream when it is ready (AheadUploader).
    Online on CUDA: the target's forward for batch i+1 is enqueued on a side stream before the
    drafter's step on batch i, so the two overlap on the GPU; the side stream's start/end events
    give the time the target took. Online on the CPU: sequential. (Online batches' host parts made ahead by a
    thread, as the offline reader makes its batches, gained nothing.)
    """

    def __init__(self, src, schedule, device, *, steps: int, pad_to: int | None, depth: int = 2):
        import queue
        import threading

        self.src, self.device, self.steps, self.pad_to = src, torch.device(device), steps, pad_to
        self.offline = isinstance(src, StoreSource)
        self._schedule = iter(schedule)
        if self.offline:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True)
            self._thread.start()
            self._uploader = AheadUploader(self.device) if self.device.type == "cuda" else None
        else:
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._pending = None
            self._launch()

    # offline -------------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            for items in self._schedule:
                if self._stop.is_set():
                    return
                self._q.put(store_packed(self.src, items, steps=self.steps, pad_to=self.pad_to,
                                         pin=self.device.type == "cuda"))
        except BaseException as exc:  # surfaced in the main thread
            self._q.put(exc)

    # online --------------------------------------------------------------------------------------
    def _launch(self) -> None:
        import time

        items = next(self._schedule, None)
        if items is None:
            self._pending = None
            return
        if self._stream is None:
            t0 = time.perf_counter()
            b = online_packed(self.src, items, self.device, steps=self.steps, pad_to=self.pad_to)
            b.target_timing = time.perf_counter() - t0
            self._pending = b
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)  # the target's weights and inputs are ready
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            b = online_packed(self.src, items, self.device, steps=self.steps, pad_to=self.pad_to)
            end.record()
        b.target_timing = (start, end)
        self._pending = b

    def next_batch(self) -> PackedBatch:
        if self.offline:
            up = self._uploader
            if up is None:
                return _packed_to(self._host(self._q.get()), self.device)
            if not up.started:
                up.start(self._host(self._q.get()))
            b = up.take()
            if not self._q.empty():  # the next batch is packed already: its copy overlaps this batch's step
                up.start(self._host(self._q.get()))
            return b
        b = self._pending
        if b is None:
            raise StopIteration("the training schedule ran out of batches")
        if self._stream is not None:
            hand_over(b, b.target_timing[1], self.device)
        self._launch()  # the next target forward overlaps this batch's drafter step
        return b

    @staticmethod
    def _host(got):
        if isinstance(got, BaseException):  # the reader thread's error, surfaced here
            raise got
        return got

    def close(self) -> None:
        if self.offline:
            self._stop.set()
            while not self._q.empty():
                self._q.get_nowait()


def target_seconds(t) -> float:
    """Seconds the online target took for a batch, from its `target_timing` (0 offline); call after the step
    synchronised."""
    if t is None:
        return 0.0
    if isinstance(t, float):
        return t
    return t[0].elapsed_time(t[1]) / 1000.0


def cut_by_tokens(order: list[int], lengths, budget: int) -> list[list[int]]:
    """Consecutive runs of `order` holding at most `budget` tokens each (a longer sample alone)."""
    out, cur, used = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


@dataclass(kw_only=True)
class TokenPlan:
    """Like `Plan`, but a micro-batch is as many samples as fit in `tokens_per_batch` tokens.

    Epoch e's permutation (seeded by (seed, e)) is cut greedily into micro-batches; micro-batch j of
    the epoch goes to optimizer step j // (accum * world), accumulation slot and rank as in `Plan`.
    No sample is dropped; the last step of an epoch may hold fewer micro-batches (empty lists).
    """

    lengths: list[int]
    """Tokens of each sample of the training source (after truncation)."""
    tokens_per_batch: int
    accum: int
    world: int
    seed: int

    def __post_init__(self):
        self._epochs: dict[int, list[list[int]]] = {}
        self._starts = [0]  # first step of each epoch computed so far
        if self.lengths and max(self.lengths) > self.tokens_per_batch:
            raise EyasError(f"--tokens-per-batch {self.tokens_per_batch} is smaller than a sample of "
                            f"{max(self.lengths)} tokens; raise it to at least --max-length")

    @property
    def n(self) -> int:
        return len(self.lengths)

    @property
    def global_batch(self) -> str:
        return f"{self.tokens_per_batch}tok x{self.accum * self.world}"

    def micro_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
            self._epochs[epoch] = cut_by_tokens(perm, self.lengths, self.tokens_per_batch)
        return self._epochs[epoch]

    def _epoch_steps(self, epoch: int) -> int:
        return math.ceil(len(self.micro_batches(epoch)) / (self.accum * self.world))

    @property
    def steps_per_epoch(self) -> int:
        return self._epoch_steps(0)

    def _locate(self, step: int) -> tuple[int, int]:
        while len(self._starts) <= 1 or self._starts[-1] <= step:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + self._epoch_steps(e))
        for e in range(len(self._starts) - 1):
            if self._starts[e] <= step < self._starts[e + 1]:
                return e, step - self._starts[e]
        raise AssertionError(step)

    def _slots(self, step: int) -> list[list[int]]:
        e, i = self._locate(step)
        S = self.accum * self.world
        mbs = self.micro_batches(e)[i * S:(i + 1) * S]
        return mbs + [[] for _ in range(S - len(mbs))]

    def step_indices(self, step: int) -> list[int]:
        return [i for mb in self._slots(step) for i in mb]

    def micro_indices(self, step: int, rank: int) -> list[list[int]]:
        slots = self._slots(step)
        return [slots[m * self.world + rank] for m in range(self.accum)]
