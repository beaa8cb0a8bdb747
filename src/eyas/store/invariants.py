"""Invariants checked on EVERY stored sample, without a full recompute (part of `eyas verify`).

The numbers check recomputes a random subset; a fault confined to one sample outside it (rows
rolled by one token, two samples swapped, a left-padded forward without a mask, the final slot
holding the pre-norm state, noise) passes it. These checks read every sample and need only the
target's weights and, for two of them, a few layers or a few tokens of forward:

    prefix      the first rows of every sample (the chat template's shared prefix, at least the
                first PREFIX_MIN tokens) equal a reference recompute of that prefix, every slot.
                Causal attention makes them independent of what follows; one recompute serves a
                whole group of samples that share the prefix. Catches padding leaks (the first
                tokens attend to pads), rolled rows, noise, a pre-norm final, prefix-cache gaps.
    tail        final == norm(layers[high:](aux_high)): the stored final state is recomputed from
                the stored highest aux layer through the last N - high layers (3 for EAGLE-3's
                default N-3) and the final norm. Catches a rolled or swapped final or high slot,
                a pre-norm final, noise, and leaks from padding in those last layers.
    final_norm  the final slot is an RMS-normalised state: rms(final_t / norm_scale) <= 1 (it equals
                sqrt(m / (m + eps)) for the residual's mean square m); a pre-norm state is far off.
    token       at each aux slot, the input token's embedding is more similar (cosine, states
                centred by the sample's mean) to the state at its position than the embeddings of
                the neighbouring tokens and of RANDOM_CANDIDATES other tokens of the sample.
                Catches swapped samples and rolled rows where the residual still carries the
                token (low layers).
    next        the target's lm_head on the final state ranks the next token above its neighbours
                and other tokens of the sample (a cheap stand-in for the next-token agreement
                rate: K+3 logits per token instead of V), counted where the next token is part of
                an answer (the loss mask): a long user turn the target cannot predict (logs, code,
                another language) would otherwise read as a fault. Catches swapped samples and a
                rolled final slot.
    align       adjacent stored slots (low->mid->high->final) agree position by position: the
                centred cosine of slot k and k+1 at the same token beats the one-token-shifted
                pairs, counted where the token differs from both neighbours (inside a run of one
                repeated token the states of adjacent positions are nearly equal and the
                comparison is a coin toss). Catches a single layer's rows rolled by one token
                anywhere in a sample outside such runs.

prefix, tail and final_norm have absolute tolerances (they compare numbers that must be equal up
to rounding). token, next and align are rates whose level depends on the target and the data
(next is near 1 for the target's own greedy answers, near chance for a random tiny model): each is
calibrated on the store itself. It counts for a target only where the store's pooled rate is
well above chance (INFORMATIVE_RATE), and a sample fails it only when its rate is below half the
pooled rate AND so few passes would happen by chance with probability < OUTLIER_P at the pooled rate
(if samples were alike, under 1% chance of one false alarm in a million-sample store; the halving
rule absorbs real differences between samples). Short samples therefore rarely fail a rate
invariant; the absolute checks cover them.

On SmolLM2 `token` is not informative (the residual stream does not keep the token's embedding
direction) while `next` and `align` are; on a tiny random Llama `token` is and `next` is at chance.
`python benchmarks/verify_invariants_bench.py` measures the rates and the faults each one catches.

Cost: samples go in batches of about BATCH_TOKENS tokens. Each batch crosses to the device once,
its tail runs as ONE packed forward (samples end to end, attention kept inside each, positions
restarting: eyas.packing.tail_forward_packed, where the model family and a checked varlen kernel
allow it; else one Hugging Face forward per sample), every per-token result (tail errors, final
rms, rate pass counts) is computed on the device and comes back to the host in one copy. The
earlier one-sample-at-a-time loop ran a few-layer forward per sample and moved results to the host
after every check, several syncs per sample: on a GPU that cost more than a full recompute. On a
CPU the tail layers are compute-bound and the packed row is no faster, so the CPU keeps one
Hugging Face tail forward per sample (still batched copies and device-side results).

Run: every `eyas verify` (`--no-invariants` skips them); cost per token and the faults each one
catches: `python benchmarks/verify_invariants_bench.py`.

Shape legend: T tokens, L = A + 1 stored slots, A aux layers, D hidden size, V vocab, K candidates.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX_MAX = 64  # most shared-prefix tokens recomputed per group
PREFIX_MIN = 4  # tokens recomputed for a sample that shares no prefix with others
TAIL_MAX_LAYERS = 4  # the tail check runs when at most this many layers (or N//8) follow the highest aux layer
RANDOM_CANDIDATES = 16
INFORMATIVE_RATE = {"token": 0.5, "next": 0.3, "align": 0.6}
OUTLIER_P = 1e-9
BATCH_TOKENS = 8192  # stored tokens per batch: one copy to the device, one packed tail forward, one copy back
FINAL_NORM_RANGE = (0.5, 1.05)  # median over tokens of rms(final / scale)
# Tail recompute error (worst per-token relative error), keyed like the numbers tolerance. Measured
# on correct SmolLM2 stores on CPU (benchmarks/verify_invariants_bench.py): fp32 target, bf16 store
# 0.0072 (55 chats), fp8 store 0.065 (40 chats); bf16 target, bf16 store 0.0087 (40 chats: the
# stored high layer is the bf16 value the target itself used); a tiny random Llama 0.0033. Set with a
# margin of about 3 over those worst cases, since a larger store meets rarer tokens.
TAIL_TOLERANCES = {
    ("fp32", "fp32"): 1e-3,
    ("bf16", "fp32"): 3e-2,
    ("fp8", "fp32"): 2e-1,
    ("fp32", "bf16"): 3e-2,
    ("bf16", "bf16"): 3e-2,
    ("fp8", "bf16"): 2.5e-1,
}


def tail_tolerance(dtype: str, model_dtype: str | None) -> float:
    return TAIL_TOLERANCES.get((dtype, model_dtype or "fp32"), TAIL_TOLERANCES[(dtype, "bf16")])


def rel_err_TL(stored_TLD: torch.Tensor, ref_TLD: torch.Tensor) -> torch.Tensor:
    """Per token and slot ||stored - ref|| / ||ref||, NaN -> inf."""
    s, r = stored_TLD.float(), ref_TLD.float()
    err = (s - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
    return torch.nan_to_num(err, nan=float("inf"))


# ---------------------------------------------------------------------------------------------
# the target's pieces


@dataclass
class TargetParts:
    """What the invariants take from the target (weights already in memory, no copies)."""

    model: Any
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor | None
    norm_scale_D: torch.Tensor | None  # effective RMSNorm scale (norm(ones)); None if the norm is not RMS-like
    num_layers: int
    tail_ok: str | None  # None when the tail check can run, else why not


def target_parts(model, aux_layer_ids: list[int]) -> TargetParts:
    from eyas.target import _decoder_parts, num_layers_of

    base, layers, norm = _decoder_parts(model)
    n = num_layers_of(model.config)
    embed = base.get_input_embeddings().weight if hasattr(base, "get_input_embeddings") else base.embed_tokens.weight
    head = model.get_output_embeddings()
    head_w = head.weight if head is not None else None
    scale = _rms_scale(norm, embed.shape[1], embed.device)
    high = max(aux_layer_ids)
    why = None
    if n - high > max(TAIL_MAX_LAYERS, n // 8):
        why = f"the highest aux layer {high} is {n - high} layers from the output (the check runs for <= {max(TAIL_MAX_LAYERS, n // 8)})"
    kinds = getattr(model.config, "layer_types", None)
    if why is None and kinds is not None and list(kinds[high:]) != list(kinds[: n - high]):
        why = (
            "the last layers' attention kinds differ from the first ones' (sliding windows); the tail cannot run alone"
        )
    return TargetParts(
        model=model,
        embed_VD=embed.detach(),
        lm_head_VD=None if head_w is None else head_w.detach(),
        norm_scale_D=scale,
        num_layers=n,
        tail_ok=why,
    )


@torch.no_grad()
def _rms_scale(norm, d: int, device) -> torch.Tensor | None:
    """norm(ones) when `norm` behaves as y = scale * x / rms(x) (checked on random rows), else None."""
    dtype = next(norm.parameters()).dtype if any(True for _ in norm.parameters()) else torch.float32
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, d, generator=g) * 3).to(device=device, dtype=dtype)
    scale = norm(torch.ones(1, d, device=device, dtype=dtype)).float()[0]
    y = norm(x).float()
    want = scale * x.float() / x.float().pow(2).mean(-1, keepdim=True).sqrt()
    if not torch.allclose(y, want, rtol=2e-2, atol=1e-3 * float(scale.abs().max())) or bool((scale == 0).any()):
        return None
    return scale


@torch.no_grad()
def tail_final(
    parts: TargetParts, input_ids_T: torch.Tensor, high_TD: torch.Tensor, *, first_layer: int
) -> torch.Tensor:
    """norm(layers[first_layer:](high)) for one sample: the final state derived from a stored aux layer.

    The base model runs with its layer list cut to the tail and the first tail layer's input
    replaced by the stored states, so its own mask, rotary positions (0..T-1) and norm are used.
    """
    from torch import nn

    from eyas.target import _decoder_parts

    base, layers, _norm = _decoder_parts(parts.model)
    tail = list(layers)[first_layer:]
    start = high_TD[None].to(next(parts.model.parameters()).dtype)

    def replace(module, args, kwargs):
        if args:
            return (start,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": start}

    handle = tail[0].register_forward_pre_hook(replace, with_kwargs=True)
    saved = base.layers
    try:
        base.layers = nn.ModuleList(tail)
        out = base(input_ids=input_ids_T[None], use_cache=False)
    finally:
        base.layers = saved
        handle.remove()
    return out.last_hidden_state[0]


def tail_final_packed(
    parts: TargetParts, high_ND: torch.Tensor, lengths: list[int], *, first_layer: int, kernel: str | None = None
) -> torch.Tensor:
    """`tail_final` of several samples at once: their stored states laid end to end (high_ND, on the
    target's device), lengths in order; attention stays inside each sample and positions restart at
    0, so each sample's rows equal its own `tail_final` up to float rounding. One forward for the
    whole batch instead of one per sample: on a GPU the per-sample forward of a few layers is all
    launch and host overhead."""
    from eyas.packing import Segments, tail_forward_packed

    seg = Segments.from_lengths(lengths, high_ND.device)
    return tail_forward_packed(parts.model, high_ND, seg, first_layer=first_layer, kernel=kernel)


def packed_tail_kernel(parts: TargetParts) -> tuple[str | None, str]:
    """(varlen kernel for `tail_final_packed`, "") when the packed tail reproduces the model's own
    layers on this device, else (None, why not); the kernel is checked against the exact one first."""
    from eyas.packing import check_varlen_kernel, packed_unsupported_reason, pick_varlen_kernel

    why = packed_unsupported_reason(parts.model)
    if why is not None:
        return None, why
    p = next(parts.model.parameters())
    attn = parts.model.model.layers[-1].self_attn
    probe = torch.empty(1, 1, 1, int(attn.head_dim), device=p.device, dtype=p.dtype)
    if pick_varlen_kernel(probe) == "segments":  # a dense per-segment fp32 kernel: slower than Hugging Face's
        return None, f"no fast varlen attention kernel for {p.dtype} on {p.device.type}"
    err = check_varlen_kernel(p.device, p.dtype)
    kernel = pick_varlen_kernel(probe)
    if kernel == "segments":
        return None, f"the varlen attention kernel disagrees with the exact one on {p.device} (max |diff| {err:.3g})"
    return kernel, ""


# ---------------------------------------------------------------------------------------------
# rate invariants (per position pass/fail)


def _candidates_TK(ids_T: torch.Tensor, seed: int, *, offset: int) -> torch.Tensor:
    """Rival token ids per position: ids[t+offset-1], ids[t+offset+1] (clamped) and the tokens at
    RANDOM_CANDIDATES random positions of the same sample. Rivals from the sample itself are on its
    topic: states computed for another conversation cannot tell them from the true token, while
    frequent tokens drawn from the whole vocabulary would be easy to beat from any context."""
    t = ids_T.shape[0]
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(t) + offset
    nb = torch.stack([ids_T[(pos - 1).clamp(0, t - 1)], ids_T[(pos + 1).clamp(0, t - 1)]], dim=1)
    rnd = ids_T[torch.randint(0, t, (t, RANDOM_CANDIDATES), generator=g)]
    return torch.cat([nb, rnd], dim=1)


def _rank_passes(
    query_TD: torch.Tensor, table_VD: torch.Tensor, true_T: torch.Tensor, rivals_TK: torch.Tensor, *, cosine: bool
) -> torch.Tensor:
    """Per position: score(true) >= score(every rival with another id). Scores are dot products of
    query rows with table rows (cosines when `cosine`)."""
    dev = table_VD.device
    q = query_TD.to(dev, table_VD.dtype)
    true_T, rivals_TK = true_T.to(dev), rivals_TK.to(dev)
    e_true = table_VD[true_T]  # [T, D]
    e_riv = table_VD[rivals_TK]  # [T, K, D]
    s_true = (q * e_true).sum(-1).float()
    s_riv = torch.einsum("td,tkd->tk", q, e_riv).float()
    if cosine:
        s_true = s_true / e_true.float().norm(dim=-1).clamp_min(1e-12)
        s_riv = s_riv / e_riv.float().norm(dim=-1).clamp_min(1e-12)
    s_riv = s_riv.masked_fill(rivals_TK == true_T[:, None], float("-inf"))
    return s_true >= s_riv.max(dim=1).values  # on the table's device: callers sum before moving to the host


def _centred(h_TD: torch.Tensor) -> torch.Tensor:
    # The first token's state (an attention sink in real models) and a shared offset dominate raw
    # cosines; centring on the sample's mean (position 0 left out) leaves the per-token part.
    h = h_TD.float()
    mean = h[1:].mean(0) if h.shape[0] > 1 else h.mean(0)
    return h - mean


def _align_passes(a_TD: torch.Tensor, b_TD: torch.Tensor) -> torch.Tensor:
    """Per position t (not the first or last): cos(a_t, b_t) > cos(a_t, b_{t-1}) and > cos(a_t, b_{t+1})."""
    a = torch.nn.functional.normalize(_centred(a_TD), dim=-1)
    b = torch.nn.functional.normalize(_centred(b_TD), dim=-1)
    same = (a[1:-1] * b[1:-1]).sum(-1)
    prev = (a[1:-1] * b[:-2]).sum(-1)
    nxt = (a[1:-1] * b[2:]).sum(-1)
    return (same > prev) & (same > nxt)


def sample_rates(
    parts: TargetParts,
    ids_T: torch.Tensor,
    hidden_TLD: torch.Tensor,
    *,
    slot_names: list[str],
    sample_key: str,
    start: int = 0,
    answer_T: torch.Tensor | None = None,
) -> dict[str, tuple[int, int]]:
    """token[slot], next and align[pair] pass counts of one sample, over positions >= `start`.

    The shared prefix (checked exactly by `prefix`) is left out: rows copied from another sample
    with the same chat template agree there, and counting them would dilute the evidence.
    `answer_T` (bool, the loss mask) limits `next` to predictions of answer tokens; None counts all.
    """
    names, passed, totals = _rate_counts(
        parts, ids_T, hidden_TLD, slot_names=slot_names, sample_key=sample_key, start=start, answer_T=answer_T
    )
    if not names:
        return {}
    return {n: (int(k), t) for n, k, t in zip(names, torch.stack(passed).tolist(), totals)}


def _rate_counts(
    parts: TargetParts,
    ids_T: torch.Tensor,
    hidden_TLD: torch.Tensor,
    *,
    slot_names: list[str],
    sample_key: str,
    start: int,
    answer_T: torch.Tensor | None = None,
) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """`sample_rates` as (names, pass counts as 0-d tensors on the target's device, totals): the
    caller moves many samples' counts to the host at once (one device sync per batch, not seven per
    sample). hidden_TLD may live on the host or the device; ids_T and the rivals are drawn on the host."""
    t = ids_T.shape[0]
    names: list[str] = []
    passed: list[torch.Tensor] = []
    totals: list[int] = []
    if t - start < 3:
        return names, passed, totals
    dev = parts.embed_VD.device
    h = _to_device(hidden_TLD, dev)
    seed = zlib.crc32(sample_key.encode())
    a = h.shape[1] - 1
    rivals = _candidates_TK(ids_T, seed, offset=0)
    rivals_next = _candidates_TK(ids_T, seed + 1, offset=1)[:-1]
    ids_d, rivals, rivals_next = (_to_device(x, dev) for x in (ids_T, rivals, rivals_next))
    for slot in range(a):
        ok = _rank_passes(_centred(h[:, slot]), parts.embed_VD, ids_d, rivals, cosine=True)[start:]
        names.append(f"token {slot_names[slot]}")
        passed.append(ok.sum())
        totals.append(ok.numel())
    # which positions count, decided on the host from the ids and the mask (no device sync)
    counted_next = torch.ones(t - 1, dtype=torch.bool) if answer_T is None else answer_T[1:].bool()
    counted_next = counted_next[start:]
    if parts.lm_head_VD is not None and counted_next.any():
        ok = _rank_passes(h[:-1, a], parts.lm_head_VD, ids_d[1:], rivals_next, cosine=False)[start:]
        names.append("next final")
        passed.append((ok & _to_device(counted_next, dev)).sum())
        totals.append(int(counted_next.sum()))

    def differs(x: torch.Tensor) -> torch.Tensor:  # token t unlike both neighbours; entry i is position i + 1
        return ((x[1:-1] != x[:-2]) & (x[1:-1] != x[2:]))[max(start - 1, 0) :]

    distinct, distinct_d = differs(ids_T), differs(ids_d)  # the host's for the count, the device's without a copy
    for slot in range(a) if distinct.any() else ():
        ok = _align_passes(h[:, slot], h[:, slot + 1])[max(start - 1, 0) :]  # entry i is position i + 1
        names.append(f"align {slot_names[slot]} -> {slot_names[slot + 1]}")
        passed.append((ok & distinct_d).sum())
        totals.append(int(distinct.sum()))
    return names, passed, totals


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a host sync (pinned staging, non-blocking); a no-op on the same device."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), in log space (n up to millions)."""
    if p <= 0:
        return 1.0
    if p >= 1:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in terms))


