"""`eyas verify`: prove a store holds the right numbers for every sample, exactly once.

Three checks, in this order:
- coverage (reads every stored byte): the store is complete; every sample of the prepared split (the
  first `limit` when capture was limited) is stored exactly once, nothing else is; token counts equal
  the prepared lengths; the prepared data is unchanged (fingerprint recomputed from its arrays);
  every shard has the size its header and the manifest state (a truncated shard fails all its
  samples); each sample's sha256 matches; no NaN/Inf (for fp8 also in the scales); the manifest's
  own fields (dtype, layer ids, model dtype, target, data) match their checksum `fields_sha256`.
- invariants (every sample, no full recompute; eyas/store/invariants.py): the shared prefix's rows
  equal one recompute of that prefix, the final state equals the target's last layers and norm
  applied to the stored highest aux layer, the final slot is post-norm, and rate invariants (next
  token through the lm_head, slot-to-slot alignment, token identity) calibrated on the store
  itself. Each failing sample is reported with the invariant, slot and token that failed.
- numbers (a random subset drawn afresh each run, stratified over shards and lengths; the seed is
  printed and `seed` repeats it): recompute each sample alone with the independent reference path
  `eyas.target.reference_hidden_states` (unbatched, no padding, `output_hidden_states` of the full
  causal LM, eager) and compare every stored slot token by token: err_t = ||stored_t - ref_t|| /
  ||ref_t||. A sample fails when its worst err_t exceeds the tolerance. A store made by a serving
  engine (SGLang) is judged instead per layer by the rms, 99.9th percentile and (to a gross limit)
  worst of err_t, against limits calibrated at capture (eyas/store/numerics.py): the engine's fused
  kernels put single tokens near the tolerance on correct stores. The report gives the
  probability that k bad samples (placed at random in the store) would all have been missed by
  the subset.

Before the target loads, its identity is checked against the store's: config, weight index and a
hash of sampled bytes of every tensor (eyas.target.model_identity), so another checkpoint with the
same config is refused as the wrong target (exit 2) instead of failing the store. A store written
before the sampled hash existed is still verified, with a warning.

Default tolerances (worst per-token relative L2 error), set by the stored dtype and the dtype the
target ran in. Measured on the real SmolLM2 (4 chat samples of 71-88 tokens, batched capture vs the
unbatched reference, both with the model's default SDPA attention), worst error of a correct store:

    stored \\ model    fp32 model            bf16 model
    fp32              3.6e-6  -> tol 1e-3   0.025 -> tol 0.10
    bf16              2.7e-3  -> tol 1e-2   0.025 -> tol 0.10
    fp8               0.031   -> tol 0.08   0.034 -> tol 0.12

and the worst error each fault produces on the same samples (fp32 model): rows shifted by one 2.0
(no token below 0.23), the neighbouring layer 0.42-0.57, another sample's rows 2.1, a missing prefix
recomputed without its context 150 (median 0.07). See tests/test_verify_faults.py and
tests/test_verify_invariants.py.

Run: `eyas verify --store STORE [--numbers 8] [--seed S] [--device cuda]`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import log
from eyas.errors import CheckFailed, EyasError
from eyas.store.format import DTYPES, manifest_fields_problem
from eyas.store.numerics import engine_limits, is_engine_store
from eyas.store.reader import StoreReader

TOLERANCES = {
    ("fp32", "fp32"): 1e-3,
    ("bf16", "fp32"): 1e-2,
    ("fp8", "fp32"): 8e-2,
    ("fp32", "bf16"): 1e-1,
    ("bf16", "bf16"): 1e-1,
    ("fp8", "bf16"): 1.2e-1,
}
LIST_MAX = 20  # ids listed per failure kind in the summary


def default_tolerance(dtype: str, model_dtype: str | None) -> float:
    return TOLERANCES.get((dtype, model_dtype or "fp32"), TOLERANCES[(dtype, "bf16")])


def store_tail_tolerance(manifest: dict, dtype: str) -> float:
    """The tail invariant's tolerance for a store. TAIL_TOLERANCES hold eyas's own (transformers) captures. A
    store written by a serving engine holds that engine's numbers (SGLang: fused residual-add + RMSNorm in the
    compute dtype, its own attention kernels), which eyas's eager tail recomputes; there the tail gets the numbers
    check's budget, which recomputes every layer against the same reference (a live server's tail error exceeded
    the in-process limit on one token while its numbers check passed)."""
    from eyas.store.invariants import tail_tolerance

    model_dtype = manifest.get("model_dtype")
    tol = tail_tolerance(dtype, model_dtype)
    if is_engine_store(manifest):
        tol = max(tol, default_tolerance(dtype, model_dtype))
    return tol


def slot_name(reader: StoreReader, slot: int) -> str:
    return f"aux[{slot}] (layer {reader.aux_layer_ids[slot]})" if slot < len(reader.aux_layer_ids) else "final"


# ---------------------------------------------------------------------------------------------
# coverage


def _scan_sample(reader: StoreReader, sample_id: str) -> list[str]:
    """Problems of one stored sample: checksum, NaN/Inf."""
    rec = reader.record(sample_id)
    hidden_u8, scale_u8 = reader.raw_bytes(sample_id)
    problems = []
    h = hashlib.sha256(hidden_u8)
    if scale_u8 is not None:
        h.update(scale_u8)
    if h.hexdigest() != rec.get("sha256"):
        problems.append("checksum")
    sd = DTYPES[reader.dtype]
    values = torch.from_numpy(np.array(hidden_u8)).view(sd.torch_dtype)
    finite = bool(torch.isfinite(values.float() if sd.scaled else values).all())
    if scale_u8 is not None:
        finite &= bool(torch.isfinite(torch.from_numpy(np.array(scale_u8)).view(torch.float32)).all())
    if not finite:
        problems.append("nonfinite")
    return problems


def check_coverage(reader: StoreReader, split, *, threads: int | None = None) -> dict[str, Any]:
    """Coverage of the store against the prepared split it was captured from. Returns findings."""
    from eyas.data.prepared import _fingerprint

    prep = reader.manifest.get("prepared") or {}
    n_expected = prep.get("samples", len(split))
    expected = split.ids[:n_expected]
    lengths = {sid: int(t) for sid, t in zip(split.ids, split.lengths)}
    found: dict[str, list[str]] = {
        k: []
        for k in ("missing", "duplicated", "unexpected", "token_count", "truncated_shard", "checksum", "nonfinite")
    }
    notes: list[str] = []
    if not reader.complete:
        notes.append(
            f"store status is {reader.manifest.get('status')!r}, not 'complete': rerun the same `eyas capture` to finish it"
        )
    recorded = reader.manifest.get("fields_sha256")
    if recorded is None:
        log(
            f"warning: store {reader.path}: the manifest has no fields_sha256 (written by an older eyas): its dtype, "
            "layer ids and model dtype are taken on trust"
        )
    elif (problem := manifest_fields_problem(reader.manifest, reader.path)) is not None:
        notes.append(problem)
    actual_fp = _fingerprint(split._input_ids, split._loss_mask, split.offsets, split.ids)
    if actual_fp != prep.get("fingerprint"):
        notes.append(
            f"the prepared split {split.name} at {split.root} changed since capture (fingerprint {actual_fp[:12]}, "
            f"store has {str(prep.get('fingerprint'))[:12]}): capture again"
        )
    counts: dict[str, int] = {}
    for sid in reader.sample_ids:
        counts[sid] = counts.get(sid, 0) + 1
    found["duplicated"] = [sid for sid, c in counts.items() if c > 1]
    expected_set = set(expected)
    found["missing"] = [sid for sid in expected if sid not in counts]
    found["unexpected"] = [sid for sid in counts if sid not in expected_set]
    for rec in reader.manifest["samples"]:
        if rec["id"] in lengths and rec["tokens"] != lengths[rec["id"]]:
            found["token_count"].append(rec["id"])
    bad_shards = set()
    for index in range(len(reader.manifest["shards"])):
        try:
            reader.layout(index)
        except EyasError as exc:
            bad_shards.add(index)
            notes.append(str(exc))
    scan = []
    for rec in reader.manifest["samples"]:
        if rec["shard"] in bad_shards:
            found["truncated_shard"].append(rec["id"])
        elif counts[rec["id"]] == 1:
            scan.append(rec["id"])
    from eyas.common import progress

    bar = progress(len(scan), "verify coverage", unit="sample")
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        for sid, problems in zip(scan, pool.map(lambda s: _scan_sample(reader, s), scan)):
            bar.update(1)
            for p in problems:
                found[p].append(sid)
    bar.close()
    failing = sorted({sid for ids in found.values() for sid in ids})
    return {
        "ok": not failing and not notes,
        "expected_samples": len(expected),
        "stored_samples": len(reader.sample_ids),
        "stored_tokens": sum(r["tokens"] for r in reader.manifest["samples"]),
        "failing_samples": failing,
        "problems": {k: v[:LIST_MAX] for k, v in found.items() if v},
        "problem_counts": {k: len(v) for k, v in found.items() if v},
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------------
# numbers


def compare_sample(stored_TLD: torch.Tensor, ref_TLD: torch.Tensor) -> tuple[float, int, int]:
    """Worst per-token relative L2 error over tokens and slots: (error, slot, token)."""
    s, r = stored_TLD.float(), ref_TLD.float()
    if s.shape != r.shape:
        return float("inf"), -1, -1
    err_TL = (s - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
    err_TL = torch.nan_to_num(err_TL, nan=float("inf"))
    flat = int(err_TL.argmax())
    t, slot = divmod(flat, err_TL.shape[1])
    return float(err_TL.reshape(-1)[flat]), slot, t


def check_numbers(
    reader: StoreReader,
    split,
    model,
    sample_ids: list[str],
    *,
    tolerance: float,
    progress_bar=None,
    min_samples: int | None = None,
    deadline: float | None = None,
    limits=None,
) -> dict[str, Any]:
    """Recompute `sample_ids` one by one with the reference path and compare every stored slot.

    A sample fails when its worst per-token error exceeds `tolerance`, or, with engine `limits`
    (eyas.store.numerics.EngineLimits), when any layer's rms / p99.9 / max exceeds its limit.
    With a `deadline` (time.monotonic()), stops once it has passed and `min_samples` are done.
    """
    from eyas.store.numerics import STAT_NAMES, recompute, sample_stats

    per_sample: dict[str, dict[str, Any]] = {}
    for sid in sample_ids:
        if deadline is not None and len(per_sample) >= (min_samples or 0) and time.monotonic() > deadline:
            break
        err_TL = recompute(reader, split, model, sid)
        flat = int(err_TL.argmax())
        t, slot = divmod(flat, err_TL.shape[1])
        shape_ok = reader.record(sid)["tokens"] == int(split.lengths[split.index_of(sid)])
        per_sample[sid] = {
            "error": float(err_TL.reshape(-1)[flat]),
            "slot": slot_name(reader, slot) if shape_ok else "shape",
            "token": t if shape_ok else -1,
        }
        if limits is not None:
            over = limits.exceeded(sample_stats(err_TL))
            per_sample[sid]["over"] = [
                {**o, "slot": slot_name(reader, o["slot"]), "stat": STAT_NAMES[o["stat"]]} for o in over
            ]
        if progress_bar is not None:
            progress_bar.update(1)
    if limits is None:
        failing = [sid for sid, r in per_sample.items() if not r["error"] <= tolerance]
    else:
        failing = [sid for sid, r in per_sample.items() if r["over"]]
    worst = max(per_sample, key=lambda s: per_sample[s]["error"], default=None)
    out: dict[str, Any] = {}
    if limits is not None:
        out["engine_limits"] = limits.report()
        out["over_limits"] = {sid: per_sample[sid]["over"][:3] for sid in failing[:LIST_MAX]}
        first = max(failing, key=lambda s: per_sample[s]["over"][0]["ratio"], default=None)
        out["worst_over"] = {"sample": first, **per_sample[first]["over"][0]} if first else None
    return {
        **out,
        "ok": not failing,
        "checked": len(per_sample),
        "checked_ids": list(per_sample),
        "tolerance": tolerance,
        "worst_rel_err": per_sample[worst]["error"] if worst else None,
        "worst_sample": worst,
        "worst_slot": per_sample[worst]["slot"] if worst else None,
        "worst_token": per_sample[worst]["token"] if worst else None,
        "failing_samples": failing,
        "errors": {
            sid: round(r["error"], 6)
            for sid, r in sorted(per_sample.items(), key=lambda kv: -kv[1]["error"])[:LIST_MAX]
        },
    }


def stratified_order(records: list[dict[str, Any]], seed: int, *, length_buckets: int = 4) -> list[str]:
    """All sample ids in a random order that spreads the first draws over shards and lengths.

    Samples are bucketed by shard and by length quartile (store-wide); each shard's queue alternates
    its length buckets (starting bucket rotated from shard to shard), and the shards take turns in
    a random order. So the first n ids come from n different shards while n <= shards, with their
    lengths spread over the quartiles; any prefix of the order is a valid subset (a time budget
    stops anywhere).
    """
    rng = random.Random(seed)
    lengths = sorted(r["tokens"] for r in records)
    edges = [lengths[len(lengths) * q // length_buckets] for q in range(1, length_buckets)] if lengths else []
    by_shard: dict[int, list[list[str]]] = {}
    for r in records:
        bucket = sum(r["tokens"] >= e for e in edges)
        by_shard.setdefault(r["shard"], [[] for _ in range(length_buckets)])[bucket].append(r["id"])
    shard_order = sorted(by_shard)
    rng.shuffle(shard_order)
    offset = rng.randrange(length_buckets)
    queues = []
    for i, shard in enumerate(shard_order):
        buckets = by_shard[shard]
        for b in buckets:
            rng.shuffle(b)
        order = [(offset + i + k) % length_buckets for k in range(length_buckets)]
        queue = []
        while any(buckets[b] for b in order):
            queue += [buckets[b].pop() for b in order if buckets[b]]
        queues.append(queue)
    out = []
    for step in range(max((len(q) for q in queues), default=0)):
        out += [q[step] for q in queues if step < len(q)]
    return out


def miss_probability(population: int, drawn: int, bad: int) -> float:
    """P(a uniform draw of `drawn` of `population` samples contains none of `bad` bad ones)."""
    if bad <= 0:
        return 1.0
    if drawn + bad > population:
        return 0.0
    return math.exp(sum(math.log((population - bad - i) / (population - i)) for i in range(drawn)))


@dataclass(kw_only=True)
class VerifyConfig:
    """Options of `eyas verify` (the CLI's options are these fields)."""

    store: Path
    """Store directory written by `eyas capture`."""
    numbers: int = 8
    """Samples recomputed with the unbatched reference path (0 = none); at least this many."""
    numbers_fraction: float = 0.0
    """Also recompute at least this fraction of the samples (0..1)."""
    numbers_seconds: float | None = None
    """Time budget: keep recomputing further samples (in the drawn order) until this many seconds pass."""
    seed: int | None = None
    """Seed of the recomputed subset; default: a fresh random seed each run (printed; pass it to repeat)."""
    invariants: bool = True
    """Check the every-sample invariants (prefix, tail, post-norm final, calibrated rates)."""
    tolerance: float | None = None
    """Worst per-token relative error allowed in the numbers and prefix checks; default by stored dtype and
    model dtype. Given for a store made by a serving engine, it replaces that store's engine limits."""
    device: str = "cpu"
    """Where the target runs for invariants and recompute: cpu or cuda[:K]."""
    target: str | None = None
    """Target directory if it moved since capture (its identity must match the store's)."""
    data: Path | None = None
    """Prepared dataset directory if it moved since capture."""

    def __post_init__(self):
        from eyas.config_checks import check_device, check_number

        check_number(self, "numbers", ge=0)
        check_number(self, "tolerance", gt=0, optional=True)
        if self.device == "auto":
            raise EyasError("--device must be cpu or cuda[:K], got 'auto'")
        check_device(self.device)
        if not 0 <= self.numbers_fraction <= 1:
            raise EyasError(f"--numbers-fraction: {self.numbers_fraction} must be within [0, 1]")
        if self.numbers_seconds is not None and not self.numbers_seconds >= 0:
            raise EyasError(f"--numbers-seconds: {self.numbers_seconds} must be >= 0")
        if self.seed is not None and self.seed < 0:
            raise EyasError(f"--seed: {self.seed} must be >= 0")


def verify_store(store: str | Path, **options: Any) -> dict[str, Any]:
    """Run coverage, invariants and numbers; return the summary, or raise CheckFailed carrying it.

    `options` are VerifyConfig's fields (numbers, seed, tolerance, device, target, data, ...).
    """
    return run_verify(VerifyConfig(store=Path(store), **options))


def run_verify(cfg: VerifyConfig) -> dict[str, Any]:
    from eyas.locks import require_idle

    store = cfg.store
    require_idle(store, what="store")  # a capture still running: its manifest lists a part of the samples
    reader = StoreReader(store)
    m = reader.manifest
    split = _prepared_split(store, m, cfg.data)

    log(
        f"eyas verify: {store}: {len(reader)} samples, {reader.dtype}, aux layers {reader.aux_layer_ids} ({m.get('convention')}); coverage..."
    )
    coverage = check_coverage(reader, split)
    summary: dict[str, Any] = {
        "store": str(store),
        "dtype": reader.dtype,
        "model_dtype": m.get("model_dtype"),
        "samples": coverage["stored_samples"],
        "tokens": coverage["stored_tokens"],
        "coverage": coverage,
        "warnings": [],
    }
    if "fields_sha256" not in m:
        summary["warnings"].append(
            "manifest has no fields_sha256 (older eyas): dtype, layer ids and model dtype taken on trust"
        )
    tol, limits, prefix_tol = _numbers_limits(m, cfg, reader.dtype)
    failed = set(coverage["failing_samples"])
    candidates = list(dict.fromkeys(sid for sid in reader.sample_ids if sid not in failed and sid in split._index))
    n_wanted = min(len(candidates), max(cfg.numbers, math.ceil(cfg.numbers_fraction * len(candidates))))
    if cfg.numbers_seconds:
        n_wanted = len(candidates)  # the time budget decides where to stop
    model = None
    if candidates and (cfg.invariants or n_wanted):
        model = _load_reference_target(m, cfg.target, cfg.device, summary["warnings"])

    inv, inv_failed = _verify_invariants(reader, split, model, candidates, cfg, prefix_tol=prefix_tol)
    summary["invariants"] = inv
    nums = _verify_numbers(reader, split, model, candidates, cfg, n_wanted=n_wanted, tol=tol, limits=limits)
    summary["numbers"] = nums
    _verdict(summary, store, inv_failed, tol=tol, limits=limits)
    return summary


def _prepared_split(store: Path, manifest: dict[str, Any], data: Path | None):
    """The prepared split the store was captured from (at `data` when it moved); its changes are coverage's to report."""
    from eyas.data.prepared import PreparedDataset

    prep = manifest.get("prepared") or {}
    data_dir = Path(data) if data is not None else Path(prep.get("path", ""))
    if not prep or not (data_dir / "meta.json").is_file():
        raise EyasError(
            f"store {store}: its prepared dataset {str(data_dir)!r} is not there; pass --data with its new location"
        )
    return PreparedDataset(data_dir, check=False).split(prep["split"])  # (coverage reports a changed split)


def _numbers_limits(manifest: dict[str, Any], cfg: VerifyConfig, dtype: str) -> tuple[float, Any, float]:
    """(numbers tolerance, engine limits or None, prefix invariant tolerance) for the store: a store made by a
    serving engine is judged by its engine limits unless a tolerance is given."""
    tol = cfg.tolerance if cfg.tolerance is not None else default_tolerance(dtype, manifest.get("model_dtype"))
    limits = None
    prefix_tol = tol
    if cfg.tolerance is None and is_engine_store(manifest):
        limits = engine_limits(manifest, tol)
        # the prefix invariant compares single tokens: only the gross per-token limit parts engine noise from faults there
        prefix_tol = max(tol, limits.gross)
        producer = manifest.get("producer") or {}
        log(
            f"eyas verify: store made by {producer.get('backend')} {producer.get('sglang_version', '')}".rstrip()
            + f": numbers judged per layer by rms, p99.9 and max of the per-token error ({limits.source}: {limits.why}); "
            f"limits {limits.describe()}; prefix invariant {prefix_tol:.3g}"
        )
        calibrated_on = ((manifest.get("engine_numerics") or {}).get("reference") or {}).get("device")
        if limits.source == "calibration" and calibrated_on not in (None, cfg.device.split(":")[0]):
            log(
                f"eyas verify: note: the calibration's reference ran on {calibrated_on}, this one runs on {cfg.device}; "
                "the limits' margin is what absorbs the two references' own rounding differences"
            )
    return tol, limits, prefix_tol


def _verify_invariants(
    reader: StoreReader, split, model, candidates: list[str], cfg: VerifyConfig, *, prefix_tol: float
) -> tuple[dict[str, Any], set[str]]:
    """The invariants on every candidate sample: (their summary, the samples failing them)."""
    from eyas.common import progress
    from eyas.store.invariants import run_invariants, target_parts

    if model is None or not cfg.invariants:
        skipped = "--no-invariants" if not cfg.invariants else "no samples"
        return {"ok": True, "checked": 0, "skipped": skipped}, set()
    parts = target_parts(model, reader.aux_layer_ids)
    bar = progress(len(candidates), "verify invariants", unit="sample")
    try:
        inv = run_invariants(
            reader,
            split,
            parts,
            sample_ids=candidates,
            prefix_tol=prefix_tol,
            tail_tol=store_tail_tolerance(reader.manifest, reader.dtype),
            progress_bar=bar,
        )
    finally:
        bar.close()
    inv_failed = set(inv["failing_samples"])
    inv["failures"] = dict(list(inv["failures"].items())[:LIST_MAX])
    log(
        f"eyas verify: invariants on {inv['checked']} samples ({inv['tokens']} tokens): "
        f"{len(inv_failed)} failing; "
        + ", ".join(
            f"{k} {v['store_rate']:.2f}" + ("" if v["informative"] else " (not informative)")
            for k, v in inv["rates"].items()
        )
    )
    return inv, inv_failed


def _verify_numbers(
    reader: StoreReader,
    split,
    model,
    candidates: list[str],
    cfg: VerifyConfig,
    *,
    n_wanted: int,
    tol: float,
    limits,
) -> dict[str, Any]:
    """The numbers check on a fresh random subset of the candidates, with its seed, strata and miss probabilities."""
    from eyas.common import progress

    seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
    # Samples the invariants failed stay in the pool: their recompute error says how wrong they are.
    keep = set(candidates)
    pool = list({r["id"]: r for r in reader.manifest["samples"] if r["id"] in keep}.values())
    order = stratified_order(pool, seed)
    subset = order[:n_wanted]
    if subset and model is not None:
        log(
            f"eyas verify: numbers on {'up to ' if cfg.numbers_seconds else ''}{len(subset)} of {len(pool)} samples, "
            f"seed {seed} (repeat this subset with --seed {seed})"
        )
        bar = progress(len(subset), "verify numbers", unit="sample")
        deadline = time.monotonic() + cfg.numbers_seconds if cfg.numbers_seconds else None
        try:
            nums = check_numbers(
                reader,
                split,
                model,
                subset,
                tolerance=tol,
                progress_bar=bar,
                min_samples=min(n_wanted, max(cfg.numbers, math.ceil(cfg.numbers_fraction * len(pool)))),
                deadline=deadline,
                limits=limits,
            )
        finally:
            bar.close()
    else:
        nums = {"ok": True, "checked": 0, "tolerance": tol, "checked_ids": []}
        if limits is not None:
            nums["engine_limits"] = limits.report()
    if limits is not None and limits.source == "refused":
        nums["ok"] = False  # the store's own record of its engine cannot be trusted
    nums["seed"] = seed
    nums["population"] = len(pool)
    nums["strata"] = {
        "shards": len({r["shard"] for r in pool}),
        "shards_drawn": len({reader.record(s)["shard"] for s in nums["checked_ids"]}),
    }
    nums["miss_probability"] = {
        str(k): round(miss_probability(len(pool), nums["checked"], k), 4)
        for k in (1, 2, 5, 10, max(1, len(pool) // 100))
        if k <= len(pool)
    }
    nums["checked_ids"] = nums["checked_ids"][:LIST_MAX]
    return nums


def _verdict(summary: dict[str, Any], store: Path, inv_failed: set[str], *, tol: float, limits) -> None:
    """Complete the summary with the failing samples and the verdict; raise CheckFailed naming every failure."""
    coverage, inv, nums = summary["coverage"], summary["invariants"], summary["numbers"]
    seed = nums["seed"]
    failing = sorted(set(coverage["failing_samples"]) | inv_failed | set(nums.get("failing_samples", [])))
    summary["failing_samples"] = failing[:LIST_MAX]
    summary["failing_count"] = len(failing)
    summary["ok"] = coverage["ok"] and inv["ok"] and nums["ok"]
    if not summary["ok"]:
        parts_msg = [f"{k}: {v}" for k, v in coverage["problems"].items()] + coverage["notes"]
        if inv_failed:
            shown = list(inv["failures"].items())[:5]
            parts_msg.append(
                f"invariants: {len(inv_failed)} samples failed: "
                + "; ".join(f"{sid} [{' | '.join(msgs)}]" for sid, msgs in shown)
                + (" ..." if len(inv_failed) > len(shown) else "")
            )
        if limits is not None and limits.source == "refused":
            parts_msg.append(f"numbers: {limits.why}")
        if nums.get("failing_samples") and limits is not None:
            w = nums["worst_over"]
            parts_msg.append(
                f"numbers: {len(nums['failing_samples'])}/{nums['checked']} samples over the engine limits ({limits.source}) "
                f"(worst {w['stat']} {w['value']:.3g} > {w['limit']:.3g} in {w['sample']}, {w['slot']}): "
                f"{nums['failing_samples'][:LIST_MAX]} (seed {seed})"
            )
        elif nums.get("failing_samples"):
            parts_msg.append(
                f"numbers: {len(nums['failing_samples'])}/{nums['checked']} samples over tolerance {tol:g} "
                f"(worst {nums['worst_rel_err']:.3g} in {nums['worst_sample']}, {nums['worst_slot']}, token {nums['worst_token']}): "
                f"{nums['failing_samples'][:LIST_MAX]} (seed {seed})"
            )
        raise CheckFailed(f"store {store} failed verification: " + "; ".join(parts_msg), summary)
    miss = nums["miss_probability"]
    log(
        f"eyas verify: ok. numbers checked {nums['checked']} of {nums['population']} (seed {seed}); the chance that a subset "
        f"this size misses all of k bad samples placed at random (on top of the invariants): "
        + ", ".join(f"k={k}: {p:.3g}" for k, p in miss.items())
    )


def _load_reference_target(
    manifest: dict[str, Any], target: str | None, device: str, warnings: list[str] | None = None
):
    from eyas.target import load_target, load_tokenizer, model_identity, tokenizer_hash

    ident = manifest.get("target") or {}
    path = target or ident.get("path")
    if not path:
        raise EyasError("the store records no target path: pass --target")
    now = model_identity(path)
    what = {
        "config_sha256": "its config.json",
        "weights_index_sha256": "its weight files' index (names, shapes, sizes)",
        "weights_sample_sha256": "its weights (sampled bytes of every tensor)",
    }
    for key, thing in what.items():
        if key not in ident and key == "weights_sample_sha256":
            msg = (
                f"the store's target identity predates sampled weight hashes (older eyas): only the config and weight index of "
                f"{path} were compared, a checkpoint with other weights would not be told apart"
            )
            log(f"warning: {msg}")
            if warnings is not None:
                warnings.append(msg)
            continue
        if ident.get(key) != now[key]:
            raise EyasError(
                f"wrong target: {path} is not the model this store was captured from ({thing} differ: {key} {now[key][:12]} vs "
                f"the store's {str(ident.get(key))[:12]}); pass --target with the original model ({ident.get('path')})"
            )
    if manifest.get("tokenizer_hash") and tokenizer_hash(load_tokenizer(path)) != manifest["tokenizer_hash"]:
        raise EyasError(
            f"wrong target: {path}: its tokenizer differs from the one recorded in the store; pass --target with the original model"
        )
    from eyas.dtypes import to_dtype

    dtype = to_dtype(manifest.get("model_dtype") or "fp32", what=f"store {manifest.get('model_dtype')!r} model_dtype")
    return load_target(path, device=device, dtype=dtype)
