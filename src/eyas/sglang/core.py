"""The SGLang capture plugin's core: split packed forwards per request, stitch, write dumps.

Pure torch and the standard library: nothing here imports sglang, so the same code runs inside a
real SGLang scheduler process (through eyas/sglang/plugin.py, the only version-specific module), in
the stand-in server that CI runs (eyas/sglang/standin.py), and in unit tests.

One EXTEND forward of the server packs several requests' new tokens into one row dimension:

    rids                  ["eyas.5.a", "other", "eyas.3.b"]
    extend_prefix_lens    [0, 7, 2]           tokens of the request already in the KV cache
    extend_seq_lens       [3, 1, 1]           new tokens in this forward, one run of rows each
    rows (T = 5 + padding) a a a o b  p p     padding rows (CUDA graph buckets) come last

Rows of request r are rows[start_r : start_r + extend_seq_lens[r]], at absolute positions
prefix_r .. prefix_r + len_r - 1. A chunked prompt arrives over several forwards (interleaved with
other requests); pieces are stitched by absolute position and a sample is written once all of its
prompt tokens are present. The prompt length travels in the request id, chosen by the client
(`make_rid`): `eyas.<L>.<tag>`; requests whose rid does not parse are not ours and are skipped.

A request whose FIRST piece starts at a non-zero prefix was partly served from the prefix cache:
the forward never computed the cached rows, so the sample is written as `rejected` with the reason
(never as complete). Exactly one rank writes: attention-TP rank 0 on the last pipeline rank (the
residual stream is replicated across TP ranks).

Dump layout, one directory per request, renamed into place only when whole (never partial):

    <dump_dir>/<rid>/meta.json           schema, rid, status, reason, num_tokens, positions covered,
                                         layer ids + convention, dtype, shapes, pieces, writer ranks
    <dump_dir>/<rid>/tensors.safetensors aux [L, A, H], final [L, H], input_ids int64 [L],
                                         positions int64 [L]   (complete dumps only)

Shape legend: T packed rows of one forward, L tokens of one request, A aux layers, H hidden size.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.drafter.layouts import CONVENTION, engine_layer_ids, eyas_layer_ids as _eyas_layer_ids

DUMP_SCHEMA = "eyas.sglang-dump/1"
STATUS_SCHEMA = "eyas.sglang-plugin/1"
DEFAULT_DUMP_DIR = "/dev/shm/eyas-dumps"
REPLAY_FLAG = "--disable-prefill-cuda-graph"
"""The server flag that keeps prefill forwards off the CUDA-graph replay path, whose batches carry no request ids."""
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"

_RID_RE = re.compile(r"^eyas\.(\d+)\.([A-Za-z0-9_-]{1,96})$")


# ----------------------------------------------------------------------------- request ids


def make_rid(num_tokens: int, tag: str) -> str:
    """The request id that tells the plugin a request is ours and how many prompt tokens it has."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    rid = f"eyas.{int(num_tokens)}.{tag}"
    if not _RID_RE.match(rid):
        raise ValueError(f"tag {tag!r}: use 1-96 characters from [A-Za-z0-9_-]")
    return rid


def parse_rid(rid: Any) -> int | None:
    """Prompt length encoded in an eyas rid, or None when the request is not ours."""
    if not isinstance(rid, str):
        return None
    m = _RID_RE.match(rid)
    return int(m.group(1)) if m else None


def sglang_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """eyas ids (input to layer i) -> SGLang ids (output of layer i - 1), Llama rule (drafter.layouts)."""
    return engine_layer_ids(layer_ids, "sglang")


def eyas_layer_ids(sglang_ids: Sequence[int]) -> list[int]:
    """SGLang ids (output of layer k) -> eyas ids (input to layer k + 1), Llama rule (drafter.layouts)."""
    return _eyas_layer_ids(sglang_ids, "sglang")


# ----------------------------------------------------------------------------- one forward


