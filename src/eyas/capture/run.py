"""`eyas capture`, the transformers backend: prepared samples -> target forward -> verified store.

Steps, in the order a reader of the log sees them:
  1. settings: target identity, tokenizer hash (must equal the prepared dataset's), layer ids checked
     against the target's layer count, the samples to capture (`limit` = the first n of the split);
  2. open the store: create it, or resume it when it was written with the same settings (else an
     error naming what differs); committed samples are skipped;
  3. disk: estimate the bytes still needed and refuse with the figures when the disk lacks room;
  4. capture: batches by length under the token budget through CapturePipeline;
  5. before marking the store complete, check the prepared dataset has not changed meanwhile.

Data parallel: `torchrun --nproc_per_node N -m eyas capture --device cuda ...` runs one process per
GPU (gloo between processes on CPU, for tests). The samples still to capture are split into N
disjoint parts balanced by tokens (longest first, each to the lightest part); each process writes
its part into a store of its own under <out>/.ranks/, and rank 0 folds those into <out> at the end
(see `_run_capture_dp`). The trade-off: one more rename-and-manifest step at the end, in exchange
for processes that never coordinate while capturing and a crash that loses at most each process's
open shard; a rerun with any number of processes keeps every committed shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.capture.batching import make_batch, plan_batches
from eyas.capture.pipeline import CapturePipeline
from eyas.common import check_out_path, human_bytes, is_owned, log, progress, require_owned, write_marker
from eyas.config_checks import check_device, check_number
from eyas.dtypes import to_dtype
from eyas.errors import EyasError
from eyas.store.format import HEADER_BYTES, stored_dtype
from eyas.store.writer import StoreSpec, StoreWriter, check_free_space

_DEVICE_OK = re.compile(r"^(cpu|cuda(:\d+)?)$").match

MODEL_DTYPES = ("bf16", "fp32")  # names in eyas.dtypes; the store records the short one


@dataclass(kw_only=True)
class CaptureSettings:
    """Everything `eyas capture` takes (the CLI's options are these fields plus the sglang backend's)."""

    target: str | None = None
    """Target: a local Hugging Face model directory, or `default` (SmolLM2-135M-Instruct). transformers
    backend: None means `default`; sglang backend: the server's model directory when it exists here
    (needed for `eyas verify` numbers)."""
    data: Path
    """Prepared dataset directory (from `eyas prepare`)."""
    split: str = "train"
    """Split of the prepared dataset to capture."""
    out: Path
    """Store directory; rerunning with the same settings resumes it."""
    aux_layers: list[int] | None = field(default=None, metadata={"parse": "eyas.capture.run:parse_layers"})
    """Aux layer ids, comma-separated, convention hf-input (id i = input to decoder layer i); default =
    EAGLE-3's 2,N//2,N-3 (sglang: the server's)."""
    store_dtype: str = "bf16"
    """Dtype the hidden states are stored in: bf16, fp8 (e4m3, a scale per token and layer; half the bytes) or fp32."""
    device: str = "cpu"
    """Where the target runs (sglang: the reference of --sglang-calibrate): cpu, cuda or cuda:K."""
    model_dtype: str = "auto"
    """transformers: dtype the target runs in: bf16, fp32, or auto (bf16 on CUDA, fp32 on CPU)."""
    token_budget: int = 16384
    """transformers: most tokens per forward (batch size x padded length); longer samples run alone."""
    shard_bytes: int = field(default=1 << 30, metadata={"parse": "eyas.capture.run:parse_bytes"})
    """transformers: commit a shard once it holds this many bytes (e.g. 512MB, 2GiB)."""
    limit: int | None = None
    """Capture only the first N samples of the split."""
    queue_depth: int = 3
    """transformers: batches in flight between forward and disk (pinned buffers on CUDA)."""
    sglang_calibrate: int = 8
    """sglang: stored samples recomputed here with verify's reference (needs --target) to record the engine's
    numbers, from which `eyas verify` sets this store's limits; 0 skips it (verify then uses fixed limits)."""

    def __post_init__(self):
        stored_dtype(self.store_dtype)
        if self.model_dtype not in ("auto", *MODEL_DTYPES):  # checked before any model loads
            raise EyasError(f"--model-dtype: `{self.model_dtype}`; choose bf16, fp32 or auto")
        if self.token_budget <= 0:
            raise EyasError(f"--token-budget: {self.token_budget} must be positive")
        if self.shard_bytes <= 0:
            raise EyasError(f"--shard-bytes: {self.shard_bytes} must be positive")
        if self.limit is not None and self.limit <= 0:
            raise EyasError(f"--limit: {self.limit} must be positive")
        check_number(self, "queue_depth", ge=1)
        check_number(self, "sglang_calibrate", ge=0)
        if self.device == "auto" or not _DEVICE_OK(self.device):
            raise EyasError(f"--device: `{self.device}`; choose cpu or cuda[:K]")
        check_device(self.device)
        if self.aux_layers is not None and any(i < 0 for i in self.aux_layers):
            raise EyasError(f"--aux-layers: layer ids must be >= 0, got {self.aux_layers}")
        if not Path(self.data).is_dir():
            raise EyasError(f"--data {self.data} is not a directory; pass an `eyas prepare` output")
        check_out_path(self.out)
        if Path(self.out).is_dir() and not is_owned(self.out) and not (Path(self.out) / "manifest.json").is_file():
            require_owned(self.out)
        if Path(self.out).is_dir() and is_owned(self.out):
            require_owned(self.out, kind="store")  # another stage's eyas output is refused before anything is written

    @property
    def resolved_model_dtype(self) -> str:
        if self.model_dtype != "auto":
            return self.model_dtype
        return "bf16" if self.device.startswith("cuda") else "fp32"


