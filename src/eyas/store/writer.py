"""StoreWriter: append samples to a store in atomically committed shards; resume after a crash.

Any producer of hidden states uses it: `eyas capture` (the transformers backend) and ingesters of
other engines' dumps. The contract:

- `StoreWriter(path, spec)` creates the store, or reopens an existing one written with the same
  spec (target, tokenizer, prepared dataset, layers, dtype) and resumes it; anything else is an
  EyasError naming the field that differs. On reopen, leftovers of a killed run (a `.shard-*.tmp`,
  or a renamed shard the manifest never listed) are deleted: their samples were never committed.
- `writer.committed_ids` is the set of sample ids already in committed shards: skip them.
- `add(sample_id, aux_TAD, final_TD)` (any float dtype, any device), `add_stacked(sample_id,
  hidden_TLD)` (the same states stacked as stored: no copy when already in the stored dtype) or the
  fast `add_packed(ids, lengths, hidden_NLD, scale_NL)` (rows already in the stored dtype, on the CPU).
  `encode(sample_id, hidden_TLD)` does add_stacked's conversion and checksum on any thread, so that
  the one thread that adds (`add_encoded`) only writes.
  Rows stream into the open shard's temporary file; once it holds >= shard_bytes it is committed:
  header written, fsync, rename to `shard-NNNNN.safetensors`, directory fsync, then the manifest is
  rewritten atomically. A sample never spans two shards.
- `close(complete=True)` commits the last shard and marks the store complete.
- `hold_commits` (a future: a check the samples depend on, still running) keeps every shard open until it ends
  well; rows keep going to disk meanwhile. If it fails, the open shard is dropped and its error raised, and
  `discard()` removes a store the writer created.

A failed write (a full disk) deletes the open temporary shard and raises EyasError: the store stays
valid up to its last committed shard and the same command resumes it. Writeback of each batch is
started at once (posix_fadvise DONTNEED), so the fsync at commit waits only for the last batch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.common import atomic_write_bytes, disk_margin, fsync_dir, human_bytes, log
from eyas.errors import EyasError
from eyas.store.format import (
    CHECKSUM,
    HEADER_BYTES,
    MANIFEST,
    SCHEMA,
    bytes_per_token,
    encode_rows,
    manifest_fields_sha256,
    shard_header,
    stored_dtype,
)

WRITE_CHUNK = 64 << 20  # bytes per write() call; writeback is started after each
SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
TMP_RE = re.compile(r"^\.shard-\d{5,}\.safetensors\..*\.tmp$")

# Fields of the spec that must be equal for a store to be resumed (value -> what it protects).
_RESUME_KEYS = (
    "target",
    "tokenizer_hash",
    "prepared",
    "aux_layer_ids",
    "convention",
    "dtype",
    "hidden_size",
    "model_dtype",
)


@dataclass(kw_only=True)
class StoreSpec:
    """What a store holds; written into its manifest and checked when a store is resumed."""

    aux_layer_ids: list[int]
    """Aux layer ids in `convention`; stored in this order as slots 0..A-1."""
    hidden_size: int
    """D, the target's hidden size."""
    dtype: str = "bf16"
    """Stored dtype: bf16, fp8 (e4m3, a scale per token and slot) or fp32."""
    convention: str = "hf-input"
    """Layer-id convention of aux_layer_ids (hf-input: id i = input to decoder layer i)."""
    target: dict[str, Any] | None = None
    """Target identity (eyas.target.model_identity): path, config and weights-index hashes."""
    tokenizer_hash: str | None = None
    """eyas.target.tokenizer_hash of the target's tokenizer."""
    prepared: dict[str, Any] | None = None
    """The prepared dataset captured: {path, split, fingerprint, limit, samples}."""
    model_dtype: str | None = None
    """The dtype the target ran in (bf16, fp32); the numbers check recomputes in it."""
    producer: dict[str, Any] = field(default_factory=dict)
    """Free-form: backend, device, versions (not checked on resume)."""

    def __post_init__(self):
        stored_dtype(self.dtype)
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids: empty; a store needs at least one aux layer")
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size: {self.hidden_size} must be positive")

    @property
    def slots(self) -> int:
        return len(self.aux_layer_ids) + 1

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.dtype, slots=self.slots, hidden_size=self.hidden_size)