@dataclass(kw_only=True)
class ForwardInfo:
    """What the plugin reads from one EXTEND forward (all rows packed; padding rows at the end)."""

    rids: Sequence[Any]
    """Request ids, one per request in the batch (ForwardBatch.rids)."""
    extend_prefix_lens: Sequence[int]
    """Tokens of each request already in the KV cache before this forward."""
    extend_seq_lens: Sequence[int]
    """New tokens of each request in this forward, in row order."""
    aux: torch.Tensor | Sequence[torch.Tensor]
    """Aux hidden states: one [T, A, H] tensor, or A tensors of [T, H] (SGLang's list form)."""
    final_TD: torch.Tensor
    """Final hidden state after the last norm, [T, H]."""
    positions_T: torch.Tensor | None = None
    """Absolute position of every row (checked against prefix + offset when given)."""
    input_ids_T: torch.Tensor | None = None
    """Token id of every row (stored in the dump so the client can match it to its sample)."""
    attn_tp_rank: int = 0
    """This process's rank in the attention tensor-parallel group."""
    pp_rank: int = 0
    """This process's pipeline-parallel rank."""
    pp_size: int = 1
    """Number of pipeline stages."""

    def is_writer(self) -> bool:
        """Exactly one rank writes: attention-TP rank 0 on the last pipeline rank."""
        return self.attn_tp_rank == 0 and self.pp_rank == self.pp_size - 1


def _aux_rows(aux, a: int, b: int) -> torch.Tensor:
    """Rows a..b of the aux states as [n, A, H], whatever form the model returned them in."""
    if isinstance(aux, torch.Tensor):
        if aux.dim() != 3:
            raise ValueError(f"aux: expected [T, A, H], got shape {tuple(aux.shape)}")
        return aux[a:b]
    return torch.stack([x[a:b] for x in aux], dim=1)


