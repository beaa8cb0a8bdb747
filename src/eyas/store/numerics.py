"""The numbers check of a store made by a serving engine: statistics that tell engine numerics from faults.

A serving engine (SGLang) computes the target with its own fused low-precision kernels, so its states
differ from eyas's unbatched transformers reference on every token, and at a high layer one token
among thousands lands near the in-process tolerance. The single worst token is an extreme value: it
grows with the tokens checked, so a correct engine store fails it on some seeds. Per stored slot
(layer) of a recomputed sample, with e_t = ||stored_t - ref_t|| / ||ref_t|| per token, `eyas verify`
judges an engine store by three statistics instead:

    rms    sqrt(mean_t e_t^2): the sample's typical error. A fault spread over the sample (rows
           shifted, another layer, another sample's rows, scaled values) raises it far above
           the engine's level, which is stable from sample to sample.
    p999   the 99.9th percentile of e_t: the engine's error tail, which a handful of unlucky tokens
           cannot move (for samples under 1,000 tokens it is close to the worst token).
    max    the worst e_t, held only to a gross limit: faults confined to a few tokens (zeroed rows:
           e = 1; a prefix computed without its context: e >> 1).

(a ratio of norms over the whole sample would be the first token's error alone: real models' first
state, an attention sink, is orders of magnitude larger than the others.)

Limits, scaled by the in-process tolerance `tol` of the store's dtypes (verify.default_tolerance,
0.1 for a bf16 target):

- calibrated: `eyas capture --backend sglang` with a target recomputes a few stored samples with
  the same reference and records per layer the max and mean of each statistic in the manifest
  (`engine_numerics`, covered by its fields_sha256). limit = max(MARGIN x recorded max,
  FLOOR x tol): the margin absorbs samples the calibration did not see, the floor the reference's
  own rounding (an engine store is never held tighter than an in-process one).
- fallback (no calibration recorded): FALLBACK x tol, sized for a bf16 engine: rms 0.05, p999 0.2,
  max 0.4 for tol 0.1, a few times the levels SGLang's bf16 kernels reached against the reference.
- a calibration whose recorded max exceeds FALLBACK x tol anywhere (the engine disagreed with the
  reference at capture, or the manifest was edited) or that is malformed is refused: the numbers
  check fails, naming it, and judges the samples by the fallback limits. So a calibrated limit never
  exceeds MARGIN x FALLBACK x tol (max 0.8 < 1, the error of a zeroed row).

eyas's own in-process stores keep the single-worst-token check against `tol`.

Shape legend: T tokens, L = A + 1 stored slots, A aux layers, D hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCHEMA = "eyas.engine-numerics/1"
STATS = ("rms", "p999", "max")
STAT_NAMES = {"rms": "rms", "p999": "p99.9", "max": "max"}
PERCENTILE = 0.999
MARGIN = 2.0
FLOOR = {"rms": 0.25, "p999": 1.0, "max": 2.5}  # x tol
FALLBACK = {"rms": 0.5, "p999": 2.0, "max": 4.0}  # x tol
CALIBRATION_SAMPLES = 8


def is_engine_store(manifest: dict[str, Any]) -> bool:
    """Whether a serving engine produced the store (its producer's backend is not eyas's transformers)."""
    return (manifest.get("producer") or {}).get("backend") not in (None, "transformers")


def layer_keys(aux_layer_ids: list[int]) -> list[str]:
    """The per-layer keys of a record, in slot order: the aux layer ids, then "final"."""
    return [str(i) for i in aux_layer_ids] + ["final"]


def token_errors(stored_TLD: torch.Tensor, ref_TLD: torch.Tensor) -> torch.Tensor:
    """e[t, slot] = ||stored - ref|| / ||ref||; NaN -> inf; a shape mismatch is inf everywhere."""
    from eyas.store.invariants import rel_err_TL

    if stored_TLD.shape != ref_TLD.shape:
        return torch.full((max(1, ref_TLD.shape[0]), ref_TLD.shape[1]), float("inf"))
    return rel_err_TL(stored_TLD, ref_TLD)


def sample_stats(err_TL: torch.Tensor) -> dict[str, list[float]]:
    """Each statistic per slot of one sample's token errors."""
    e = err_TL.double()
    return {
        "rms": e.pow(2).mean(0).sqrt().tolist(),
        "p999": torch.quantile(e, PERCENTILE, dim=0).tolist(),
        "max": e.max(0).values.tolist(),
    }