_NOT_IDENTITY = ("path", "limit", "samples")


def _identity(value):
    # A moved model or dataset directory is the same artifact: compare hashes, not paths; a larger
    # --limit extends the same capture.
    return {k: v for k, v in value.items() if k not in _NOT_IDENTITY} if isinstance(value, dict) else value


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def manifest_bytes(manifest: dict[str, Any], lines: dict[str, list[str]] | None = None) -> bytes:
    """JSON with one line per sample and per shard: readable, and cheap to rewrite per commit.

    `lines` may hold the already-serialised lines of "shards" and "samples" (the writer keeps them,
    so a commit to a store of 100K samples joins strings instead of re-encoding every record).
    """
    head = {k: v for k, v in manifest.items() if k not in ("samples", "shards")}
    body = json.dumps(head, indent=2, sort_keys=True)[:-2]
    parts = [body + ","]
    for key in ("shards", "samples"):
        rows = lines[key] if lines is not None else [json.dumps(r, sort_keys=True) for r in manifest.get(key, [])]
        inner = ",\n    ".join(rows)
        parts.append(f'  "{key}": [\n    {inner}\n  ],' if rows else f'  "{key}": [],')
    parts[-1] = parts[-1][:-1]
    return ("\n".join(parts) + "\n}\n").encode()


def check_free_space(path: Path, need_bytes: int, *, what: str) -> dict[str, int]:
    """Refuse with the figures when the file system holding `path` has less than need + a margin that
    scales with the job (common.disk_margin: 5%, at least 1 MiB, at most 1 GiB)."""
    probe = path if path.exists() else path.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    margin = disk_margin(need_bytes)
    if need_bytes + margin > free:
        raise EyasError(
            f"not enough disk space for {what} at {path}: needs about {human_bytes(need_bytes)} "
            f"(+{human_bytes(margin)} margin) but {human_bytes(free)} is free on {probe}; free space, "
            "choose another --out, or store fp8 (--store-dtype fp8, about half the bytes)"
        )
    return {"need_bytes": need_bytes, "free_bytes": free}


def _write_all(f, data) -> None:
    """One place for data writes (tests inject a full disk here)."""
    f.write(data)


@dataclass(frozen=True)
class EncodedSample:
    """One sample's rows in the stored dtype with their checksum (`StoreWriter.encode`)."""

    id: str
    rows: torch.Tensor
    """[T, A+1, D] in the stored dtype, contiguous, on the CPU."""
    scale: torch.Tensor | None
    digest: str

    def spool(self, path: str | Path) -> SpooledSample:
        """Write the rows, then the scales, to `path` (another process hands the sample over this way: through
        a pipe, the receiver would take its GIL back once per pipe buffer, milliseconds each while it is busy)."""
        with open(path, "wb") as f:
            for part in _bytes_of(self.rows, self.scale):
                if part is not None:
                    f.write(part)
        return SpooledSample(
            self.id,
            str(path),
            tuple(self.rows.shape),
            str(self.rows.dtype).removeprefix("torch."),
            None if self.scale is None else tuple(self.scale.shape),
            self.digest,
        )