def parse_layers(text: str | None) -> list[int] | None:
    if text is None or text.strip() in ("", "default"):
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EyasError(f"--aux-layers: `{text}` is not a comma-separated list of integers (e.g. 2,15,27)") from None


def parse_bytes(text: str | int) -> int:
    """'1GB', '512MiB', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise EyasError(f"--shard-bytes: `{text}` is not a size such as 1GB, 512MiB or 1000000")
    return int(value * units[unit])


def store_spec_for(settings: CaptureSettings) -> tuple[StoreSpec, Any, dict[str, Any]]:
    """Resolve the target and dataset into the store's spec. Returns (spec, prepared split, context)."""
    from transformers import AutoConfig

    from eyas.data.prepared import PreparedDataset
    from eyas.defaults import resolve_target
    from eyas.drafter.layouts import check_layer_ids, default_aux_layer_ids
    from eyas.target import (
        CONVENTION,
        hidden_size_of,
        load_tokenizer,
        model_identity,
        num_layers_of,
        tokenizer_hash,
    )

    target_dir = resolve_target(settings.target or "default")
    config = AutoConfig.from_pretrained(target_dir)
    n_layers, d = num_layers_of(config), hidden_size_of(config)
    layers = (
        check_layer_ids(settings.aux_layers, n_layers, what="--aux-layers")
        if settings.aux_layers is not None
        else default_aux_layer_ids(n_layers)
    )
    if len(set(layers)) != len(layers):
        log(f"eyas capture: aux layers {layers} repeat an id (a small target); each slot is stored as asked")
    tok = load_tokenizer(target_dir)
    tok_hash = tokenizer_hash(tok)
    prepared = PreparedDataset(settings.data)
    if prepared.tokenizer_hash is not None and prepared.tokenizer_hash != tok_hash:
        raise EyasError(
            f"--data {settings.data} was tokenised with another tokenizer (hash {prepared.tokenizer_hash[:12]}) than "
            f"the target {target_dir} (hash {tok_hash[:12]}); prepare the data with this target's tokenizer"
        )
    split = prepared.split(settings.split)
    n = len(split) if settings.limit is None else min(settings.limit, len(split))
    spec = StoreSpec(
        aux_layer_ids=layers,
        hidden_size=d,
        dtype=settings.store_dtype,
        convention=CONVENTION,
        target=model_identity(target_dir),
        tokenizer_hash=tok_hash,
        prepared={
            "path": str(Path(settings.data).resolve()),
            "split": settings.split,
            "fingerprint": split.fingerprint,
            "limit": settings.limit,
            "samples": n,
        },
        model_dtype=settings.resolved_model_dtype,
        producer={
            "backend": "transformers",
            "device": settings.device,
            "num_layers": n_layers,
            "torch": torch.__version__,
        },
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return spec, split, {"target_dir": target_dir, "num_layers": n_layers, "pad_token_id": pad, "n": n}


def run_capture(settings: CaptureSettings) -> dict[str, Any]:
    """Capture (or resume) a store; returns the summary the CLI prints. Under torchrun (WORLD_SIZE > 1)
    the processes split the samples and write one store together (see _run_capture_dp)."""
    from eyas.locks import hold

    hold(settings.out)  # (under torchrun rank 0 holds it for the job; the store writer locks its folder too)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_capture_dp(settings)
    spec, split, ctx = store_spec_for(settings)
    n = ctx["n"]
    lengths = [int(x) for x in split.lengths[:n]]
    writer = StoreWriter(settings.out, spec, shard_bytes=settings.shard_bytes)
    write_marker(settings.out, kind="store")  # after the writer: it refuses a new store dir holding any file
    try:
        fold_rank_stores(writer)  # the committed work of an interrupted data-parallel run is kept
        done = writer.committed_ids
        todo = [i for i in range(n) if split.ids[i] not in done]
        todo_tokens = sum(lengths[i] for i in todo)
        need = todo_tokens * spec.bytes_per_token + HEADER_BYTES * (
            1 + todo_tokens * spec.bytes_per_token // settings.shard_bytes
        )
        disk = check_free_space(
            Path(settings.out), need, what=f"{len(todo)} samples ({todo_tokens} tokens x {spec.bytes_per_token} bytes)"
        )
        log(
            f"eyas capture: {ctx['target_dir']} ({ctx['num_layers']} layers, D={spec.hidden_size}, {spec.model_dtype}) on "
            f"{settings.device}; aux layers {spec.aux_layer_ids} ({spec.convention}) + final; {settings.split}: {n} samples, "
            f"{len(done)} already stored, {len(todo)} to capture ({todo_tokens} tokens, about {human_bytes(need)} as {spec.dtype}, "
            f"{human_bytes(disk['free_bytes'])} free)"
        )
        stats = _capture_samples(settings, spec, split, ctx, todo, lengths, writer) if todo else None
        _check_prepared_unchanged(settings, spec)
        writer.commit()
        stored = writer.committed_ids
        missing = [split.ids[i] for i in range(n) if split.ids[i] not in stored]
        if missing:
            raise EyasError(f"internal: {len(missing)} samples were not stored (e.g. {missing[:3]}); rerun to resume")
        manifest = writer.close(complete=True)
    except BaseException:
        writer.abort()
        raise
    summary = _store_summary(
        settings,
        spec,
        manifest["totals"],
        status=manifest["status"],
        resumed=n - len(todo),
        todo=todo,
        tokens=todo_tokens,
    )
    if stats is not None:
        summary.update(
            {
                "seconds": round(stats.seconds, 3),
                "tokens_per_s": round(stats.rows / max(stats.seconds, 1e-9), 1),
                "batches": stats.batches,
                "padding_fraction": round(1 - stats.rows / max(stats.padded_tokens, 1), 4),
                "writer_busy_s": round(stats.writer_busy_s, 3),
                "waited_for_disk_s": round(stats.main_wait_s, 3),
            }
        )
    log("eyas capture: " + json.dumps({k: summary[k] for k in ("samples", "tokens", "shards", "bytes_per_token")}))
    return summary


def _capture_samples(
    settings: CaptureSettings,
    spec: StoreSpec,
    split,
    ctx: dict[str, Any],
    todo: list[int],
    lengths: list[int],
    writer: StoreWriter,
):
    """Load the target and capture samples `todo` (indices into the split) into `writer`."""
    from eyas.target import load_target

    model = load_target(
        ctx["target_dir"], device=settings.device, dtype=to_dtype(spec.model_dtype, what="--model-dtype")
    )
    plan = plan_batches([lengths[i] for i in todo], settings.token_budget)
    over = [todo[j] for b in plan for j in b if lengths[todo[j]] > settings.token_budget]
    if over:
        log(
            f"eyas capture: {len(over)} samples are longer than --token-budget {settings.token_budget}; each runs alone"
        )
    max_rows = max(sum(lengths[todo[j]] for j in b) for b in plan)
    pipe = CapturePipeline(
        model,
        layer_ids=spec.aux_layer_ids,
        dtype=spec.dtype,
        hidden_size=spec.hidden_size,
        max_rows=max_rows,
        queue_depth=settings.queue_depth,
    )

    def batches():
        for b in plan:
            idx = [todo[j] for j in b]
            yield make_batch(
                [split.ids[i] for i in idx], [split[i].input_ids for i in idx], pad_token_id=ctx["pad_token_id"]
            )

    bar = progress(sum(lengths[i] for i in todo), "capture", unit="tok")
    try:
        return pipe.run(batches(), writer, on_batch=lambda b: bar.update(b.rows))
    except BaseException:
        with contextlib.suppress(Exception):
            writer.close(complete=False)  # commit what was fully written: a resume skips it
        raise
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# data-parallel capture: `torchrun --nproc_per_node N -m eyas capture ...`
#
# Each process captures a disjoint part of the samples into its own store under
# <out>/.ranks/rank-KKKKK/ (same spec, its own lock, shards committed atomically as always); at the
# end rank 0 folds every rank's committed shards into <out> (StoreWriter.absorb: link, list in the
# manifest, then delete the rank store) and marks <out> complete. A run killed anywhere leaves
# committed shards in rank stores or in <out>; the next run (with any number of processes, or one)
# folds them first, so their samples are skipped and none is stored twice.

RANKS_DIR = ".ranks"


def rank_store_dir(out: Path, rank: int) -> Path:
    return Path(out) / RANKS_DIR / f"rank-{rank:05d}"


def fold_rank_stores(writer: StoreWriter) -> int:
    """Absorb every rank store left under the store into it; returns the samples added."""
    root = writer.path / RANKS_DIR
    if not root.is_dir():
        return 0
    added = 0
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("rank-")):
        added += writer.absorb(sub)
    if added:
        log(
            f"eyas capture: {writer.path}: kept {added} samples committed by the processes of an earlier data-parallel run"
        )
    with contextlib.suppress(OSError):
        root.rmdir()  # only when empty
    return added