def recompute(reader, split, model, sample_id: str) -> torch.Tensor:
    """One sample's token errors against the reference (eyas.target.reference_hidden_states, alone, unpadded)."""
    from eyas.target import reference_hidden_states

    device = next(model.parameters()).device
    ids_T = split[split.index_of(sample_id)].input_ids.to(device)
    ref_aux, ref_final = reference_hidden_states(model, ids_T, layer_ids=reader.aux_layer_ids)
    ref_TLD = torch.cat([ref_aux, ref_final.unsqueeze(1)], dim=1).float().cpu()
    return token_errors(reader.get_hidden(sample_id, torch.float32), ref_TLD)


def calibrate(reader, split, model, sample_ids: list[str], *, engine: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `engine_numerics` record: each statistic's max and mean per layer over `sample_ids`."""
    import transformers

    per: list[dict[str, list[float]]] = []
    tokens = 0
    for sid in sample_ids:
        err = recompute(reader, split, model, sid)
        tokens += err.shape[0]
        per.append(sample_stats(err))
    p = next(model.parameters())
    per_layer = {}
    for slot, key in enumerate(layer_keys(reader.aux_layer_ids)):
        per_layer[key] = {
            s: {
                "max": round(max(x[s][slot] for x in per), 6),
                "mean": round(sum(x[s][slot] for x in per) / len(per), 6),
            }
            for s in STATS
        }
    return {
        "schema": SCHEMA,
        "statistic": {
            "e_t": "||stored_t - ref_t|| / ||ref_t|| per token and layer",
            "rms": "sqrt(mean_t e_t^2)",
            "p999": f"{PERCENTILE} quantile of e_t (linear)",
            "max": "max_t e_t",
        },
        "n_samples": len(per),
        "tokens": int(tokens),
        "samples": list(sample_ids),
        "per_layer": per_layer,
        "reference": {
            "path": "eyas.target.reference_hidden_states",
            "device": p.device.type,
            "dtype": str(p.dtype),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "engine": engine,
    }


def _fmt(x: float) -> str:
    return f"{x:.3g}"


@dataclass
class EngineLimits:
    """The limits an engine store's recomputed samples are held to, and where they came from."""

    source: str
    """calibration, fallback (none recorded) or refused (recorded but not acceptable)."""
    why: str
    """One line: which limits and why."""
    keys: list[str]
    """Per slot: the layer id, or "final"."""
    limits: list[dict[str, float]]
    """Per slot: each statistic's limit."""

    @property
    def gross(self) -> float:
        """The largest per-token limit over the slots (what a check of single tokens can hold an engine store to)."""
        return max(lim["max"] for lim in self.limits)

    def exceeded(self, stats: dict[str, list[float]]) -> list[dict[str, Any]]:
        """Every (slot, statistic) of one sample over its limit, largest ratio first."""
        over = []
        for slot, lim in enumerate(self.limits):
            for s in STATS:
                v = stats[s][slot]
                if not v <= lim[s]:
                    over.append(
                        {
                            "slot": slot,
                            "stat": s,
                            "value": v,
                            "limit": lim[s],
                            "ratio": v / lim[s] if lim[s] > 0 else math.inf,
                        }
                    )
        return sorted(over, key=lambda o: -o["ratio"])

    def report(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "why": self.why,
            "per_layer": {k: {s: round(lim[s], 6) for s in STATS} for k, lim in zip(self.keys, self.limits)},
        }

    def describe(self) -> str:
        return "; ".join(
            f"{'layer ' + k if k != 'final' else k}: " + " ".join(f"{STAT_NAMES[s]}<={_fmt(lim[s])}" for s in STATS)
            for k, lim in zip(self.keys, self.limits)
        )


def _check_record(rec: Any, keys: list[str], tol: float) -> str | None:
    """Why a recorded calibration cannot be used, or None."""
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        return (
            f"its schema is {rec.get('schema') if isinstance(rec, dict) else type(rec).__name__!r}, expected {SCHEMA!r}"
        )
    n = rec.get("n_samples")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return f"n_samples is {n!r}, expected a positive integer"
    per = rec.get("per_layer")
    if not isinstance(per, dict) or sorted(per) != sorted(keys):
        return f"its layers {sorted(per) if isinstance(per, dict) else per!r} are not the store's {keys}"
    for k in keys:
        for s in STATS:
            entry = per[k].get(s) if isinstance(per[k], dict) else None
            vals = [entry.get(f) for f in ("max", "mean")] if isinstance(entry, dict) else [None]
            if not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in vals
            ):
                return f"layer {k} {s} is {entry!r}, expected finite non-negative max and mean"
            ceiling = FALLBACK[s] * tol
            if entry["max"] > ceiling:
                return (
                    f"it records {STAT_NAMES[s]} {_fmt(entry['max'])} at {'layer ' + k if k != 'final' else k}, above "
                    f"{_fmt(ceiling)} (what a bf16 engine explains): the engine disagreed with the reference at capture, "
                    "or the manifest was edited"
                )
    return None


def engine_limits(manifest: dict[str, Any], tol: float) -> EngineLimits:
    """The limits for an engine store whose in-process tolerance is `tol` (see the module docstring)."""
    keys = layer_keys(list(manifest["aux_layer_ids"]))
    fallback = [{s: FALLBACK[s] * tol for s in STATS} for _ in keys]
    fixed = ", ".join(f"{STAT_NAMES[s]} {_fmt(FALLBACK[s] * tol)}" for s in STATS)
    rec = manifest.get("engine_numerics")
    if rec is None:
        return EngineLimits(
            "fallback",
            f"the store records no engine calibration (captured without a target, with "
            f"--sglang-calibrate 0, or by an older eyas): fixed limits sized for a bf16 engine ({fixed})",
            keys,
            fallback,
        )
    problem = _check_record(rec, keys, tol)
    if problem is not None:
        return EngineLimits(
            "refused",
            f"the manifest's engine_numerics is refused: {problem}; samples judged by the fixed limits ({fixed})",
            keys,
            fallback,
        )
    limits = [{s: max(MARGIN * rec["per_layer"][k][s]["max"], FLOOR[s] * tol) for s in STATS} for k in keys]
    return EngineLimits(
        "calibration",
        f"calibrated at capture on {rec['n_samples']} samples ({rec.get('tokens', '?')} "
        f"tokens) against the reference: limit = max({MARGIN:g} x recorded max, floor "
        + ", ".join(f"{STAT_NAMES[s]} {_fmt(FLOOR[s] * tol)}" for s in STATS)
        + ")",
        keys,
        limits,
    )


def calibration_problem(manifest: dict[str, Any], rec: dict[str, Any]) -> str | None:
    """Why `eyas verify` would refuse `rec` as this store's calibration, or None."""
    from eyas.store.verify import default_tolerance

    tol = default_tolerance(manifest["dtype"], manifest.get("model_dtype"))
    return _check_record(rec, layer_keys(list(manifest["aux_layer_ids"])), tol)


def calibrate_store(
    store, split, target: str, *, device: str, samples: int, engine: dict[str, Any], model=None
) -> dict[str, Any]:
    """Recompute `samples` committed samples of an engine store (spread over shards and lengths, fixed
    seed) with the reference `eyas verify` uses (same target identity check, same model dtype) and
    return the `engine_numerics` record. `model`: that reference, when it is loaded already."""
    from eyas.store.reader import StoreReader
    from eyas.store.verify import _load_reference_target, stratified_order

    reader = StoreReader(store)
    ids = stratified_order(reader.manifest["samples"], 0)[:samples]
    if model is None:
        model = _load_reference_target(reader.manifest, str(target), device)
    return calibrate(reader, split, model, ids, engine=engine)