@dataclass(frozen=True)
class SpooledSample:
    """An EncodedSample waiting in a file (`EncodedSample.spool`); `load` reads it back with readinto, no copy."""

    id: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    """The rows' torch dtype, by name."""
    scale_shape: tuple[int, ...] | None
    digest: str

    def load(self) -> EncodedSample:
        rows = torch.empty(self.shape, dtype=getattr(torch, self.dtype))
        scale = None if self.scale_shape is None else torch.empty(self.scale_shape, dtype=torch.float32)
        with open(self.path, "rb", buffering=0) as f:
            for part in _bytes_of(rows, scale):
                view, n = memoryview(part) if part is not None else memoryview(b""), 0
                while n < len(view):
                    got = f.readinto(view[n:])
                    if not got:
                        raise EOFError(f"{self.path}: {n} of {len(view)} bytes of sample {self.id}")
                    n += got
        return EncodedSample(self.id, rows, scale, self.digest)


@dataclass(frozen=True)
class SampleEncoder:
    """`StoreWriter.encode` by a store's spec alone: picklable, so other processes can encode for the writer."""

    spec: StoreSpec

    def __call__(self, sample_id: str, hidden_TLD: torch.Tensor) -> EncodedSample:
        want = (self.spec.slots, self.spec.hidden_size)
        if hidden_TLD.ndim != 3 or tuple(hidden_TLD.shape[1:]) != want:
            raise ValueError(
                f"sample {sample_id}: hidden has shape {tuple(hidden_TLD.shape)}, expected [T, {want[0]}, {want[1]}]"
            )
        rows, scale = encode_rows(hidden_TLD, self.spec.dtype)
        rows, scale = rows.cpu(), None if scale is None else scale.cpu()
        return EncodedSample(str(sample_id), rows, scale, _sample_digest(*_bytes_of(rows, scale)))


def _bytes_of(hidden: torch.Tensor, scale: torch.Tensor | None):
    """The bytes of contiguous CPU rows (and scales) as flat uint8 arrays, without a copy."""
    hidden_u8 = hidden.view(torch.uint8).reshape(-1).numpy()
    return hidden_u8, (scale.view(torch.uint8).reshape(-1).numpy() if scale is not None else None)


def _starts(lengths: Sequence[int]) -> list[int]:
    """Each sample's first row among packed rows, then the total."""
    starts = [0]
    for t in lengths:
        starts.append(starts[-1] + int(t))
    return starts


def _sample_digest(hidden_u8, scale_u8) -> str:
    h = hashlib.sha256(hidden_u8)
    if scale_u8 is not None:
        h.update(scale_u8)
    return h.hexdigest()


def _remove_made(lock_path: Path | None, made: Sequence[Path]) -> None:
    """Remove a lock file and the directories (deepest first) a writer created, each only when it is empty."""
    if lock_path is not None:
        lock_path.unlink(missing_ok=True)
    for p in made:
        with contextlib.suppress(OSError):
            p.rmdir()