def split_by_tokens(todo: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Deterministic balanced split of sample indices into `parts` bins by tokens: longest first, each
    to the bin with the fewest tokens so far (ties: lowest bin). Bins come back in index order."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(todo, key=lambda i: (-lengths[i], i)):
        k = min(range(parts), key=lambda b: (load[b], b))
        bins[k].append(i)
        load[k] += lengths[i]
    return [sorted(b) for b in bins]


def _run_capture_dp(settings: CaptureSettings) -> dict[str, Any]:
    import torch.distributed as tdist

    from eyas.train.dist import init_group, setup, teardown

    # gloo even on CUDA: the processes only exchange small objects (work list, reports), and a
    # rank that finishes its share hours before another must not hit NCCL's default timeout
    init_group("gloo", timeout=datetime.timedelta(days=7))
    d = None
    writer: StoreWriter | None = None  # rank 0's writer of the shared store
    try:
        d = setup(settings.device)
        spec, split, ctx = store_spec_for(settings)
        n = ctx["n"]
        lengths = [int(x) for x in split.lengths[:n]]

        # 1. rank 0 opens (creates or resumes) the store, keeps what any earlier run committed,
        #    checks the disk for the whole remainder, and tells everyone what is left.
        #    Rank 0 holds the store's lock until the end: no second job can write it meanwhile.
        todo, resumed, failure = None, 0, None
        if d.is_main:
            try:
                writer = StoreWriter(settings.out, spec, shard_bytes=settings.shard_bytes)
                write_marker(settings.out, kind="store")
                fold_rank_stores(writer)
                done = writer.committed_ids
                todo = [i for i in range(n) if split.ids[i] not in done]
                resumed = n - len(todo)
                todo_tokens = sum(lengths[i] for i in todo)
                need = todo_tokens * spec.bytes_per_token + HEADER_BYTES * (
                    d.world + todo_tokens * spec.bytes_per_token // settings.shard_bytes
                )
                check_free_space(
                    Path(settings.out),
                    need,
                    what=f"{len(todo)} samples ({todo_tokens} tokens x {spec.bytes_per_token} bytes)",
                )
                log(
                    f"eyas capture: {ctx['target_dir']} on {d.world} processes; {settings.split}: {n} samples, {resumed} "
                    f"already stored, {len(todo)} to capture ({todo_tokens} tokens, about {human_bytes(need)} as {spec.dtype})"
                )
            except BaseException as exc:
                failure = exc
        box = [todo, resumed, None if failure is None else str(failure)]
        tdist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        if box[2] is not None:
            raise EyasError(f"rank 0 could not open the store: {box[2]}")
        todo, resumed = box[0], box[1]

        # 2. every rank captures its share into its own store.
        mine = split_by_tokens(todo, lengths, d.world)[d.rank]
        local = dataclasses.replace(settings, device=str(d.device)) if d.device.type == "cuda" else settings
        stats, failure = None, None
        try:
            sub = StoreWriter(rank_store_dir(settings.out, d.rank), spec, shard_bytes=settings.shard_bytes)
            try:
                log(
                    f"eyas capture: rank {d.rank}/{d.world} on {d.device}: {len(mine)} of {len(todo)} samples "
                    f"({sum(lengths[i] for i in mine)} tokens) into {sub.path}"
                )
                if mine:
                    stats = _capture_samples(local, spec, split, ctx, mine, lengths, sub)
                sub.close(complete=False)
            except BaseException:
                sub.abort()
                raise
        except BaseException as exc:
            failure = exc
        report = {
            "rank": d.rank,
            "error": None if failure is None else f"{type(failure).__name__}: {failure}",
            "samples": len(mine),
            "tokens": 0 if stats is None else stats.rows,
            "seconds": 0.0 if stats is None else round(stats.seconds, 3),
            "padded_tokens": 0 if stats is None else stats.padded_tokens,
            "batches": 0 if stats is None else stats.batches,
        }
        reports: list[Any] = [None] * d.world
        tdist.all_gather_object(reports, report)  # also the barrier before the merge
        if failure is not None:
            raise failure
        failed = [r for r in reports if r["error"]]
        if failed:
            raise EyasError(
                f"capture failed on rank {failed[0]['rank']} ({failed[0]['error']}); the shards every rank "
                "committed are kept: rerun the same command to resume"
            )

        # 3. rank 0 folds the rank stores into the store and marks it complete.
        manifest, failure = None, None
        if d.is_main:
            try:
                fold_rank_stores(writer)
                _check_prepared_unchanged(settings, spec)
                stored = writer.committed_ids
                missing = [split.ids[i] for i in range(n) if split.ids[i] not in stored]
                if missing:
                    raise EyasError(
                        f"internal: {len(missing)} samples were not stored (e.g. {missing[:3]}); rerun to resume"
                    )
                writer.manifest["producer"]["processes"] = d.world
                manifest = writer.close(complete=True)
            except BaseException as exc:
                failure = exc
        box = [None if manifest is None else manifest["totals"], None if failure is None else str(failure)]
        tdist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        if box[1] is not None:
            raise EyasError(f"rank 0 could not complete the store: {box[1]}")
        totals = box[0]
        # Rank 0 may return from its broadcast before the others have received it; tearing gloo down
        # with data in flight aborts the process, so every rank first reaches this barrier.
        tdist.barrier()
    finally:
        if writer is not None:
            writer.abort()  # releases the store's lock (a no-op once closed); committed shards stay
        # the group is freed here, its gloo threads joined, not left to race the interpreter's exit
        teardown(d)
    summary = _dp_summary(settings, spec, totals, reports, resumed=resumed, todo=todo, lengths=lengths, world=d.world)
    if d.is_main:
        log(
            "eyas capture: "
            + json.dumps({k: summary[k] for k in ("samples", "tokens", "shards", "bytes_per_token", "processes")})
        )
    else:
        # under torchrun every rank runs the CLI; only rank 0's summary may reach stdout (two long JSON
        # lines written by two processes into one pipe can interleave)
        import os
        import sys

        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stdout silenced for the process's life)
    return summary


def _store_summary(
    settings: CaptureSettings,
    spec: StoreSpec,
    totals: dict[str, Any],
    *,
    status: str,
    resumed: int,
    todo: list[int],
    tokens: int,
) -> dict[str, Any]:
    """What every capture summary says: the store, its totals, and what this run added to it."""
    return {
        "store": str(Path(settings.out)),
        "status": status,
        "dtype": spec.dtype,
        "model_dtype": spec.model_dtype,
        "aux_layer_ids": spec.aux_layer_ids,
        "convention": spec.convention,
        "hidden_size": spec.hidden_size,
        "samples": totals["samples"],
        "tokens": totals["tokens"],
        "shards": totals["shards"],
        "bytes": totals["bytes"],
        "bytes_per_token": round(totals["bytes"] / max(totals["tokens"], 1), 2),
        "resumed_samples": resumed,
        "captured_samples": len(todo),
        "captured_tokens": tokens,
    }


def _dp_summary(
    settings: CaptureSettings,
    spec: StoreSpec,
    totals: dict[str, Any],
    reports: list[dict[str, Any]],
    *,
    resumed: int,
    todo: list[int],
    lengths: list[int],
    world: int,
) -> dict[str, Any]:
    """The summary of a data-parallel capture: the store's totals (rank 0's), what this run captured, and every
    rank's report."""
    rows = sum(r["tokens"] for r in reports)
    slowest = max(r["seconds"] for r in reports)
    summary = _store_summary(
        settings, spec, totals, status="complete", resumed=resumed, todo=todo, tokens=sum(lengths[i] for i in todo)
    )
    summary.update(
        processes=world, per_rank=[{k: r[k] for k in ("rank", "samples", "tokens", "seconds")} for r in reports]
    )
    if rows:
        padded = sum(r["padded_tokens"] for r in reports)
        # the slowest process bounds the wall time of the capture: aggregate rate = all tokens / its seconds
        summary.update(
            {
                "seconds": round(slowest, 3),
                "tokens_per_s": round(rows / max(slowest, 1e-9), 1),
                "batches": sum(r["batches"] for r in reports),
                "padding_fraction": round(1 - rows / max(padded, 1), 4),
            }
        )
    return summary


def _check_prepared_unchanged(settings: CaptureSettings, spec: StoreSpec) -> None:
    from eyas.data.prepared import PreparedDataset

    now = PreparedDataset(settings.data).meta["splits"].get(settings.split, {}).get("fingerprint")
    if now != spec.prepared["fingerprint"]:
        raise EyasError(
            f"--data {settings.data} changed while it was being captured (split {settings.split} fingerprint "
            f"{spec.prepared['fingerprint'][:12]} -> {str(now)[:12]}); the store keeps its committed shards but is "
            "not marked complete: capture into a new --out"
        )
