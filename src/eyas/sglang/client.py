"""Capture from running SGLang servers: preflight, send prompts, verify every dump, ingest.

The server side is the eyas plugin (plugin.py) writing one dump per request into a directory this
process can read (default /dev/shm/eyas-dumps on the server host). The client:

1. preflight, per URL (eyas.sglang.server): refuses a server that cannot capture, with the reason and
   the flags that fix it; then one probe request proves that dumps appear in the dump directory this
   process reads;
2. sends each sample (concurrency bounded per URL; several URLs = data parallel; eyas.sglang.sender,
   or eyas.sglang.workers with --sglang-procs) and checks every one of them (eyas.sglang.request);
3. ingests verified samples into the store (eyas.store.StoreWriter, the same store as the transformers
   backend), which opens beside the first requests; resumes from the store's committed ids; retries
   transient HTTP errors with exponential backoff; counts and lists rejected samples (a rerun of the same
   command retries them);
4. with a target, recomputes a few stored samples with verify's reference and records the engine's
   numerics in the store.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eyas.common import log, progress
from eyas.errors import EyasError
from eyas.sglang.apart import Apart
from eyas.sglang.core import CONVENTION, parse_rid, sglang_layer_ids
from eyas.sglang.request import Outcome, probe
from eyas.sglang.sender import StateBudget, Tally, default_memory_bytes, send_all, short_switch_interval
from eyas.sglang.server import ServerPlan, preflight
from eyas.sglang.workers import Workers, closed_on_error
from eyas.store.writer import SampleEncoder, StoreSpec, committed_ids

CACHE_BYPASS = ("auto", "plugin", "salt", "logprob", "none")
REJECTED_LISTED = 1000  # rejected samples listed in the summary (all are counted and logged on stderr)


def capture_from_sglang(
    urls: Sequence[str],
    prepared: str | Path,
    split: str,
    out_store: str | Path,
    layer_ids: Sequence[int] | None,
    *,
    target: str | Path | None = None,
    dump_dir: str | Path | None = None,
    concurrency: int = 16,
    cache_bypass: str = "auto",
    dtype: str = "bf16",
    limit: int | None = None,
    max_retries: int = 5,
    backoff_s: float = 1.0,
    request_timeout_s: float = 600.0,
    dump_wait_s: float = 60.0,
    mark_complete_with_rejections: bool = False,
    calibrate: int = 8,
    device: str = "cpu",
    memory_bytes: int | None = None,
    procs: int = 0,
) -> dict[str, Any]:
    """Capture `split` of a prepared dataset from SGLang servers into the store at `out_store`.

    `layer_ids` are eyas ids (hf-input); None = whatever the servers capture (they must agree).
    `target` (a local HF directory of the served model) records its identity in the store, which
    `eyas verify` needs for its numbers check; with it, `calibrate` stored samples are then recomputed
    with verify's reference on `device` and the engine's errors recorded in the manifest
    (`engine_numerics`, eyas.store.numerics), which set verify's limits for this store; a calibration
    that verify would refuse raises CheckFailed once the store is closed. `memory_bytes` bounds the states
    held (StateBudget; default: an eighth of this machine's memory). `procs`: see _capture_loop."""
    from eyas.data.prepared import PreparedDataset

    _check_capture_options(urls, concurrency, max_retries, dump_wait_s, request_timeout_s, memory_bytes, procs)
    t0 = time.time()
    setup = _Laps(t0)
    ds = PreparedDataset(prepared)
    sp = ds.split(split)
    n_total = len(sp) if limit is None else min(limit, len(sp))
    setup.lap("data")
    job = _job_tag(Path(out_store), split)
    run = os.urandom(3).hex()  # rids differ between runs: a rerun never meets a server's memory of an earlier one
    plans, layer_ids, probes = _reach_servers(
        urls,
        layer_ids,
        sp[0].input_ids if n_total else torch.arange(100, 116),
        job=job,
        laps=setup,
        cache_bypass=cache_bypass,
        dump_dir=dump_dir,
        probe_kw={"dump_wait_s": dump_wait_s, "max_retries": max_retries, "backoff_s": backoff_s},
    )
    budget = StateBudget(memory_bytes if memory_bytes is not None else default_memory_bytes())
    row_bytes = probes[0].hidden_LSD[0].nbytes  # one token's states as the servers send them
    todo = _samples_to_capture(sp, n_total, Path(out_store), plans, layer_ids)
    # the workers' imports and the first samples pass beside the store's opening; a failure before the loop ends them
    workers = Workers.start(procs, concurrency, len(plans), budget, row_bytes, sp.lengths)
    apart = Apart()  # the transformers work (the target may be the served model's, known once the store opens)
    engine = {"backend": "sglang", "sglang_version": plans[0].version, "server_dtype": probes[0].dump_dtype}
    calibration_kw = {"calibrate": calibrate, "device": device, "engine": engine}
    with closed_on_error(workers, apart):
        store = _OpeningStore(
            Path(out_store),
            ds,
            plans,
            probes,
            split=split,
            layer_ids=layer_ids,
            dtype=dtype,
            target=target,
            limit=limit,
            sending={sp.ids[i] for i in todo},
            calibration=calibration_kw,
            apart=apart,
        )
    bar = progress(sum(int(sp.lengths[i]) for i in todo), "capture (sglang)", unit="tok")
    ok = False
    loop_t0, loop_cpu0 = time.time(), time.process_time()
    tally = Tally(retries=sum(p.retries for p in probes), t0=loop_t0)  # its timeline counts the loop's seconds
    phases = {"setup": loop_t0 - t0}
    intra_op = torch.get_num_threads()
    try:
        _capture_loop(
            plans,
            sp,
            todo,
            store,
            tally,
            bar,
            encode=store.encode,
            concurrency=concurrency,
            budget=budget,
            row_bytes=row_bytes,
            rid_tag=f"{job}-{run}",
            layer_ids=layer_ids,
            max_retries=max_retries,
            backoff_s=backoff_s,
            request_timeout_s=request_timeout_s,
            dump_wait_s=dump_wait_s,
            workers=workers,
        )
        writer, target = store.result()  # opened, or the reason it could not be (when no sample reached it)
        loop_s = time.time() - loop_t0
        phases["loop"], phases["loop_cpu"] = loop_s, time.process_time() - loop_cpu0
        # ok only after the calibration: one that fails leaves the store unfinished, and the same command retries it
        calibration = _calibrate(writer, target, store, calibrate=calibrate, engine=engine)
        phases["calibrate"] = time.time() - loop_t0 - loop_s
        ok = True
    finally:
        torch.set_num_threads(intra_op)  # the request threads' setting is process-wide for new threads
        bar.close()
        if workers is not None:
            workers.close()
        t_close = time.time()
        _remove_job_dumps(plans, job)  # late dumps of timed-out attempts: keep /dev/shm bounded
        complete = ok and (not tally.rejected or mark_complete_with_rejections)
        writer, manifest = store.close(complete=complete)  # commits verified samples even after an error
        phases["close"] = time.time() - t_close
    summary = _capture_summary(
        tally,
        plans,
        out_store=out_store,
        split=split,
        layer_ids=layer_ids,
        n_total=n_total,
        n_todo=len(todo),
        store_complete=manifest.get("status") == "complete",
        elapsed=time.time() - t0,
        loop_s=loop_s,
        phases=phases,
        setup_seconds=setup.seconds,
        beside_loop_seconds=store.laps.seconds,
        store_seconds=writer.seconds,
        calibration=calibration,
        memory={"limit_bytes": budget.limit, "peak_bytes": budget.peak},
        procs=0 if workers is None else len(workers.procs),
    )
    _refuse_disagreeing_engine(calibration, out_store, plans[0].url, summary)
    return summary


def _check_capture_options(
    urls: Sequence[str],
    concurrency: int,
    max_retries: int,
    dump_wait_s: float,
    request_timeout_s: float,
    memory_bytes: int | None,
    procs: int,
) -> None:
    """Refuse capture_from_sglang's options that cannot work, before anything is read or sent."""
    if not urls:
        raise EyasError("--url: give at least one SGLang server URL")
    if concurrency < 1:
        raise EyasError(f"--sglang-concurrency: {concurrency}, expected >= 1")
    if max_retries < 0:
        raise EyasError(f"--sglang-max-retries: {max_retries}, expected >= 0")
    if dump_wait_s <= 0 or request_timeout_s <= 0:
        raise EyasError(
            f"--sglang-dump-wait {dump_wait_s} / --sglang-request-timeout {request_timeout_s}: expected > 0"
        )
    if memory_bytes is not None and memory_bytes <= 0:
        raise EyasError(f"--sglang-memory-gb: {memory_bytes / 2**30:g} GiB, expected > 0")
    if procs < 0:
        raise EyasError(f"--sglang-procs: {procs}, expected >= 0")


def _reach_servers(
    urls: Sequence[str],
    layer_ids: Sequence[int] | None,
    first: torch.Tensor,
    *,
    job: str,
    laps: _Laps,
    cache_bypass: str,
    dump_dir: str | Path | None,
    probe_kw: dict[str, Any],
) -> tuple[list[ServerPlan], list[int], list[Outcome]]:
    """(plans, layer ids, one probe per server): every server preflighted, the dumps an interrupted run of this
    job left behind removed, then one probe each (`_probe_servers`; `probe_kw`: its retry and wait options)."""
    plans, layer_ids = _preflight_servers(urls, layer_ids, cache_bypass=cache_bypass, dump_dir=dump_dir)
    laps.lap("preflight")
    for ddir in _dump_dirs(plans):
        if n := remove_stale_dumps(ddir, job):
            log(f"eyas: removed {n} dumps left in {ddir} by an interrupted run")
    probes = _probe_servers(plans, first, layer_ids=layer_ids, job=job, **probe_kw)
    laps.lap("probe")
    return plans, layer_ids, probes


def _preflight_servers(
    urls: Sequence[str], layer_ids: Sequence[int] | None, *, cache_bypass: str, dump_dir: str | Path | None
) -> tuple[list[ServerPlan], list[int]]:
    """Every server preflighted, and the layer ids they all capture (the first server's when none are asked for)."""
    plans = [preflight(u, layer_ids, cache_bypass=cache_bypass, dump_dir=dump_dir) for u in urls]
    layer_ids = [int(i) for i in plans[0].status["layer_ids"]] if layer_ids is None else list(layer_ids)
    for p in plans[1:]:
        if p.status["layer_ids"] != layer_ids or p.hidden_size != plans[0].hidden_size:
            raise EyasError(
                f"--url {p.url} captures layers {p.status['layer_ids']} of a model with hidden size "
                f"{p.hidden_size}; {plans[0].url} captures {layer_ids} with {plans[0].hidden_size}: "
                "all servers must serve the same model with the same EYAS_CAPTURE_LAYERS"
            )
    return plans, layer_ids


def _probe_servers(
    plans: Sequence[ServerPlan],
    first: torch.Tensor,
    *,
    layer_ids: Sequence[int],
    job: str,
    dump_wait_s: float,
    max_retries: int,
    backoff_s: float,
) -> list[Outcome]:
    """One probe per server: proves the dump path end to end and gives the hidden size and dtype.

    Random ids within the range `first` (the first sample's ids) uses, valid for the vocabulary, so
    that the probe does not leave a prefix of a real sample in a server's radix cache."""
    probe_ids = torch.randint(
        int(first.min()),
        int(first.max()) + 1,
        (16,),
        generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")),
    )
    return [
        probe(
            p,
            probe_ids,
            layer_ids=layer_ids,
            tag=f"{job}-probe{i}",
            dump_wait_s=dump_wait_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        for i, p in enumerate(plans)
    ]


def _dump_dirs(plans: Sequence[ServerPlan]) -> list[Path]:
    """The servers' dump directories, each once (servers on one host may share one)."""
    return [p.dump_dir for p in {str(p.dump_dir): p for p in plans}.values()]


def _remove_job_dumps(plans: Sequence[ServerPlan], job: str) -> None:
    for ddir in _dump_dirs(plans):
        remove_stale_dumps(ddir, job)


def _job_tag(out_store: Path, split: str) -> str:
    return hashlib.sha256(f"{Path(out_store).resolve()}|{split}".encode()).hexdigest()[:10]


def remove_stale_dumps(dump_dir: Path, job: str) -> int:
    """Delete dumps a crashed run of this job left behind (their samples are re-sent)."""
    n = 0
    for p in list(dump_dir.iterdir()) if dump_dir.is_dir() else []:
        if parse_rid(p.name) is not None and p.name.split(".", 2)[2].startswith(job + "-"):
            shutil.rmtree(p, ignore_errors=True)
            n += 1
    return n


def _open_capture_store(
    out_store: Path,
    prepared,
    plans: Sequence[ServerPlan],
    probes: Sequence[Outcome],
    *,
    split: str,
    layer_ids: Sequence[int],
    dtype: str,
    target: str | Path | None,
    limit: int | None,
    sending: set[str],
    laps: _Laps,
    hold_commits=None,
):
    """(the store's writer, the target it records): the served model's directory stands in for a missing target.
    `sending`: the ids of the samples being sent, none of which the store may hold. `hold_commits`: StoreWriter's."""
    hidden = int(probes[0].hidden_LSD.shape[2])
    server_dtype = _model_dtype(probes[0].dump_dtype)
    if target is None:
        served = plans[0].info.get("model_path")
        if served and (Path(served) / "config.json").is_file():
            target = served  # the server loads its model from a directory this host can read
    writer = open_store(
        out_store,
        prepared=prepared,
        split=split,
        layer_ids=layer_ids,
        hidden_size=hidden,
        dtype=dtype,
        target=target,
        model_dtype=server_dtype,
        limit=limit,
        producer={
            "backend": "sglang",
            "urls": [p.url for p in plans],
            "sglang_version": plans[0].version,
            "cache_bypass": [p.bypass for p in plans],
            "plugin": plans[0].status.get("plugin_version"),
            "server_dtype": probes[0].dump_dtype,
            "num_layers": plans[0].status.get("model", {}).get("num_layers"),
            "model_class": plans[0].status.get("model", {}).get("class"),
        },
        laps=laps,
        hold_commits=hold_commits,
    )
    if twice := sorted(writer.committed_ids & sending):
        writer.abort()  # nothing added; a close would wait for hold_commits, which this thread is yet to settle
        raise EyasError(
            f"--out {out_store}: {len(twice)} samples being sent (first {twice[0]}) were committed while the capture "
            "opened the store: is another capture writing it?"
        )
    return writer, target


def _model_dtype(name: str | None) -> str | None:
    """The store's model_dtype (bf16 | fp32: what `eyas verify` recomputes in) for a dump's dtype.

    An fp16 server is recorded as bf16 (the closest dtype the numbers check runs in, with the
    16-bit tolerance); the exact dtype goes into the producer record."""
    return {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32"}.get(name or "", name)


def open_store(
    out_store: Path,
    *,
    prepared,
    split: str,
    layer_ids: Sequence[int],
    hidden_size: int,
    dtype: str,
    target: str | Path | None,
    model_dtype: str | None,
    limit: int | None,
    producer: dict[str, Any],
    laps: _Laps,
    hold_commits=None,
):
    """The store's writer, its spec recording the target's identity. Whether the data was tokenised by the target's
    tokenizer is `check_tokenizer`'s (seconds: it loads the tokenizer), which `hold_commits` may wait for."""
    from eyas.store.writer import StoreWriter

    lap = laps.lap
    identity = None
    if target is not None:
        from eyas.target import model_identity

        identity = model_identity(target)
        lap("target_identity")
    else:
        log(
            "eyas: no --target: the store will not record the model's identity, and `eyas verify` cannot check its "
            "numbers; pass --target with the served model's directory (the server's model_path is used when it exists here)"
        )
    sp = prepared.split(split)
    spec = StoreSpec(
        aux_layer_ids=list(layer_ids),
        hidden_size=hidden_size,
        dtype=dtype,
        convention=CONVENTION,
        target=identity,
        tokenizer_hash=prepared.tokenizer_hash,
        prepared={
            "path": str(Path(prepared.root).resolve()),
            "split": split,
            "fingerprint": sp.fingerprint,
            "limit": limit,
            "samples": len(sp) if limit is None else min(limit, len(sp)),
        },
        model_dtype=model_dtype,
        producer=producer,
    )
    writer = StoreWriter(out_store, spec, hold_commits=hold_commits)
    lap("open_store")
    return writer


def check_tokenizer(prepared, target: str | Path | None, laps: _Laps, apart: Apart) -> None:
    """Refuse a target whose model type transformers does not know, and data tokenised by another tokenizer than
    the target's (nothing to check without a target), in the child `apart` (seconds: it imports transformers)."""
    if target is None:
        return
    if prepared.tokenizer_hash is None:
        apart.call("check_model_type", target=str(target)).result()
        return
    tok_hash = apart.call("tokenizer_hash", target=str(target)).result()  # the model type checked too
    laps.lap("tokenizer")
    if prepared.tokenizer_hash != tok_hash:
        raise EyasError(
            f"--data {prepared.root} was tokenised with another tokenizer (hash {prepared.tokenizer_hash[:12]}) "
            f"than the target {target} (hash {tok_hash[:12]}); prepare the data with this target's tokenizer"
        )


def _samples_to_capture(split, n_total: int, out_store: Path, plans: Sequence[ServerPlan], layer_ids) -> list[int]:
    """The indices of the samples of `split` (its first `n_total`) the store does not hold yet, said in the log."""
    done_ids = committed_ids(out_store)
    todo = [i for i in range(n_total) if split.ids[i] not in done_ids]
    log(
        f"eyas capture (sglang): {len(todo)} of {n_total} samples to capture from {len(plans)} server(s) "
        f"({n_total - len(todo)} already in {out_store}); layers {layer_ids} ({CONVENTION}), "
        f"bypass {[p.bypass for p in plans]}"
    )
    return todo


class _OpeningStore:
    """The store, opened (`_open_capture_store`, its arguments) on a thread of its own while the first samples go
    out, then the tokenizer checked (`check_tokenizer`) and the calibration's reference loaded, both in the child
    `apart` (eyas.sglang.apart): the target's identity, the manifest, the tokenizer and the
    reference cost the loop nothing. `add_encoded` waits for the opening only, so the samples sent meanwhile
    wait within the memory budget (StateBudget); the writer commits nothing until the tokenizer check has passed,
    and a failed check stops the capture at the next sample. Once the reference is loaded and `calibrate` samples
    are committed, `add_encoded` starts the calibration in the child too, beside the rest of the loop
    (`calibration`). `result` gives (writer, target) once both have ended or raises why not; `close` closes the
    store (removes it when the check refused a store this run created). `encode` turns a sample's states into the
    stored rows, by the spec alone."""

    def __init__(
        self, out_store: Path, prepared, plans, probes, *, layer_ids, dtype: str, calibration, apart: Apart, **kw
    ):
        hidden = int(probes[0].hidden_LSD.shape[2])
        self.encode = SampleEncoder(StoreSpec(aux_layer_ids=list(layer_ids), hidden_size=hidden, dtype=dtype))
        self.laps = _Laps(time.time())
        self.apart = apart
        self._calibrate_kw = {
            **calibration,
            "store": str(out_store),
            "prepared": str(prepared.root),
            "split": kw["split"],
        }
        self._calibration: cf.Future | None = None
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-capture-open-store")
        self._tokenizer: cf.Future = cf.Future()
        self._future = pool.submit(
            _open_capture_store,
            out_store,
            prepared,
            plans,
            probes,
            layer_ids=layer_ids,
            dtype=dtype,
            laps=self.laps,
            hold_commits=self._tokenizer,
            **kw,
        )
        pool.submit(self._check_tokenizer, prepared)  # next, on the same thread
        self._reference = pool.submit(self._load_reference, **calibration)  # then this
        pool.shutdown(wait=False)

    def _check_tokenizer(self, prepared) -> None:
        """Settle `_tokenizer` (what the writer's commits wait for) with the check's outcome, once the store is open."""
        if not self._tokenizer.set_running_or_notify_cancel():
            return
        try:
            check_tokenizer(prepared, self._future.result()[1], self.laps, self.apart)
        except BaseException as exc:  # the opening's own failure too: nothing may be committed then either
            self._tokenizer.set_exception(exc)
        else:
            self._tokenizer.set_result(None)

    def _load_reference(self, *, calibrate: int, device: str, engine: dict[str, Any]) -> bool:
        """The calibration's reference model, loaded (on `device`) in the child beside the loop, where one is needed
        (then True)."""
        writer, target = self.result()
        if _calibration_skipped(writer.manifest, target, calibrate=calibrate, engine=engine):
            return False
        self.apart.call("load_reference", manifest=writer.manifest, target=str(target), device=device).result()
        self.laps.lap("reference")
        return True

    def reference_loaded(self) -> None:
        """Waits for the reference's loading; raises why it failed."""
        self._reference.result()

    def result(self):
        self._tokenizer.result()
        return self._future.result()

    def add_encoded(self, sample) -> None:
        if self._tokenizer.done():
            self._tokenizer.result()  # a refused tokenizer stops the capture at once
        writer = self._future.result()[0]
        writer.add_encoded(sample)
        if (
            self._calibration is None
            and self._reference.done()
            and self._reference.exception() is None
            and self._reference.result()
            and len(writer.manifest["samples"]) >= self._calibrate_kw["calibrate"]
        ):
            self.calibration()  # enough committed: the reference recomputes them beside the loop

    def calibration(self) -> cf.Future:
        """The calibration in the child (eyas.store.numerics.calibrate_store on the samples committed when it
        starts), started now unless add_encoded did; call only where one is due (_calibration_skipped)."""
        if self._calibration is None:
            writer, target = self.result()
            kw = self._calibrate_kw
            n = min(kw["calibrate"], len(writer.manifest["samples"]))
            log(
                f"eyas capture (sglang): calibrating the engine's numbers on {n} stored samples against the "
                f"reference on {kw['device']} (--sglang-calibrate 0 skips it)"
            )
            kw = {k: v for k, v in kw.items() if k != "calibrate"}
            self._calibration = self.apart.call("calibrate", **kw, target=str(target), samples=n)
        return self._calibration

    def close(self, *, complete: bool):
        """(writer, its closing manifest) once the opening and the check have ended; (None, {}) when either failed.
        A reference model not loading yet is not loaded (the capture ended before it was needed); the child ends."""
        self._reference.cancel()
        try:
            if self._future.exception() is not None:
                return None, {}
            writer = self._future.result()[0]
            if self._tokenizer.exception() is not None:
                writer.discard()
                return None, {}
            return writer, writer.close(complete=complete)
        finally:
            self.apart.close()


def _capture_loop(plans, split, todo, writer, tally, bar, *, workers, **sender_kw):
    """Send every sample of `todo` and store each verified one. `concurrency` requests at each server (its
    gate); as many more samples again are being read and checked, or wait for a slot, so that a server
    never waits for this process to read a dump. With `workers` (Workers, --sglang-procs), they share the
    samples and the slots, and this process only stores. `sender_kw`: `concurrency`, then Sender's fields."""
    send = send_all if workers is None else workers.run
    with short_switch_interval():
        send(plans, split, todo, writer, tally, bar, **sender_kw)


def _refuse_disagreeing_engine(calibration: dict[str, Any], out_store, url: str, summary: dict[str, Any]) -> None:
    """CheckFailed (with the summary) when the calibration found the engine's numbers off the reference."""
    if calibration.get("problem"):
        from eyas.errors import CheckFailed

        raise CheckFailed(
            f"store {out_store}: the engine's numbers disagree with the reference: {calibration['problem']}; "
            f"check the server (`eyas verify-server --url {url} --target ...`)",
            summary,
        )


class _Laps:
    """Seconds between successive `lap` calls, by name (where the capture's set-up goes)."""

    def __init__(self, t0: float):
        self.last, self.seconds = t0, {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.seconds[name], self.last = now - self.last, now


def _capture_summary(
    tally: Tally,
    plans: Sequence[ServerPlan],
    *,
    out_store: str | Path,
    split: str,
    layer_ids: list[int],
    n_total: int,
    n_todo: int,
    store_complete: bool,
    elapsed: float,
    loop_s: float,
    phases: dict[str, float],
    setup_seconds: dict[str, float],
    beside_loop_seconds: dict[str, float],
    store_seconds: dict[str, float],
    calibration: dict[str, Any],
    memory: dict[str, int],
    procs: int,
) -> dict[str, Any]:
    """capture_from_sglang's summary (rejected samples listed up to REJECTED_LISTED)."""
    tokens = tally.tokens
    return {
        "backend": "sglang",
        "store": str(out_store),
        "split": split,
        "urls": [p.url for p in plans],
        "layer_ids": layer_ids,
        "convention": CONVENTION,
        "sglang_layer_ids": sglang_layer_ids(layer_ids),
        "samples": n_total,
        "already_committed": n_total - n_todo,
        "captured": tally.captured,
        "tokens": tokens,
        "rejected_count": len(tally.rejected),
        "rejected": tally.rejected[:REJECTED_LISTED],
        "retries": tally.retries,
        "cache_bypass": [p.bypass for p in plans],
        "store_complete": store_complete,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "loop_s": round(loop_s, 3),
        "loop_tokens_per_s": round(tokens / loop_s, 1) if loop_s > 0 else None,
        "seconds_summed": {k: round(v, 3) for k, v in tally.spent.items()},
        # requests at the servers on average during the loop: below the slots, the servers waited for this client
        "in_flight_mean": round(tally.spent["request"] / loop_s, 2) if loop_s > 0 else None,
        "stored_tokens_timeline": tally.timeline(),
        "phase_seconds": {k: round(v, 3) for k, v in phases.items()},
        "setup_seconds": {k: round(v, 3) for k, v in setup_seconds.items()},
        # on a thread of its own beside the loop: the store's opening, then the calibration's reference model
        "beside_loop_seconds": {k: round(v, 3) for k, v in beside_loop_seconds.items()},
        "store_seconds": {k: round(v, 3) for k, v in store_seconds.items()},
        "memory": memory,
        "procs": procs,  # worker processes that sent and checked (--sglang-procs; 0: this one)
        "engine_numerics": calibration,
    }


def _calibration_skipped(manifest: dict[str, Any], target, *, calibrate: int, engine: dict[str, Any]) -> dict | None:
    """Why the capture records no new calibration (what the summary shows), or None when it does."""
    old = manifest.get("engine_numerics")
    if not calibrate:
        return {"skipped": "--sglang-calibrate 0: `eyas verify` holds this store to fixed limits for a bf16 engine"}
    if target is None:
        return {"skipped": "no --target: `eyas verify` holds this store to fixed limits for a bf16 engine"}
    if isinstance(old, dict) and old.get("engine") == engine:
        return {"kept": f"recorded earlier on {old.get('n_samples')} samples with the same engine"}
    return None


def _calibrate(writer, target, store, *, calibrate: int, engine: dict[str, Any]):
    """Record the engine's numerics in the store (see capture_from_sglang); returns what the summary shows.
    `store`: the _OpeningStore, whose child holds verify's reference model and may have calibrated already."""
    from eyas.store.numerics import calibration_problem

    manifest = writer.manifest
    if (skipped := _calibration_skipped(manifest, target, calibrate=calibrate, engine=engine)) is not None:
        return skipped
    writer.commit()  # the reference reads what the store holds, as verify will
    if not manifest["samples"]:
        return {"skipped": "no committed samples"}
    store.reference_loaded()
    rec = store.calibration().result()  # started beside the loop once enough samples were committed, or now
    writer.set_field("engine_numerics", rec)
    problem = calibration_problem(manifest, rec)
    high = rec["per_layer"][str(max(manifest["aux_layer_ids"]))]
    log(
        f"eyas capture (sglang): engine numerics on {rec['n_samples']} samples ({rec['tokens']} tokens), highest aux "
        f"layer: rms max {high['rms']['max']:.3g}, p99.9 max {high['p999']['max']:.3g}, worst token {high['max']['max']:.3g}"
        + (f"; REFUSED: {problem}" if problem else "")
    )
    return {
        "n_samples": rec["n_samples"],
        "tokens": rec["tokens"],
        "per_layer": rec["per_layer"],
        **({"problem": problem} if problem else {}),
    }