def _host(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A CPU copy that never aliases the server's buffers (on a CPU server `.to("cpu")` would), and the
    CUDA event that marks it done, or None when it is done already.

    From a GPU the copy goes into pinned memory without waiting: the scheduler thread goes on with the
    forward while the copy runs in stream order, and the dump writer waits for the event instead."""
    if t.device.type != "cuda":
        return t.to("cpu", copy=True), None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return out, done


def _num_rows(aux) -> int:
    return int(aux.shape[0]) if isinstance(aux, torch.Tensor) else min(int(x.shape[0]) for x in aux)


@dataclass
class _Piece:
    start: int  # absolute position of the first row
    aux_LAD: torch.Tensor
    final_LD: torch.Tensor
    input_ids_L: torch.Tensor | None
    positions_L: torch.Tensor | None
    ready: list[Any] = field(default_factory=list)  # CUDA events of copies still in flight


@dataclass
class _Pending:
    num_tokens: int
    pieces: list[_Piece] = field(default_factory=list)
    covered: int = 0  # positions 0..covered-1 present
    first_seen: float = 0.0
    last_seen: float = 0.0


@dataclass(kw_only=True)
class CompletedSample:
    """A request whose prompt tokens are all present (or a rejected one, with its reason).

    Its states stay in the pieces they arrived in (host copies, in position order): the dump writer
    writes them back to back, so no stitched copy is ever made on the server's thread. `aux_LAD` and
    `final_LD` stitch them on demand."""

    rid: str
    num_tokens: int
    status: str  # "complete" | "rejected"
    reason: str = ""
    aux_pieces: list[torch.Tensor] = field(default_factory=list)
    """[n, A, H] host copies of the aux states, one per piece, in position order."""
    final_pieces: list[torch.Tensor] = field(default_factory=list)
    """[n, H] host copies of the final state, as `aux_pieces`."""
    ids_pieces: list[torch.Tensor] = field(default_factory=list)
    """int64 token ids per piece, as `aux_pieces` (empty when the server reported none)."""
    pos_pieces: list[torch.Tensor] = field(default_factory=list)
    """int64 positions the server reported for each piece's rows (empty when it reported none)."""
    pieces: int = 0
    positions_covered: list[list[int]] = field(default_factory=list)
    ready: list[Any] = field(default_factory=list)
    """CUDA events of host copies still in flight; `wait()` before reading the pieces."""

    def wait(self) -> None:
        """Block until every host copy of this sample has landed."""
        for ev in self.ready:
            ev.synchronize()
        self.ready = []

    def settle(self) -> CompletedSample:
        """Wait for the host copies, then reject the sample if its rows hold other positions than the
        forwards said (checked here, not in the forward, where the positions had not landed yet)."""
        if self.status != "complete":
            return self
        self.wait()
        checked = zip(self.positions_covered, self.pos_pieces, strict=True) if self.pos_pieces else ()
        for (start, end), pos in checked:
            if not torch.equal(pos, torch.arange(start, end, dtype=torch.int64)):
                self.status = "rejected"
                self.reason = f"rows hold positions {pos[:4].tolist()}... but the forward says prefix {start}, length {end - start}"
                self.aux_pieces = self.final_pieces = self.ids_pieces = self.pos_pieces = []
                break
        return self

    @property
    def input_ids_L(self) -> torch.Tensor | None:
        return _stitch(self, self.ids_pieces)

    @property
    def positions_L(self) -> torch.Tensor | None:
        return _stitch(self, self.pos_pieces)

    @property
    def aux_LAD(self) -> torch.Tensor | None:
        return _stitch(self, self.aux_pieces)

    @property
    def final_LD(self) -> torch.Tensor | None:
        return _stitch(self, self.final_pieces)


def _stitch(sample: CompletedSample, pieces: list[torch.Tensor]) -> torch.Tensor | None:
    if not pieces:
        return None
    sample.wait()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class CaptureCore:
    """Per-request stitching state of one server process. Call `observe` for every EXTEND forward.

    `observe` copies only the rows of eyas requests to the CPU (one copy per request piece), keeps
    partial prompts keyed by rid, and returns the samples that became complete or were rejected in
    this forward. Nothing is returned on a non-writer rank, and no tensor is touched there.
    """

    def __init__(self, *, stale_after_s: float = 900.0, max_rejected_memory: int = 100_000):
        self.stale_after_s = stale_after_s
        self._pending: dict[str, _Pending] = {}
        self._rejected: dict[str, float] = {}  # rid -> time; later pieces of a rejected rid are ignored
        self._max_rejected = max_rejected_memory
        self.stats = {"forwards": 0, "pieces": 0, "complete": 0, "rejected": 0}

    def pending_rids(self) -> list[str]:
        return list(self._pending)

    def observe(self, info: ForwardInfo, *, now: float | None = None) -> list[CompletedSample]:
        if not info.is_writer():
            return []
        now = time.time() if now is None else now
        out: list[CompletedSample] = self._evict_stale(now)
        rids, prefix, lens = list(info.rids), list(info.extend_prefix_lens), list(info.extend_seq_lens)
        if not (len(rids) == len(prefix) == len(lens)):
            raise ValueError(f"forward with {len(rids)} rids, {len(prefix)} prefix lens, {len(lens)} seq lens")
        ours = [i for i, r in enumerate(rids) if parse_rid(r) is not None]
        if not ours:
            return out
        self.stats["forwards"] += 1
        total = sum(int(n) for n in lens)
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + int(n))
        # Padding rows come after the real ones: fewer rows than tokens means this forward's
        # tensors do not hold every request's rows (e.g. sequence-sharded), so nothing is trusted.
        rows = min(_num_rows(info.aux), int(info.final_TD.shape[0]))
        short = rows < total
        # one device-to-host copy each for the whole forward's positions and token ids, without waiting:
        # a synchronous copy here would stall the scheduler in the middle of every forward. The positions
        # are checked where the dump is written (CompletedSample.settle), once they have landed.
        pos_all, pos_done = (
            _host(info.positions_T[:total].to(torch.int64))
            if info.positions_T is not None and not short
            else (None, None)
        )
        ids_all, ids_done = (
            _host(info.input_ids_T[:total].to(torch.int64))
            if info.input_ids_T is not None and not short
            else (None, None)
        )
        landing = [ev for ev in (pos_done, ids_done) if ev is not None]
        for i in ours:
            rid, n, p, a = str(rids[i]), int(lens[i]), int(prefix[i]), starts[i]
            num_tokens = parse_rid(rid)
            if rid in self._rejected:
                if p != 0:
                    continue  # a later piece of a prompt already rejected
                del self._rejected[rid]  # the same rid sent again: a fresh prefill
            if short:
                out.append(
                    self._reject(
                        rid,
                        num_tokens,
                        f"the forward holds {rows} rows for {total} tokens "
                        "(rows scattered across ranks: sequence parallel or context parallel?)",
                        now,
                    )
                )
                continue
            pos = pos_all[a : a + n] if pos_all is not None else None
            ids = ids_all[a : a + n] if ids_all is not None else None
            done = self._add_piece(rid, num_tokens, p, a, n, info, pos, ids, landing, now)
            if done is not None:
                out.append(done)
        return out

    # --- internals

    def _add_piece(self, rid, num_tokens, p, a, n, info: ForwardInfo, pos, ids, landing, now) -> CompletedSample | None:
        st = self._pending.get(rid)
        if st is not None and p == 0 and st.covered > 0:
            st = None  # the server restarted this prompt (e.g. retracted): start over
        if st is None:
            if p != 0:
                return self._reject(
                    rid,
                    num_tokens,
                    f"first forward started at prefix {p}: {p} prompt tokens "
                    "were served from the prefix cache and never computed",
                    now,
                )
            st = _Pending(num_tokens=num_tokens, first_seen=now)
            self._pending[rid] = st
        if p != st.covered:
            self._pending.pop(rid, None)
            return self._reject(
                rid,
                num_tokens,
                f"piece at positions {p}..{p + n - 1} does not continue the {st.covered} positions already present",
                now,
            )
        if p + n > num_tokens:
            self._pending.pop(rid, None)
            return self._reject(
                rid,
                num_tokens,
                f"{p + n} positions for a request of {num_tokens} prompt tokens (a decode step or a wrong rid length)",
                now,
            )
        st.last_seen = now
        if n > 0:
            aux, aux_done = _host(_aux_rows(info.aux, a, a + n))
            final, final_done = _host(info.final_TD[a : a + n])
            ready = [ev for ev in (aux_done, final_done) if ev is not None] + landing
            st.pieces.append(_Piece(p, aux, final, ids, pos, ready))
            st.covered += n
            self.stats["pieces"] += 1
        if st.covered < num_tokens:
            return None
        del self._pending[rid]
        self.stats["complete"] += 1
        ids = [pc.input_ids_L for pc in st.pieces]
        pos = [pc.positions_L for pc in st.pieces]
        return CompletedSample(
            rid=rid,
            num_tokens=num_tokens,
            status="complete",
            aux_pieces=[pc.aux_LAD for pc in st.pieces],
            final_pieces=[pc.final_LD for pc in st.pieces],
            ids_pieces=ids if all(t is not None for t in ids) else [],
            pos_pieces=pos if all(t is not None for t in pos) else [],
            pieces=len(st.pieces),
            positions_covered=[[pc.start, pc.start + pc.final_LD.shape[0]] for pc in st.pieces],
            ready=[ev for pc in st.pieces for ev in pc.ready],
        )

    def _reject(self, rid, num_tokens, reason, now) -> CompletedSample:
        self._pending.pop(rid, None)
        self._rejected[rid] = now
        if len(self._rejected) > self._max_rejected:
            for old in sorted(self._rejected, key=self._rejected.get)[: len(self._rejected) // 2]:
                del self._rejected[old]
        self.stats["rejected"] += 1
        return CompletedSample(rid=rid, num_tokens=num_tokens, status="rejected", reason=reason)

    def _evict_stale(self, now) -> list[CompletedSample]:
        out = []
        for rid, st in list(self._pending.items()):
            if now - st.last_seen > self.stale_after_s:
                out.append(
                    self._reject(
                        rid,
                        st.num_tokens,
                        f"only {st.covered} of {st.num_tokens} positions arrived "
                        f"within {self.stale_after_s:.0f} s (request aborted?)",
                        now,
                    )
                )
        return out


# ----------------------------------------------------------------------------- dumps on disk


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf. torch's min and max propagate NaN and an Inf is the min or the max, so one aminmax
    pass decides, without the elementwise temporaries of isfinite (the client checks every sample)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


_IOV_MAX = 512  # buffers per writev call, below every platform's IOV_MAX
_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
}


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _safetensors_file(tensors: list[tuple[str, list[torch.Tensor]]]) -> list[memoryview | bytes]:
    """A safetensors file as buffers to write back to back: the header, then each tensor's bytes. A
    tensor may be given in pieces along its first dimension (written one after the other, never joined)."""
    header: dict[str, Any] = {}
    body: list[memoryview] = []
    offset = 0
    for name, pieces in tensors:
        pieces = [t.contiguous() for t in pieces]
        first = pieces[0]
        if first.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"dump tensor {name}: dtype {first.dtype} is not one the dump format stores")
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in pieces):
            raise ValueError(
                f"dump tensor {name}: pieces of shapes {[tuple(t.shape) for t in pieces]} "
                f"and dtypes {sorted({str(t.dtype) for t in pieces})} do not stack"
            )
        views = [_byte_view(t) for t in pieces]
        size = sum(v.nbytes for v in views)
        shape = [sum(int(t.shape[0]) for t in pieces), *map(int, first.shape[1:])]
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[first.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        body += views
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts aligned for every dtype, as safetensors pads its own
    return [struct.pack("<Q", len(text)) + text, *body]


def _write_buffers(path: Path, buffers: list[memoryview | bytes]) -> None:
    """Write `buffers` to a new file with os.writev, which holds no GIL while the kernel copies (the
    server's scheduler thread keeps running); short writes are continued."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = [memoryview(b).cast("B") for b in buffers if len(b)]
        while left:
            n = os.writev(fd, left[:_IOV_MAX])
            if n <= 0:
                raise OSError(f"{path}: writev wrote nothing")
            while left and n >= left[0].nbytes:
                n -= left[0].nbytes
                left.pop(0)
            if n:
                left[0] = left[0][n:]
    finally:
        os.close(fd)


def write_dump(
    dump_dir: str | Path, sample: CompletedSample, *, layer_ids: Sequence[int], writer: dict[str, Any] | None = None
) -> Path:
    """Write one sample atomically: a hidden temporary directory renamed to `<dump_dir>/<rid>`.

    tensors.safetensors is written here, not by the safetensors package: older releases of it hold the
    GIL for the whole file (the server's scheduler would stall behind every dump), and a sample's
    pieces are written back to back instead of being stitched first."""
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    final = dump_dir / sample.rid
    tmp = dump_dir / f".{sample.rid}.{os.getpid()}.{threading.get_ident()}.tmp"
    sample.settle()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    meta: dict[str, Any] = {
        "schema": DUMP_SCHEMA,
        "rid": sample.rid,
        "status": sample.status,
        "reason": sample.reason,
        "num_tokens": sample.num_tokens,
        "layer_ids": list(map(int, layer_ids)),
        "convention": CONVENTION,
        "sglang_layer_ids": sglang_layer_ids(layer_ids),
        "pieces": sample.pieces,
        "positions_covered": sample.positions_covered,
        "writer": writer or {},
        "created": time.time(),
    }
    try:
        if sample.status == "complete":
            tensors = []  # the int64 tensors first: every tensor then starts aligned to its element size
            if sample.pos_pieces:
                tensors.append(("positions", sample.pos_pieces))
            if sample.ids_pieces:
                tensors.append(("input_ids", sample.ids_pieces))
            tensors += [("aux", sample.aux_pieces), ("final", sample.final_pieces)]
            _write_buffers(tmp / TENSORS_FILE, _safetensors_file(tensors))
            first = sample.aux_pieces[0]
            meta.update(
                dtype=_dtype_name(first),
                shapes={
                    name: [sum(int(t.shape[0]) for t in pieces), *map(int, pieces[0].shape[1:])]
                    for name, pieces in tensors
                },
            )
        (tmp / META_FILE).write_text(json.dumps(meta, sort_keys=True))  # one line: the C encoder, not the Python one
        if final.exists():  # a re-sent request: replace the old dump whole
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass(kw_only=True)
class Dump:
    """A dump read back by the client."""

    path: Path
    meta: dict[str, Any]
    aux_LAD: torch.Tensor | None = None
    final_LD: torch.Tensor | None = None
    input_ids_L: torch.Tensor | None = None
    positions_L: torch.Tensor | None = None

    @property
    def status(self) -> str:
        return self.meta.get("status", "?")


def read_dump(path: str | Path, *, tensors: bool = True) -> Dump:
    """Read a dump directory written by `write_dump` (raises FileNotFoundError if absent)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    d = Dump(path=path, meta=meta)
    if tensors and meta.get("status") == "complete":
        t = load_file(str(path / TENSORS_FILE))
        d.aux_LAD, d.final_LD = t["aux"], t["final"]
        d.input_ids_L, d.positions_L = t.get("input_ids"), t.get("positions")
    return d


class DumpWriter:
    """Writes completed samples, optionally on background threads (the server must not block on disk).

    With `threads=N > 0` a bounded queue feeds N writer threads (a full queue makes `submit` wait:
    back-pressure rather than unbounded memory); `flush()` waits until everything queued is on
    disk; `close()` flushes and ends the threads. Write errors are counted and kept (`errors`), never
    raised into the server's forward.
    """

    def __init__(
        self,
        dump_dir: str | Path,
        *,
        layer_ids: Sequence[int],
        writer: dict[str, Any] | None = None,
        threads: int = 0,
        max_queue: int = 64,
    ):
        if threads < 0:
            raise ValueError(f"threads: {threads}, expected >= 0")
        self.dump_dir = Path(dump_dir)
        self.layer_ids = list(layer_ids)
        self.writer = writer or {}
        self.errors: list[str] = []
        try:  # made now, not at the first dump: the client's preflight looks for it before sending anything
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # counted like a failed write (the plugin's write_errors), never raised into a server
            self.errors.append(f"dump dir {self.dump_dir}: {type(exc).__name__}: {exc}")
        self.written = 0
        self._count_lock = threading.Lock()
        self._q: queue.Queue | None = None
        self._threads: list[threading.Thread] = []
        if threads:
            self._q = queue.Queue(maxsize=max_queue)
            for k in range(threads):
                th = threading.Thread(target=self._loop, name=f"eyas-dump-writer-{k}", daemon=True)
                th.start()
                self._threads.append(th)

    def submit(self, samples: Sequence[CompletedSample]) -> None:
        for s in samples:
            if self._q is None:
                self._write(s)
            else:
                self._q.put(s)

    def flush(self) -> None:
        if self._q is not None:
            self._q.join()

    def close(self) -> None:
        """Flush, then end the writer threads (a closed writer writes on the caller's thread)."""
        q, self._q = self._q, None
        if q is None:
            return
        q.join()
        for _ in self._threads:
            q.put(None)
        for th in self._threads:
            th.join()
        self._threads = []

    def _write(self, s: CompletedSample) -> None:
        try:
            write_dump(self.dump_dir, s, layer_ids=self.layer_ids, writer=self.writer)
            with self._count_lock:
                self.written += 1
        except Exception as exc:  # a full /dev/shm must not take the server down
            with self._count_lock:
                self.errors.append(f"{s.rid}: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        assert self._q is not None
        q = self._q
        while True:
            s = q.get()
            try:
                if s is None:
                    return
                self._write(s)
            finally:
                q.task_done()


def plugin_status(
    *,
    layer_ids: Sequence[int],
    dump_dir: str | Path,
    sglang_version: str | None,
    plugin_version: str,
    model: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the plugin reports in `/server_info` (internal_states[i]["eyas_capture"])."""
    return {
        "schema": STATUS_SCHEMA,
        "plugin_version": plugin_version,
        "sglang_version": sglang_version,
        "layer_ids": list(map(int, layer_ids)),
        "convention": CONVENTION,
        "sglang_layer_ids": sglang_layer_ids(layer_ids),
        "dump_dir": str(dump_dir),
        "model": model or {},
        **(extra or {}),
    }
