"""`eyas verify`: prove a store holds the right numbers for every sample, exactly once.

Two checks:
- coverage (reads every stored byte): the store is complete; every sample of the prepared split (the
  first `limit` when capture was limited) is stored exactly once, nothing else is; token counts equal
  the prepared lengths; the prepared data is unchanged (fingerprint recomputed from its arrays);
  every shard has the size its header and the manifest state (a truncated shard fails all its
  samples); each sample's sha256 matches; no NaN/Inf (for fp8 also in the scales).
- numbers (a seeded random subset): recompute each sample alone with the independent reference
  path `eyas.target.reference_hidden_states` (unbatched, no padding, `output_hidden_states` of the
  full causal LM instead of hooks, eager PyTorch: no compilation or graphs) and compare
  every stored slot token by token: err_t = ||stored_t - ref_t|| / ||ref_t||. A sample fails when its
  worst err_t exceeds the tolerance. The worst error, its sample, slot and token are reported.

Default tolerances (worst per-token relative L2 error), set by the stored dtype and the dtype the
target ran in. Measured on the real SmolLM2 (4 chat samples of 71-88 tokens, batched capture vs the
unbatched reference, both with the model's default SDPA attention), worst error of a correct store:

    stored \\ model    fp32 model            bf16 model
    fp32              3.6e-6  -> tol 1e-3   0.025 -> tol 0.10
    bf16              2.7e-3  -> tol 1e-2   0.025 -> tol 0.10
    fp8               0.031   -> tol 0.08   0.034 -> tol 0.12

and the worst error each fault produces on the same samples (fp32 model): rows shifted by one 2.0
(no token below 0.23), the neighbouring layer 0.42-0.57, another sample's rows 2.1, a missing prefix
recomputed without its context 150 (median 0.07). See tests/test_verify_faults.py.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import CheckFailed, EyasError
from eyas.store.format import DTYPES
from eyas.store.reader import StoreReader

TOLERANCES = {
    ("fp32", "fp32"): 1e-3, ("bf16", "fp32"): 1e-2, ("fp8", "fp32"): 8e-2,
    ("fp32", "bf16"): 1e-1, ("bf16", "bf16"): 1e-1, ("fp8", "bf16"): 1.2e-1,
}
LIST_MAX = 20  # ids listed per failure kind in the summary


def default_tolerance(dtype: str, model_dtype: str | None) -> float:
    return TOLERANCES.get((dtype, model_dtype or "fp32"), TOLERANCES[(dtype, "bf16")])


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
    found: dict[str, list[str]] = {k: [] for k in (
        "missing", "duplicated", "unexpected", "token_count", "truncated_shard", "checksum", "nonfinite")}
    notes: list[str] = []
    if not reader.complete:
        notes.append(f"store status is {reader.manifest.get('status')!r}, not 'complete': rerun the same `eyas capture` to finish it")
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
    for index, shard in enumerate(reader.manifest["shards"]):
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


def check_numbers(reader: StoreReader, split, model, sample_ids: list[str], *, tolerance: float, progress_bar=None) -> dict[str, Any]:
    """Recompute `sample_ids` one by one with the reference path and compare every stored slot."""
    from eyas.target import reference_hidden_states

    device = next(model.parameters()).device
    per_sample: dict[str, dict[str, Any]] = {}
    for sid in sample_ids:
        ids_T = split[split.index_of(sid)].input_ids.to(device)
        ref_aux, ref_final = reference_hidden_states(model, ids_T, layer_ids=reader.aux_layer_ids)
        ref_TLD = torch.cat([ref_aux, ref_final.unsqueeze(1)], dim=1).float().cpu()
        err, slot, t = compare_sample(reader.get_hidden(sid, torch.float32), ref_TLD)
        per_sample[sid] = {"error": err, "slot": slot_name(reader, slot) if slot >= 0 else "shape", "token": t}
        if progress_bar is not None:
            progress_bar.update(1)
    failing = [sid for sid, r in per_sample.items() if not r["error"] <= tolerance]
    worst = max(per_sample, key=lambda s: per_sample[s]["error"], default=None)
    return {
        "ok": not failing,
        "checked": len(per_sample),
        "tolerance": tolerance,
        "worst_rel_err": per_sample[worst]["error"] if worst else None,
        "worst_sample": worst,
        "worst_slot": per_sample[worst]["slot"] if worst else None,
        "worst_token": per_sample[worst]["token"] if worst else None,
        "failing_samples": failing,
        "errors": {sid: round(r["error"], 6) for sid, r in sorted(per_sample.items(), key=lambda kv: -kv[1]["error"])[:LIST_MAX]},
    }


def pick_subset(sample_ids: list[str], numbers: int, seed: int) -> list[str]:
    if numbers >= len(sample_ids):
        return list(sample_ids)
    return random.Random(seed).sample(list(sample_ids), numbers)


def verify_store(
    store: str | Path,
    *,
    numbers: int = 8,
    seed: int = 0,
    tolerance: float | None = None,
    device: str = "cpu",
    target: str | None = None,
    data: str | Path | None = None,
) -> dict[str, Any]:
    """Run coverage then numbers; return the summary, or raise CheckFailed carrying it."""
    from eyas.common import log, progress
    from eyas.data.prepared import PreparedDataset

    if numbers < 0:
        raise EyasError(f"--numbers: {numbers} must be >= 0")
    if tolerance is not None and not tolerance > 0:
        raise EyasError(f"--tolerance: {tolerance} must be positive")
    reader = StoreReader(store)
    m = reader.manifest
    prep = m.get("prepared") or {}
    data_dir = Path(data) if data is not None else Path(prep.get("path", ""))
    if not prep or not (data_dir / "meta.json").is_file():
        raise EyasError(f"store {store}: its prepared dataset {str(data_dir)!r} is not there; pass --data with its new location")
    split = PreparedDataset(data_dir).split(prep["split"])
    log(f"eyas verify: {store}: {len(reader)} samples, {reader.dtype}, aux layers {reader.aux_layer_ids} ({m.get('convention')}); coverage...")
    coverage = check_coverage(reader, split)
    summary: dict[str, Any] = {"store": str(store), "dtype": reader.dtype, "model_dtype": m.get("model_dtype"),
                               "samples": coverage["stored_samples"], "tokens": coverage["stored_tokens"], "coverage": coverage}
    tol = tolerance if tolerance is not None else default_tolerance(reader.dtype, m.get("model_dtype"))
    failed = set(coverage["failing_samples"])
    candidates = list(dict.fromkeys(sid for sid in reader.sample_ids if sid not in failed and sid in split._index))
    subset = pick_subset(candidates, numbers, seed)
    if subset:
        model = _load_reference_target(m, target, device)
        bar = progress(len(subset), "verify numbers", unit="sample")
        try:
            summary["numbers"] = check_numbers(reader, split, model, subset, tolerance=tol, progress_bar=bar)
        finally:
            bar.close()
    else:
        summary["numbers"] = {"ok": True, "checked": 0, "tolerance": tol}
    failing = sorted(set(coverage["failing_samples"]) | set(summary["numbers"].get("failing_samples", [])))
    summary["failing_samples"] = failing[:LIST_MAX]
    summary["failing_count"] = len(failing)
    summary["ok"] = coverage["ok"] and summary["numbers"]["ok"]
    if not summary["ok"]:
        parts = [f"{k}: {v}" for k, v in coverage["problems"].items()] + coverage["notes"]
        nums = summary["numbers"]
        if nums.get("failing_samples"):
            parts.append(
                f"numbers: {len(nums['failing_samples'])}/{nums['checked']} samples over tolerance {tol:g} "
                f"(worst {nums['worst_rel_err']:.3g} in {nums['worst_sample']}, {nums['worst_slot']}, token {nums['worst_token']}): "
                f"{nums['failing_samples'][:LIST_MAX]}"
            )
        raise CheckFailed(f"store {store} failed verification: " + "; ".join(parts), summary)
    return summary


def _load_reference_target(manifest: dict[str, Any], target: str | None, device: str):
    from eyas.target import load_target, load_tokenizer, model_identity, tokenizer_hash

    ident = manifest.get("target") or {}
    path = target or ident.get("path")
    if not path:
        raise EyasError("the store records no target path: pass --target")
    now = model_identity(path)
    for key in ("config_sha256", "weights_index_sha256"):
        if ident.get(key) != now[key]:
            raise EyasError(
                f"target {path} is not the model this store was captured from ({key} {now[key][:12]} vs the store's "
                f"{str(ident.get(key))[:12]}); pass --target with the original model"
            )
    if manifest.get("tokenizer_hash") and tokenizer_hash(load_tokenizer(path)) != manifest["tokenizer_hash"]:
        raise EyasError(f"target {path}: its tokenizer differs from the one recorded in the store; pass --target with the original model")
    from eyas.dtypes import to_dtype

    dtype = to_dtype(manifest.get("model_dtype") or "fp32", what=f"store {manifest.get('model_dtype')!r} model_dtype")
    return load_target(path, device=device, dtype=dtype)