def committed_ids(path: str | Path) -> set[str]:
    """The ids of the samples a store at `path` has committed, read without opening it (none when there is no
    manifest, or one that cannot be read: StoreWriter says why when it opens the store)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        return {str(s["id"]) for s in manifest["samples"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _check_same_spec(path: Path, manifest: dict[str, Any], spec: dict[str, Any]) -> None:
    for key in _RESUME_KEYS:
        old, new = _identity(manifest.get(key)), _identity(spec[key])
        if isinstance(old, dict) and isinstance(new, dict):
            new = {k: v for k, v in new.items() if k in old}  # a field added since (a new hash) is not a change
        if old != new:
            raise EyasError(
                f"{path} was written with a different {key}: the store has {json.dumps(manifest.get(key))[:300]}, "
                f"this run has {json.dumps(spec[key])[:300]}; rerun with the store's settings, or choose another --out"
            )


class StoreWriter:
    """Append samples to a store at `path` in committed shards (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        spec: StoreSpec,
        *,
        shard_bytes: int = 1 << 30,
        hash_threads: int | None = None,
        hold_commits: concurrent.futures.Future | None = None,
    ):
        """`hold_commits`: a check the store's samples depend on, still running; see `_may_commit`."""
        self.write_chunk = WRITE_CHUNK  # bytes per write() call (tests: smaller, to cross rows)
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes: {shard_bytes} must be positive")
        self.path = Path(path)
        self.spec = spec
        self.shard_bytes = shard_bytes
        self._sd = stored_dtype(spec.dtype)
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / ".lock"
        new_lock = not lock_path.exists()
        new_store = not (self.path / MANIFEST).exists()
        self._lock = open(lock_path, "a+")  # noqa: SIM115 (the lock, held while the writer lives)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise EyasError(
                f"{self.path}: another process is writing this store (lock held on .lock); wait for it or choose another --out"
            ) from None
        try:
            self.manifest = self._open_or_create()
        except BaseException:
            self._lock.close()  # releases the lock: the store was not touched
            if new_lock:  # a refused directory keeps nothing of this attempt
                _remove_made(lock_path, made)
            raise
        self._made = (lock_path if new_lock else None, made) if new_store else None
        self.hold_commits = hold_commits
        self._ids: set[str] = {s["id"] for s in self.manifest["samples"]}
        self._lines = {k: [json.dumps(r, sort_keys=True) for r in self.manifest[k]] for k in ("shards", "samples")}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=hash_threads or min(8, os.cpu_count() or 1))
        self._file = None  # the open temporary shard
        self._tmp_path: Path | None = None
        self._pending: list[dict[str, Any]] = []
        self._pending_scales: list[torch.Tensor] = []
        self._rows = 0
        self._closed = False
        self.seconds = {"write": 0.0, "commit": 0.0}
        """Wall seconds spent writing rows into the page cache and committing shards (fsync, manifest):
        `commit` near the whole ingest time means the disk, not eyas, sets the pace."""

    # -- opening -----------------------------------------------------------------------------

    def _open_or_create(self) -> dict[str, Any]:
        mpath = self.path / MANIFEST
        spec = asdict(self.spec)
        if not mpath.exists():
            stray = [p.name for p in self.path.iterdir() if p.name != ".lock" and not TMP_RE.match(p.name)]
            if stray:
                raise EyasError(
                    f"{self.path} exists and is not an eyas store (has {stray[:5]}, no {MANIFEST}); choose another --out"
                )
            self._remove_leftovers(set())
            manifest = {
                "schema": SCHEMA,
                "status": "in_progress",
                "created": _now(),
                "updated": _now(),
                "checksum": CHECKSUM,
                "slots": self.spec.slots,
                "bytes_per_token": self.spec.bytes_per_token,
                **spec,
                "shards": [],
                "samples": [],
            }
            manifest["fields_sha256"] = manifest_fields_sha256(manifest)
            atomic_write_bytes(mpath, manifest_bytes(manifest))
            return manifest
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EyasError(
                f"{mpath}: unreadable manifest ({exc}); the store cannot be resumed: remove {self.path} and capture again"
            ) from exc
        if manifest.get("schema") != SCHEMA:
            raise EyasError(f"{mpath}: schema {manifest.get('schema')!r}, expected {SCHEMA!r}")
        _check_same_spec(self.path, manifest, spec)
        committed = {s["name"] for s in manifest["shards"]}
        self._remove_leftovers(committed)
        for name in committed:
            if not (self.path / name).is_file():
                raise EyasError(
                    f"{self.path}: committed shard {name} is missing; the store is damaged: remove it and capture again"
                )
        if manifest.get("status") == "complete":
            manifest["status"] = "in_progress"  # reopened for appending; close(complete=True) sets it back
        manifest["target"], manifest["prepared"], manifest["producer"] = (
            spec["target"],
            spec["prepared"],
            spec["producer"],
        )
        return manifest

    def _remove_leftovers(self, committed: set[str]) -> None:
        for p in self.path.iterdir():
            m = SHARD_RE.match(p.name)
            if TMP_RE.match(p.name) or (m and p.name not in committed):
                log(
                    f"eyas: {self.path}: removing {p.name}, left by an interrupted run (its samples were never committed)"
                )
                p.unlink()

    # -- properties ----------------------------------------------------------------------------

    @property
    def committed_ids(self) -> set[str]:
        return {s["id"] for s in self.manifest["samples"]}

    @property
    def committed_samples(self) -> int:
        return len(self.manifest["samples"])

    @property
    def committed_bytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"])

    def set_field(self, key: str, value: Any) -> None:
        """Set a manifest field outside the spec (e.g. `engine_numerics`); written, with its checksum, at the
        next commit or close."""
        if key in ("samples", "shards", "status", "fields_sha256") or key in asdict(self.spec):
            raise ValueError(f"set_field: {key!r} is kept by the writer itself")
        self.manifest[key] = value

    # -- adding --------------------------------------------------------------------------------

    def add(self, sample_id: str, aux_TAD: torch.Tensor, final_TD: torch.Tensor) -> None:
        """Add one sample: aux states [T, A, D] (slots in aux_layer_ids order) and final [T, D]."""
        a, d = len(self.spec.aux_layer_ids), self.spec.hidden_size
        if aux_TAD.ndim != 3 or aux_TAD.shape[1:] != (a, d):
            raise ValueError(f"sample {sample_id}: aux has shape {tuple(aux_TAD.shape)}, expected [T, {a}, {d}]")
        if final_TD.shape != (aux_TAD.shape[0], d):
            raise ValueError(
                f"sample {sample_id}: final has shape {tuple(final_TD.shape)}, expected [{aux_TAD.shape[0]}, {d}]"
            )
        self.add_stacked(sample_id, torch.cat([aux_TAD, final_TD.unsqueeze(1).to(aux_TAD.dtype)], dim=1))

    def add_stacked(self, sample_id: str, hidden_TLD: torch.Tensor) -> None:
        """Add one sample whose states are already stacked as stored: [T, A+1, D], the aux slots in
        aux_layer_ids order, then the final state. Rows already in the stored dtype are not copied."""
        self.add_encoded(self.encode(sample_id, hidden_TLD))

    def encode(self, sample_id: str, hidden_TLD: torch.Tensor) -> EncodedSample:
        """`add_stacked`'s rows in the stored dtype and their checksum, for `add_encoded`. It reads only
        the spec, so many threads may encode at once while one thread adds (`SampleEncoder` does it in
        another process)."""
        return self.encoder()(sample_id, hidden_TLD)

    def encoder(self) -> SampleEncoder:
        """`encode` as a picklable callable, for other processes."""
        return SampleEncoder(self.spec)

    def add_encoded(self, sample: EncodedSample) -> None:
        """Add a sample `encode` made (by this writer's spec)."""
        ids, lengths = [sample.id], [sample.rows.shape[0]]
        self._check_packed(ids, lengths, lengths[0], sample.rows, sample.scale)
        self._write_packed(ids, _starts(lengths), _bytes_of(sample.rows, None)[0], sample.scale, [sample.digest])

    def add_packed(
        self, ids: Sequence[str], lengths: Sequence[int], hidden_NLD: torch.Tensor, scale_NL: torch.Tensor | None
    ) -> None:
        """Add samples whose rows lie back to back in `hidden_NLD` (stored dtype, CPU, contiguous).

        The tensors may be reused by the caller once this returns (the scales are copied).
        """
        n = sum(int(t) for t in lengths)
        self._check_packed(ids, lengths, n, hidden_NLD, scale_NL)
        hidden_u8, scale_u8 = _bytes_of(hidden_NLD, scale_NL)
        rb, sb = hidden_u8.size // n, (scale_u8.size // n if scale_u8 is not None else 0)
        starts = _starts(lengths)
        digests = [
            self._pool.submit(
                _sample_digest, hidden_u8[a * rb : b * rb], scale_u8[a * sb : b * sb] if scale_u8 is not None else None
            )
            for a, b in zip(starts[:-1], starts[1:])
        ]
        self._write_packed(ids, starts, hidden_u8, scale_NL, digests)

    def _write_packed(self, ids, starts: list[int], hidden_u8, scale_NL, digests: list) -> None:
        """Write checked packed rows (their bytes `hidden_u8`, sample k at rows starts[k]..starts[k+1]) into the
        open shard; `digests` are checksums or futures of them."""
        try:
            if self._file is None:
                self._open_shard()
            n = starts[-1]
            t0 = time.perf_counter()
            for a in range(0, hidden_u8.size, self.write_chunk):
                # In chunks, each handed to writeback at once: the disk starts on a batch while the
                # rest of it is still being copied into the page cache.
                offset = self._file.tell()
                chunk = hidden_u8[a : a + self.write_chunk]
                _write_all(self._file, chunk)
                self._kick_writeback(offset, chunk.size)
            self.seconds["write"] += time.perf_counter() - t0
            for sid, a, b, fut in zip(ids, starts[:-1], starts[1:], digests):
                digest = fut.result() if isinstance(fut, concurrent.futures.Future) else fut
                self._pending.append({"id": str(sid), "tokens": b - a, "start": self._rows + a, CHECKSUM: digest})
                self._ids.add(str(sid))
            if scale_NL is not None:
                self._pending_scales.append(scale_NL.clone())
            self._rows += n
            if self._rows * (hidden_u8.size // n) >= self.shard_bytes and self._may_commit(wait=False):
                self.commit()
        except OSError as exc:
            self._abort_shard()
            self._ids = self.committed_ids
            raise self._write_error(exc) from exc

    def _check_packed(self, ids, lengths, n, hidden_NLD, scale_NL) -> None:
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        if len(ids) != len(lengths) or not ids:
            raise ValueError(f"add_packed: {len(ids)} ids but {len(lengths)} lengths")
        want = (n, self.spec.slots, self.spec.hidden_size)
        if tuple(hidden_NLD.shape) != want or hidden_NLD.dtype != self._sd.torch_dtype:
            raise ValueError(
                f"add_packed: hidden is {tuple(hidden_NLD.shape)} {hidden_NLD.dtype}, expected {list(want)} {self._sd.torch_dtype}"
            )
        if hidden_NLD.device.type != "cpu" or not hidden_NLD.is_contiguous():
            raise ValueError("add_packed: hidden must be a contiguous CPU tensor")
        if self._sd.scaled != (scale_NL is not None) or (scale_NL is not None and tuple(scale_NL.shape) != want[:2]):
            raise ValueError(
                f"add_packed: dtype {self.spec.dtype} needs {'a scale [N, L]' if self._sd.scaled else 'no scale'}"
            )
        if min(int(t) for t in lengths) <= 0:
            raise ValueError(f"add_packed: empty sample among {list(ids)[:5]}")
        for sid in ids:
            if str(sid) in self._ids:
                raise ValueError(f"sample `{sid}` was already added to {self.path}; a sample is stored exactly once")
        if len(set(map(str, ids))) != len(ids):
            raise ValueError("add_packed: repeated ids in one call")

    # -- shards --------------------------------------------------------------------------------

    def _shard_name(self) -> str:
        return f"shard-{len(self.manifest['shards']):05d}.safetensors"

    def _open_shard(self) -> None:
        name = self._shard_name()
        self._tmp_path = self.path / f".{name}.{os.getpid()}.tmp"
        self._file = open(self._tmp_path, "wb")  # noqa: SIM115 (the shard, closed at commit or abort)
        _write_all(self._file, b"\0" * HEADER_BYTES)  # the header is written at commit, when N is known
        self._rows = 0

    def _kick_writeback(self, offset: int, length: int) -> None:
        # Start writing these pages to disk now (Linux: fadvise DONTNEED starts async writeback and
        # drops clean pages), so the fsync at commit waits for one batch rather than a whole shard.
        if hasattr(os, "posix_fadvise"):
            self._file.flush()
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._file.fileno(), offset, length, os.POSIX_FADV_DONTNEED)

    def _may_commit(self, *, wait: bool) -> bool:
        """Whether the open shard may be committed: only once `hold_commits` has ended well. Until then (`wait`
        False) the shard grows past shard_bytes, so that rows keep going to disk; a check that failed drops the
        open shard (none of its samples is stored) and raises its error."""
        hold = self.hold_commits
        if hold is None:
            return True
        if not wait and not hold.done():
            return False
        try:
            hold.result()
        except BaseException:
            self._abort_shard()
            self._ids = self.committed_ids
            raise
        self.hold_commits = None
        return True

    def commit(self) -> None:
        """Commit the open shard (no-op when nothing is pending); waits for `hold_commits`."""
        if self._file is None or not self._pending:
            return
        self._may_commit(wait=True)
        t0 = time.perf_counter()
        try:
            f = self._file
            if self._pending_scales:
                _write_all(f, torch.cat(self._pending_scales).view(torch.uint8).reshape(-1).numpy())
            size = f.tell()
            f.seek(0)
            f.write(
                shard_header(
                    rows=self._rows, slots=self.spec.slots, hidden_size=self.spec.hidden_size, dtype=self.spec.dtype
                )
            )
            f.flush()
            os.fsync(f.fileno())
            f.close()
            self._file = None
            name = self._shard_name()
            os.replace(self._tmp_path, self.path / name)
            fsync_dir(self.path)
        except OSError as exc:
            self._abort_shard()
            self._ids = self.committed_ids
            raise self._write_error(exc) from exc
        index = len(self.manifest["shards"])
        for rec in self._pending:
            rec["shard"] = index
        shard = {"name": name, "bytes": size, "rows": self._rows, "samples": len(self._pending)}
        self.manifest["shards"].append(shard)
        self.manifest["samples"].extend(self._pending)
        self._lines["shards"].append(json.dumps(shard, sort_keys=True))
        self._lines["samples"].extend(json.dumps(r, sort_keys=True) for r in self._pending)
        self._pending, self._pending_scales, self._rows = [], [], 0
        self._write_manifest()
        self.seconds["commit"] += time.perf_counter() - t0

    def _write_manifest(self) -> None:
        self.manifest["updated"] = _now()
        shards = self.manifest["shards"]
        self.manifest["totals"] = {
            "samples": len(self.manifest["samples"]),
            "tokens": sum(s["rows"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": len(shards),
        }
        self.manifest["fields_sha256"] = manifest_fields_sha256(self.manifest)
        atomic_write_bytes(self.path / MANIFEST, manifest_bytes(self.manifest, self._lines))

    def _abort_shard(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._tmp_path.unlink()
        self._pending, self._pending_scales, self._rows = [], [], 0

    def _write_error(self, exc: OSError) -> EyasError:
        what = "the disk is full" if exc.errno == errno.ENOSPC else f"a write failed ({exc})"
        return EyasError(
            f"{self.path}: {what}; the open shard was discarded and the store is valid up to its last committed "
            f"shard ({self.committed_samples} samples, {human_bytes(self.committed_bytes)}); free space and rerun "
            "the same command to resume"
        )

    # -- absorbing another store (data-parallel capture) ---------------------------------------

    def absorb(self, src: str | Path) -> int:
        """Move the committed shards of the store at `src` (written with the same spec) into this one,
        then delete `src`; returns the samples added. Used to fold a data-parallel rank's own store
        into the shared one.

        Crash-safe and idempotent, in this order per shard: hard-link (or copy) the shard under this
        store's next name, fsync, rewrite this manifest listing it; `src` is deleted only after all
        its shards are listed. A crash before a manifest rewrite leaves an unlisted shard, removed
        as a leftover on the next open, while `src` still holds it; a crash after leaves shards whose
        samples are all listed already, which the next absorb skips. Never a sample twice.
        """
        src = Path(src)
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        lock_path = src / ".lock"
        lock = open(lock_path, "a+") if src.is_dir() else None  # noqa: SIM115 (the lock, held until the fold ends)
        try:
            if lock is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise EyasError(
                        f"{src}: a capture process is still writing it (lock held on .lock); wait for it to end, then rerun"
                    ) from None
            added = self._absorb_locked(src)
        finally:
            if lock is not None:
                lock.close()
        shutil.rmtree(src, ignore_errors=True)
        return added

    def _absorb_locked(self, src: Path) -> int:
        mpath = src / MANIFEST
        if not mpath.is_file():
            return 0  # created but nothing committed: only a lock or a temporary shard, nothing to keep
        try:
            sub = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EyasError(f"{mpath}: unreadable manifest ({exc}); remove {src} to recapture its samples") from exc
        _check_same_spec(src, sub, asdict(self.spec))
        self.commit()  # the open shard, if any, first: absorbed shards are whole files
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for rec in sub["samples"]:
            by_shard.setdefault(int(rec["shard"]), []).append(rec)
        added = 0
        for index, shard in enumerate(sub["shards"]):
            recs = by_shard.get(index, [])
            present = [r["id"] for r in recs if r["id"] in self._ids]
            if recs and len(present) == len(recs):
                continue  # absorbed before a crash that kept `src`
            if present:
                raise EyasError(
                    f"{src}/{shard['name']}: samples {present[:3]} are already in {self.path} but others of "
                    "the shard are not; the stores overlap: remove one of them and capture again"
                )
            path = src / shard["name"]
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                raise EyasError(
                    f"{path}: missing or not {shard['bytes']} bytes as its manifest says; remove {src} to recapture its samples"
                )
            name = self._shard_name()
            dest = self.path / name
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()  # an unlisted leftover of this very step
            try:
                os.link(path, dest)  # same file system: no bytes move
            except OSError:
                shutil.copyfile(path, dest)
                with open(dest, "rb+") as f:
                    os.fsync(f.fileno())
            fsync_dir(self.path)
            new_index = len(self.manifest["shards"])
            moved = [{**r, "shard": new_index} for r in recs]
            record = {**shard, "name": name}
            self.manifest["shards"].append(record)
            self.manifest["samples"].extend(moved)
            self._lines["shards"].append(json.dumps(record, sort_keys=True))
            self._lines["samples"].extend(json.dumps(r, sort_keys=True) for r in moved)
            self._ids.update(r["id"] for r in recs)
            self._write_manifest()
            added += len(recs)
        return added

    # -- closing -------------------------------------------------------------------------------

    def close(self, *, complete: bool = False) -> dict[str, Any]:
        """Commit what is pending; with complete=True mark the store complete. Returns the manifest."""
        if self._closed:
            return self.manifest
        try:
            self._may_commit(wait=True)  # a failed check fails the close, with nothing pending too
            self.commit()
            if complete:
                self.manifest["status"] = "complete"
            self._write_manifest()
        finally:
            self.abort()
        return self.manifest

    def discard(self) -> None:
        """`abort`, then remove what this writer created when it opened a new store and committed nothing to it (a
        capture refused after the store opened leaves nothing of itself); a store it only reopened is kept."""
        made = self._made if not self.manifest["shards"] else None
        self.abort()
        if made is not None:
            (self.path / MANIFEST).unlink(missing_ok=True)
            _remove_made(*made)

    def abort(self) -> None:
        """Drop the uncommitted shard and release the store (committed shards stay valid)."""
        if self._closed:
            return
        self._abort_shard()
        self._pool.shutdown(wait=True)
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