def judge_rates(
    per_sample: dict[str, dict[str, tuple[int, int]]],
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Calibrate every rate invariant on the store and list the samples that fail it.

    Returns (per invariant: pooled rate, informative or why not, failing count), and per failing
    sample the messages naming the invariant, its rate and the store's.
    """
    pooled: dict[str, list[int]] = {}
    for rates in per_sample.values():
        for name, (k, n) in rates.items():
            acc = pooled.setdefault(name, [0, 0])
            acc[0] += k
            acc[1] += n
    report: dict[str, dict[str, Any]] = {}
    failures: dict[str, list[str]] = {}
    for name, (k_all, n_all) in pooled.items():
        rate = k_all / max(n_all, 1)
        need = INFORMATIVE_RATE[name.split()[0]]
        info: dict[str, Any] = {"store_rate": round(rate, 4), "informative": rate >= need, "failing": 0}
        if rate < need:
            info["why_not"] = f"store rate {rate:.2f} < {need} on this target and data: not evidence either way"
        report[name] = info
        if rate < need:
            continue
        for sid, rates in per_sample.items():
            if name not in rates:
                continue
            k, n = rates[name]
            if n and k / n < rate / 2 and binom_cdf(k, n, rate) < OUTLIER_P:
                info["failing"] += 1
                failures.setdefault(sid, []).append(f"{name}: {k}/{n} = {k / n:.2f} vs the store's {rate:.2f}")
    return report, failures


# ---------------------------------------------------------------------------------------------
# absolute checks and the driver


def _batches(sample_ids: list[str], lengths: dict[str, int], budget: int) -> list[list[str]]:
    """Consecutive runs of samples of about `budget` tokens (a longer sample goes alone)."""
    out: list[list[str]] = []
    total = 0
    for sid in sample_ids:
        if not out or total + lengths[sid] > budget:
            out.append([])
            total = 0
        out[-1].append(sid)
        total += lengths[sid]
    return out


def prefix_groups(ids_by_sample: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, list[str]]]:
    """Group samples by first token; each group's prefix = its members' longest common prefix,
    capped at PREFIX_MAX tokens (PREFIX_MIN for a sample alone in its group)."""
    by_first: dict[int, list[str]] = {}
    for sid, ids in ids_by_sample.items():
        by_first.setdefault(int(ids[0]), []).append(sid)
    groups = []
    for sids in by_first.values():
        cap = PREFIX_MAX if len(sids) > 1 else PREFIX_MIN
        first = ids_by_sample[sids[0]]
        p = min(cap, min(ids_by_sample[s].shape[0] for s in sids))
        for s in sids[1:]:
            other = ids_by_sample[s]
            diff = (first[:p] != other[:p]).nonzero()
            if len(diff):
                p = int(diff[0])
        groups.append((first[: max(p, 1)].clone(), sids))
    return groups


def run_invariants(
    reader,
    split,
    parts: TargetParts,
    *,
    sample_ids: list[str],
    prefix_tol: float,
    tail_tol: float,
    progress_bar=None,
    batch_tokens: int = BATCH_TOKENS,
    packed_tail: bool | None = None,
) -> dict[str, Any]:
    """Every invariant on every sample in `sample_ids`; returns the summary with per-sample failures.

    Samples go in batches of about `batch_tokens` tokens: one host -> device copy of their stored
    states, one packed tail forward (`packed_tail`: None = on an accelerator wherever
    `packed_tail_kernel` allows it, True = there even on CPU, False = one Hugging Face forward per
    sample, the reference path), and one device -> host copy of
    every per-token result, so a GPU is not stalled once per sample and per check."""
    layer_ids = reader.aux_layer_ids
    device = next(parts.model.parameters()).device
    samples = {sid: split[split.index_of(sid)] for sid in sample_ids}
    ids_by_sample = {sid: x.input_ids for sid, x in samples.items()}
    prefix_ref = _prefix_references(parts, ids_by_sample, layer_ids, device)
    high = max(layer_ids)
    kernel, packed_why = _tail_path(parts, packed_tail, device)
    sweep = _Sweep(
        reader=reader,
        parts=parts,
        device=device,
        samples=samples,
        ids_by_sample=ids_by_sample,
        prefix_ref=prefix_ref,
        names=[f"layer {i}" for i in layer_ids] + ["final"],
        high=high,
        high_slot=layer_ids.index(high),
        kernel=kernel,
        # bf16 stores cross to the device as stored (half the bytes; exact in fp32 either side), others as fp32
        read_dtype=torch.bfloat16 if reader.dtype == "bf16" else torch.float32,
        scale_D=None if parts.norm_scale_D is None else parts.norm_scale_D.float().to(device),
        prefix_tol=prefix_tol,
        tail_tol=tail_tol,
        laps=_Laps(sync=torch.cuda.synchronize if device.type == "cuda" else (lambda: None)),
    )
    sweep.laps.lap("prefix")
    for batch in _batches(sample_ids, {s: ids_by_sample[s].shape[0] for s in sample_ids}, batch_tokens):
        sweep.check_batch(batch)
        if progress_bar is not None:
            progress_bar.update(len(batch))
    rate_report, rate_failures = judge_rates(sweep.rates)
    for sid, msgs in rate_failures.items():
        sweep.failures.setdefault(sid, []).extend(msgs)
    return sweep.summary(sample_ids, rate_report, packed_why)


def _prefix_references(
    parts: TargetParts, ids_by_sample: dict[str, torch.Tensor], layer_ids: list[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """Per sample, the reference states [P, L, D] of its group's shared prefix, one recompute (one tensor) per group."""
    from eyas.target import reference_hidden_states

    prefix_ref: dict[str, torch.Tensor] = {}
    for prefix, sids in prefix_groups(ids_by_sample):
        aux, final = reference_hidden_states(parts.model, prefix.to(device), layer_ids=layer_ids)
        ref = torch.cat([aux, final.unsqueeze(1)], dim=1).float().cpu()
        for s in sids:
            prefix_ref[s] = ref
    return prefix_ref


def _tail_path(parts: TargetParts, packed_tail: bool | None, device: torch.device) -> tuple[str | None, str]:
    """(the packed tail's varlen kernel, or None for one forward per sample; why not packed) for run_invariants."""
    if packed_tail is None and device.type == "cpu":
        # on a CPU the few tail layers are compute-bound: the per-sample forward (the reference path) costs what the packed row does
        kernel, packed_why = None, "on CPU the per-sample forward is as fast"
    elif packed_tail is False:
        kernel, packed_why = None, "not asked for"
    else:
        kernel, packed_why = packed_tail_kernel(parts)
    if packed_tail and kernel is None:
        raise ValueError(f"packed_tail=True but the packed tail cannot run: {packed_why}")
    return kernel, packed_why


@dataclass
class _Laps:
    """Seconds spent per check of run_invariants."""

    sync: Callable[[], Any]
    seconds: dict[str, float] = field(
        default_factory=lambda: {"prefix": 0.0, "tail": 0.0, "final_norm": 0.0, "rates": 0.0, "read": 0.0}
    )
    clock: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        # Synchronised, so that a check's device work is charged to it and not to the next host sync.
        self.sync()
        now = time.perf_counter()
        self.seconds[name] += now - self.clock
        self.clock = now


@dataclass(kw_only=True)
class _Sweep:
    """One run_invariants pass over the store: what every batch needs, and what the batches found so far."""

    reader: Any
    parts: TargetParts
    device: torch.device
    samples: dict[str, Any]
    ids_by_sample: dict[str, torch.Tensor]
    prefix_ref: dict[str, torch.Tensor]
    names: list[str]
    """Display names of the stored slots: the aux layers, then the final state."""
    high: int
    high_slot: int
    kernel: str | None
    read_dtype: torch.dtype
    scale_D: torch.Tensor | None
    prefix_tol: float
    tail_tol: float
    laps: _Laps
    rates: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    worst: dict[str, tuple[float, str | None, str]] = field(
        default_factory=lambda: {"prefix": (0.0, None, ""), "tail": (0.0, None, "")}
    )
    final_norm_worst: tuple[float, str | None] = (1.0, None)

    def check_batch(self, batch: list[str]) -> None:
        """Every invariant on one batch of samples, the rates counted for judge_rates."""
        lengths = [self.ids_by_sample[sid].shape[0] for sid in batch]
        hs = [self.reader.get_hidden(sid, self.read_dtype) for sid in batch]  # [T, L, D] each
        h_NLD = _to_device(torch.cat(hs), self.device).float()
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        fails: dict[str, list[str]] = {sid: [] for sid in batch}
        self.laps.lap("read")
        self.check_prefix(batch, hs, fails)
        self.laps.lap("prefix")
        host, counts = self.on_device(batch, h_NLD, lengths, bounds)
        self.judge(batch, bounds, host, counts, fails)

    def check_prefix(self, batch: list[str], hs: list[torch.Tensor], fails: dict[str, list[str]]) -> None:
        """Each sample's first rows against its group's recomputed shared prefix."""
        for sid, h in zip(batch, hs):
            ref = self.prefix_ref[sid]
            err = rel_err_TL(h[: ref.shape[0]], ref)
            e, flat = float(err.max()), int(err.argmax())
            t, slot = divmod(flat, err.shape[1])
            if e > self.worst["prefix"][0]:
                self.worst["prefix"] = (e, sid, f"{self.names[slot]}, token {t}")
            if not e <= self.prefix_tol:
                fails[sid].append(
                    f"prefix: {self.names[slot]} token {t} differs from the recomputed shared prefix "
                    f"({ref.shape[0]} tokens) by {e:.3g} > {self.prefix_tol:g}"
                )

    def on_device(
        self, batch: list[str], h_NLD: torch.Tensor, lengths: list[int], bounds: list[int]
    ) -> tuple[dict[str, torch.Tensor], list[tuple[list[str], list[torch.Tensor], list[int]]]]:
        """Per-token results of the whole batch (tail errors, final rms, rate pass counts), computed on the
        device and moved to the host at once; with each sample's `_rate_counts`."""
        parts = self.parts
        on_device: dict[str, torch.Tensor] = {}
        if parts.tail_ok is None:
            if self.kernel is not None:
                derived_ND = tail_final_packed(
                    parts, h_NLD[:, self.high_slot], lengths, first_layer=self.high, kernel=self.kernel
                )
            else:
                ids_d = _to_device(torch.cat([self.ids_by_sample[sid] for sid in batch]), self.device)
                derived_ND = torch.cat(
                    [
                        tail_final(parts, ids_d[a:b], h_NLD[a:b, self.high_slot], first_layer=self.high)
                        for a, b in zip(bounds[:-1], bounds[1:])
                    ]
                )
            on_device["tail"] = rel_err_TL(h_NLD[:, -1:], derived_ND[:, None])[:, 0]
            self.laps.lap("tail")
        if self.scale_D is not None:
            on_device["rms"] = (h_NLD[:, -1] / self.scale_D).pow(2).mean(-1).sqrt()
            self.laps.lap("final_norm")
        counts = [
            _rate_counts(
                parts,
                self.ids_by_sample[sid],
                h_NLD[a:b],
                slot_names=self.names,
                sample_key=sid,
                start=self.prefix_ref[sid].shape[0],
                answer_T=self.samples[sid].loss_mask,
            )
            for sid, a, b in zip(batch, bounds[:-1], bounds[1:])
        ]
        passed = [k for _, ks, _ in counts for k in ks]
        if passed:
            on_device["passed"] = torch.stack(passed)
        host = {k: v.cpu() for k, v in on_device.items()}
        self.laps.lap("rates")
        return host, counts

    def judge(
        self,
        batch: list[str],
        bounds: list[int],
        host: dict[str, torch.Tensor],
        counts: list[tuple[list[str], list[torch.Tensor], list[int]]],
        fails: dict[str, list[str]],
    ) -> None:
        """The tail and final_norm verdicts of each sample from the host copy, its rate counts kept, its failures recorded."""
        passed_host = iter(host["passed"].tolist() if "passed" in host else [])
        for sid, a, b, (rate_names, _, totals) in zip(batch, bounds[:-1], bounds[1:], counts):
            if "tail" in host:
                err = host["tail"][a:b]
                e, t = float(err.max()), int(err.argmax())
                if e > self.worst["tail"][0]:
                    self.worst["tail"] = (e, sid, f"token {t}")
                if not e <= self.tail_tol:
                    fails[sid].append(
                        f"tail: final at token {t} differs from norm(layers {self.high}..{self.parts.num_layers - 1}"
                        f"({self.names[self.high_slot]})) by {e:.3g} > {self.tail_tol:g}"
                    )
            if "rms" in host:
                med = float(host["rms"][a:b].median())
                if abs(med - 1) > abs(self.final_norm_worst[0] - 1):
                    self.final_norm_worst = (med, sid)
                lo, hi = FINAL_NORM_RANGE
                if not lo <= med <= hi:
                    fails[sid].append(
                        f"final_norm: median rms(final / norm scale) is {med:.3g}, outside [{lo}, {hi}] "
                        "(a post-norm state has ~1): the final slot is not the final norm's output"
                    )
            self.rates[sid] = {n: (next(passed_host), tot) for n, tot in zip(rate_names, totals)}
            if fails[sid]:
                self.failures[sid] = fails[sid]

    def summary(self, sample_ids: list[str], rate_report: dict[str, dict[str, Any]], packed_why: str) -> dict[str, Any]:
        """run_invariants' summary, once every batch is checked and the rates judged."""
        parts, worst, failures = self.parts, self.worst, self.failures
        return {
            "ok": not failures,
            "checked": len(sample_ids),
            "tokens": int(sum(x.shape[0] for x in self.ids_by_sample.values())),
            "prefix": {
                "tolerance": self.prefix_tol,
                "groups": len({id(v) for v in self.prefix_ref.values()}),
                "worst_rel_err": worst["prefix"][0],
                "worst_sample": worst["prefix"][1],
                "where": worst["prefix"][2],
            },
            "tail": (
                {"skipped": parts.tail_ok}
                if parts.tail_ok
                else {
                    "tolerance": self.tail_tol,
                    "layers": f"{self.high}..{parts.num_layers - 1}",
                    "worst_rel_err": worst["tail"][0],
                    "worst_sample": worst["tail"][1],
                    "where": worst["tail"][2],
                }
            ),
            "final_norm": (
                {"skipped": "the final norm is not RMS-like"}
                if parts.norm_scale_D is None
                else {
                    "range": list(FINAL_NORM_RANGE),
                    "worst_median_rms": self.final_norm_worst[0],
                    "worst_sample": self.final_norm_worst[1],
                }
            ),
            "rates": rate_report,
            "tail_path": "not run"
            if parts.tail_ok
            else (f"packed ({self.kernel})" if self.kernel else f"per sample ({packed_why})"),
            "seconds": {k: round(v, 4) for k, v in self.laps.seconds.items()},
            "failing_samples": sorted(failures),
            "failures": failures,
        }


# ---------------------------------------------------------------------------------------------
# layer ids


def layer_ids_problem(reader, split, model, *, tokens: int = 32) -> str | None:
    """Why the store's aux slots cannot be the layers its manifest names, else None: the first `tokens` tokens of
    its shortest sample recomputed with every layer's state, and a slot whose rows match another layer within
    tolerance while missing the named one contradicts the manifest (an edit to aux_layer_ids, even with its
    checksum updated). States that match no layer are the numbers check's to judge (verify), not this."""
    from eyas.store.verify import default_tolerance

    if not len(reader):
        return None
    sid = min(reader.sample_ids, key=lambda s: reader.record(s)["tokens"])
    n = min(tokens, int(reader.record(sid)["tokens"]))
    device = next(model.parameters()).device
    ids_T = split[split.index_of(sid)].input_ids[:n].to(device)
    with torch.no_grad():
        hs = model(input_ids=ids_T[None], output_hidden_states=True, use_cache=False).hidden_states
    ref_LTD = torch.stack([h[0] for h in hs[:-1]]).float().cpu()  # (the last entry is post-norm: not a layer input)
    stored_TLD = reader.get_hidden(sid, torch.float32)[:n]
    tol = default_tolerance(reader.dtype, reader.manifest.get("model_dtype"))
    for slot, named in enumerate(reader.aux_layer_ids):
        err_L = torch.stack(
            [rel_err_TL(stored_TLD[:, slot : slot + 1], ref_LTD[i][:, None]).max() for i in range(len(ref_LTD))]
        )
        best = int(err_L.argmin())
        if best != named and float(err_L[best]) <= tol and not (named < len(err_L) and float(err_L[named]) <= tol):
            return (
                f"store {reader.path}: aux slot {slot} is listed as layer {named} in manifest.json, but its states are "
                f"layer {best}'s (sample {sid}, relative error {float(err_L[best]):.2g}): the manifest's layer ids "
                "were changed after capture; restore them or capture again"
            )
    return None
