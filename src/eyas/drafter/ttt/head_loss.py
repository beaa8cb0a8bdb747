"""The draft head's soft cross-entropy -sum_v p(v) log q(v) against the teacher, chunked.

The head's [rows x vocab] logits exist for `chunk_rows` rows at a time: forward and backward are done chunk by chunk
inside one autograd Function (`_HeadSoftCE`), so peak memory grows with tokens x hidden, not tokens x vocab. Each
chunk's CE, top-1 hits and logit gradient come from one fused Triton kernel on CUDA (`eyas.drafter.ce_kernel`, after
a start-up check against `_chunk_ce`; EYAS_KERNELS=ce:off forces the compiled torch version), else from `_chunk_ce`.
Where the teacher's logits are kept for the whole packed row, the kernel reads each chunk's teacher rows from that
table through an index vector; the torch version gathers them first.
"""

from __future__ import annotations

import functools
import itertools

import torch

from eyas import kernels
from eyas.drafter import ce_kernel as CE
from eyas.drafter.ttt.compiled import _fast
from eyas.drafter.ttt.teacher import _teacher_lse


def soft_ce(logits_BnV: torch.Tensor, probs_BnV: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log softmax(logits)(v), per position (fp32)."""
    return -(probs_BnV * torch.log_softmax(logits_BnV.float(), -1)).sum(-1)


def _chunk_ce(s, t, w, top, t_lse=None):
    """Per chunk of rows: (sum_n w_n CE_n, top-1 hits, dCE/ds) from student logits s and teacher
    logits t ([c, V], any float dtype); the gradient comes back in s's dtype. `t_lse` [c] (the fused kernel's
    contract, for its start-up check): the teacher's probabilities are exp(t - t_lse) instead of softmax(t)."""
    s32, t32 = s.float(), t.float()
    p = torch.softmax(t32, -1) if t_lse is None else torch.exp(t32 - t_lse[:, None])
    lse = torch.logsumexp(s32, -1)
    ce = lse - (p * s32).sum(-1)
    g = (torch.exp(s32 - lse[:, None]) - p) * w[:, None]
    return (ce * w).sum(), s32.argmax(-1) == top, g.to(s.dtype)


def _gathering(chunk):
    """`chunk(s, t, w, top)` with the signature of `fused_chunk_ce`: given `t_rows`, t is a table
    [N, V] and its rows t_rows are gathered into a [c, V] copy first (outside any compiled graph)."""

    @functools.wraps(chunk)
    def call(s, t, w, top, *, t_rows=None):
        return chunk(s, t if t_rows is None else t.index_select(0, t_rows), w, top)

    return call


def chunk_ce_for(device: torch.device, s_dtype: torch.dtype, t_dtype: torch.dtype):
    """The per-chunk CE to use for logits of these dtypes on `device`, decided once per process:
    `fused_chunk_ce` (one Triton kernel, two passes per row) where it runs and agrees with
    `_chunk_ce` on a random chunk (kernels: `ce`), else `_chunk_ce` (compiled on CUDA) behind `_gathering`. Either
    is called as f(s, t, w, top, t_rows=None). Where the kernel runs it also takes the teacher's log-sum-exp (`t_lse`)
    and counts the reachability test (`rank_topk`) in its pass over the student logits."""
    if kernels.use("ce", device, s_dtype, t_dtype):
        return CE.fused_chunk_ce
    return _gathering(_fast(_chunk_ce, device))


@torch.no_grad()
def check_fused_chunk_ce(
    device: torch.device, s_dtype: torch.dtype, t_dtype: torch.dtype, *, rows: int = 64, vocab: int = 32000
) -> str | None:
    """None when `fused_chunk_ce` equals `_chunk_ce` (eager) on a random chunk on `device`, with the
    teacher given as a [rows, V] tensor and as rows `t_rows` of a larger table; else why not.
    Logits ~ N(0, 3) like a trained head's; weights in [0, 1) with a zero row; half of the `top`
    ids are the argmax (hits), and row 0 holds its maximum twice (a hit only at the first index).
    The table has more rows than the chunk and a row stride wider than V; `t_rows` is out of order
    and repeats ids, so a kernel that ignores it, or reads row n for row n, fails. Also with the
    teacher's log-sum-exp given (`t_lse`: the rank cases too), and once with it moved by 0.5 (against `_chunk_ce`
    given the same), so a kernel that ignores it, or reads it at the chunk's row instead of the table's, fails. Also the rank
    the kernel counts for the reachability test."""
    why = CE.kernel_unavailable(device)
    if why is not None:
        return why
    g = torch.Generator(device="cpu").manual_seed(0)
    s = (3 * torch.randn(rows, vocab, generator=g)).to(s_dtype)
    wide = torch.zeros(rows + 7, vocab + 16, dtype=t_dtype)
    wide[:, :vocab] = (3 * torch.randn(rows + 7, vocab, generator=g)).to(t_dtype)
    t_rows = torch.randperm(rows + 7, generator=g)[:rows]
    t_rows[1::3] = t_rows[0]  # repeated ids
    t = wide[t_rows, :vocab]  # [rows, V], contiguous
    s[0, 7] = s[0, vocab - 3] = s[0].max() + 1  # a tie at the maximum
    w = torch.rand(rows, generator=g)
    w[1] = 0.0
    top = s.float().argmax(-1)
    top[2::2] = torch.randint(0, vocab, (len(range(2, rows, 2)),), generator=g)  # row 0 keeps its argmax
    s, t, wide, t_rows, w, top = (x.to(device) for x in (s, t, wide, t_rows, w, top))
    table = wide[:, :vocab]  # [rows + 7, V] with row stride V + 16 (sliced on the device: .to would pack it)
    ref = _chunk_ce(s, t, w, top)
    by_index = {"t_rows": t_rows}
    cases = [("", (s, t, w, top), {}, ref), (" (teacher rows by index)", (s, table, w, top), by_index, ref)]
    # the teacher's log-sum-exp given (the rank cases below get it too), and given moved by 0.5
    table_lse = _teacher_lse(table)
    by_index = {"t_rows": t_rows, "t_lse": table_lse}
    moved = table_lse + 0.5
    cases += [
        (" (teacher log-sum-exp given)", (s, t, w, top), {"t_lse": table_lse[t_rows]}, ref),
        (" (teacher rows by index, log-sum-exp given)", (s, table, w, top), by_index, ref),
        (
            " (teacher rows by index, log-sum-exp moved by 0.5)",
            (s, table, w, top),
            {"t_rows": t_rows, "t_lse": moved},
            _chunk_ce(s, t, w, top, moved[t_rows]),
        ),
    ]
    # the rank counted in the kernel, for K = 1 (the argmax, or tied with it) and for K at and one past row 2's rank
    # (its token random: some row sits on each side of each boundary)
    r2 = max(1, int((s[2] > s[2, top[2]]).sum()))
    cases += [(f" (top-{k} rank)", (s, table, w, top), {**by_index, "rank_topk": k}, ref) for k in (1, r2, r2 + 1)]
    for mode, args, kw, expect in cases:
        try:
            out = CE.fused_chunk_ce(*args, **kw)
        except Exception as exc:  # noqa: BLE001  (compile or launch failure)
            return f"the Triton kernel{mode} failed: {type(exc).__name__}: {str(exc)[:300]}"
        why = _chunk_ce_differs(out[:3], expect, s_dtype)
        if why is None and "rank_topk" in kw:
            want = top_rank_below(s, top, kw["rank_topk"])
            if out[3].dtype != torch.bool or not torch.equal(out[3], want):
                why = f"the top-K test differs in {int((out[3] != want).sum())} of {rows} rows"
        if why is not None:
            return f"the Triton kernel{mode}: {why}"
    return None


def _chunk_ce_differs(out, ref, s_dtype: torch.dtype) -> str | None:
    """None when a chunk CE result (ce, hits, g) matches the reference `_chunk_ce`'s; else how not."""
    (ce, hits, grad), (ce_r, hits_r, grad_r) = out, ref
    if grad.dtype != grad_r.dtype or grad.shape != grad_r.shape or hits.dtype != torch.bool:
        return f"returned g {grad.dtype} {tuple(grad.shape)}, hits {hits.dtype}"
    if not torch.equal(hits, hits_r):
        return f"top-1 hits differ in {int((hits != hits_r).sum())} of {hits_r.numel()} rows"
    ce_err = abs(ce.item() - ce_r.item())
    if not ce_err <= 1e-4 * max(1.0, abs(ce_r.item())):
        return f"loss differs ({ce.item():.6g} vs {ce_r.item():.6g})"
    # bf16 g: the two round fp32 values that may differ in the last bits, so allow one bf16 ulp
    rtol = 1e-4 if s_dtype == torch.float32 else 2**-7
    bad = (grad.float() - grad_r.float()).abs() > 1e-7 + rtol * grad_r.float().abs()
    if bad.any():
        err = (grad.float() - grad_r.float()).abs().max().item()
        return f"gradient differs in {int(bad.sum())} entries (max error {err:.3g})"
    return None


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 `acc`. With a and b in 16 bits the product is summed into `acc` inside the
    matmul (`addmm` with out_dtype fp32) where the backend has it and it passed its check (kernels: `addmm_fp32`);
    else through an fp32 copy of the product (one [M, N] cast and one addition more per call, one per TTT step)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif kernels.use("addmm_fp32", acc.device, a.dtype):
        _addmm_in_fp32(acc, a, b)
    else:
        _addmm_by_copy(acc, a, b)


def _addmm_in_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _addmm_by_copy(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc += (a @ b).float()


@torch.no_grad()
def check_addmm_fp32(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `addmm(acc, a, b, out_dtype=fp32, out=acc)` runs on `device` for `dtype` inputs and sums
    into `acc` in place as the plain fp32 computation does (a transposed `a`, as the head passes it); else why not."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(48, 64, generator=g).to(device, dtype).T
    b = torch.randn(48, 32, generator=g).to(device, dtype)
    acc = torch.randn(64, 32, generator=g).to(device)
    want = acc + a.float() @ b.float()
    try:
        _addmm_in_fp32(acc, a, b)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"addmm with an fp32 output failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None if torch.allclose(acc, want, rtol=1e-4, atol=1e-4) else "addmm with an fp32 output sums differently"


class _HeadSoftCE(torch.autograd.Function):
    """sum_n w_n * CE(softmax(teacher_n), softmax(x_n W^T)), gradients computed chunk by chunk in
    the forward (the loss is linear in its upstream gradient, so backward only scales them).
    Teacher logits: rows `t_idx` of the table `t_src` [N, V] when `wt_VD` is None, else
    `t_src` [n, D] (or its rows `t_idx`) @ wt_VD.T recomputed per chunk. `bounds`: row ranges (a, b) covering the rows in
    order; chunks never cross one, and the per-range sums come back as a third output (detached):
    several TTT steps share ONE call, so the head's weight gradient is summed in a single fp32
    buffer instead of one [V, D] buffer per step, each scaled and added into `.grad` on its own.
    `groups` (recomputed teacher only; `teacher_groups`): the work ordered by teacher rows instead, each
    group's teacher logits computed once for the slices of every range that read them.
    `align` (pos_n, n_positions, K) (TTTConfig.align_topk): row n is position pos_n[n] of range i's step; its
    weight is kept only while every earlier range's row at the same position had the teacher's top token among
    its top K logits. Both orders of the work handle a position's ranges in order (step k's teacher row t+1+k
    follows step k-1's t+k), so each chunk's mask is known before its gradients are made.
    `t_lse` (a table's only, else None): fp32 log-sum-exp of each row of `t_src`, handed to the fused kernel (the
    groups make their own)."""

    @staticmethod
    def forward(
        ctx,
        x_nD,
        w_VD,
        t_src,
        wt_VD,
        t_idx,
        t_lse,
        weight_n,
        top_n,
        chunk_rows,
        compute_dtype,
        bounds,
        groups,
        align=None,
    ):
        with torch.autocast(x_nD.device.type, enabled=False):
            need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            xb, wb = x_nD.to(compute_dtype), w_VD.to(compute_dtype)
            wtb = wt_VD.to(compute_dtype) if wt_VD is not None else None
            n = x_nD.shape[0]
            sums = torch.zeros(len(bounds), dtype=torch.float32, device=x_nD.device)
            hits = torch.zeros(n, dtype=torch.bool, device=x_nD.device)
            dx = torch.empty_like(xb) if need and ctx.needs_input_grad[0] else None
            dw = (
                torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
                if need and ctx.needs_input_grad[1]
                else None
            )
            t_dtype = t_src.dtype if wt_VD is None else compute_dtype  # a kept table, else recomputed
            chunk = chunk_ce_for(x_nD.device, compute_dtype, t_dtype)
            fused = chunk is CE.fused_chunk_ce  # (the torch version takes neither t_lse nor rank_topk)
            wf = weight_n.float()
            if align is not None:
                pos_n, n_positions, topk = align
                alive = torch.ones(n_positions, dtype=torch.float32, device=x_nD.device)
                rank_below = _fast(top_rank_below, x_nD.device)

            # student rows a:b of range i against teacher logits t (rows t_rows of it); `lse`: the log-sum-exp of
            # each row of t, for the fused kernel
            def rows(i, a, b, t, t_rows, lse=None):
                s = xb[a:b] @ wb.T  # student logits [c, V]
                w = wf[a:b]
                kw = {"t_rows": t_rows} if lse is None else {"t_rows": t_rows, "t_lse": lse}
                if align is None:
                    ce, hit, g = chunk(s, t, w, top_n[a:b], **kw)
                else:  # this chunk's weights by the earlier ranges' tests; its own test marks the later ranges'
                    pos = pos_n[a:b]
                    w = w * alive[pos]
                    if fused:
                        ce, hit, g, below = chunk(s, t, w, top_n[a:b], rank_topk=topk, **kw)
                    else:  # (the test before the kernel, which may overwrite s)
                        below = rank_below(s, top_n[a:b], topk)
                        ce, hit, g = chunk(s, t, w, top_n[a:b], **kw)
                    alive[pos] = alive[pos] * (below & (wf[a:b] > 0))  # out of the draft vocab: never reached
                sums[i] += ce
                hits[a:b] = hit
                if dx is not None:
                    dx[a:b] = g @ wb
                if dw is not None:
                    addmm_fp32_(dw, g.T, xb[a:b])

            if groups is not None:
                lse_of = _fast(_teacher_lse, x_nD.device) if fused else None
                for t_lo, t_hi, slices in groups:
                    t = t_src[t_lo:t_hi].to(compute_dtype) @ wtb.T  # [t_hi - t_lo, V], once for every range
                    lse = lse_of(t) if lse_of is not None else None  # one read of t, for the slices of every range
                    for i, a, b in slices:
                        rows(i, a, b, t, t_idx[a:b] - t_lo, lse)
            else:
                for i, (lo, hi) in enumerate(bounds):
                    for a in range(lo, hi, chunk_rows):
                        b = min(hi, a + chunk_rows)
                        if wtb is None:  # the whole table and this chunk's row ids: the kernel reads it in place
                            rows(i, a, b, t_src, t_idx[a:b], t_lse if fused else None)
                        else:  # rows of the final states (all of t_src, or rows t_idx of it) times the target head
                            f = t_src[a:b] if t_idx is None else t_src.index_select(0, t_idx[a:b])
                            rows(i, a, b, f.to(compute_dtype) @ wtb.T, None)
            ctx.save_for_backward(*(t for t in (dx, dw) if t is not None))
            ctx.has = (dx is not None, dw is not None)
            ctx.dtypes = (x_nD.dtype, w_VD.dtype)
            per_range = sums.detach().clone()
            ctx.mark_non_differentiable(hits, per_range)
            return sums.sum(), per_range, hits

    @staticmethod
    def backward(ctx, g_total, g_ranges, g_hits):
        saved = list(ctx.saved_tensors)
        dx = saved.pop(0).mul(g_total).to(ctx.dtypes[0]) if ctx.has[0] else None
        dw = saved.pop(0).mul_(g_total).to(ctx.dtypes[1]) if ctx.has[1] else None
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None


def teacher_groups(t_idx: torch.Tensor, lengths: list[int], n_teacher: int, chunk_rows: int):
    """The work of a recomputed-teacher head call ordered by teacher rows (the K steps read nearly the same teacher
    rows, so each group's [rows x D] @ [D x V] product is made once for all of them, not once a step): ((t_lo, t_hi, ((range, a, b), ...)),
    ...) with teacher rows [t_lo, t_hi) at most `chunk_rows` of them, and for each range (TTT step) the
    slice a:b of its rows whose teacher rows lie there. Needs every range's `t_idx` ascending and without
    repeats (then a slice has at most `chunk_rows` rows); None when one is not (or there is nothing to do).
    One device-to-host read of [ranges x groups] boundaries."""
    edges = torch.arange(0, n_teacher + chunk_rows, chunk_rows, device=t_idx.device).clamp_max(n_teacher)
    parts = t_idx.split([int(n) for n in lengths])
    ok = [(p[1:] > p[:-1]).all() for p in parts if p.numel() > 1]
    cuts = [torch.searchsorted(p, edges) for p in parts]
    flat = torch.cat([torch.stack(ok).all().reshape(1).long() if ok else edges.new_ones(1), *cuts]).tolist()
    if not flat[0]:
        return None
    G = edges.numel()
    starts = list(itertools.accumulate((int(n) for n in lengths), initial=0))
    groups = []
    for g in range(G - 1):
        t_lo, t_hi = g * chunk_rows, min(n_teacher, (g + 1) * chunk_rows)
        slices = []
        for i in range(len(parts)):
            a, b = flat[1 + i * G + g], flat[1 + i * G + g + 1]
            if b > a:
                slices.append((i, starts[i] + a, starts[i] + b))
        if slices:
            groups.append((t_lo, t_hi, tuple(slices)))
    if sum(b - a for *_, slices in groups for _, a, b in slices) != starts[-1]:
        return None  # a teacher row outside [0, n_teacher): the per-range path (which would fail on it loudly)
    return tuple(groups) or None


def head_soft_ce(
    x_nD: torch.Tensor,
    w_VD: torch.Tensor,
    f_nD: torch.Tensor | None,
    wt_VD: torch.Tensor | None,
    weight_n: torch.Tensor,
    top_n: torch.Tensor,
    *,
    chunk_rows: int = 4096,
    compute_dtype: torch.dtype | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted soft CE, top-1 hits [n]) of the draft head over rows x (already normed)
    against the teacher logits f @ wt.T (or rows `teacher_rows` of a `teacher_logits` table),
    never holding more than `chunk_rows` x V logits."""
    total, _, hits = head_soft_ce_ranges(
        x_nD,
        w_VD,
        f_nD,
        wt_VD,
        weight_n,
        top_n,
        [x_nD.shape[0]],
        chunk_rows=chunk_rows,
        compute_dtype=compute_dtype,
        teacher_logits=teacher_logits,
        teacher_rows=teacher_rows,
    )
    return total, hits


def head_soft_ce_ranges(
    x_nD: torch.Tensor,
    w_VD: torch.Tensor,
    f_nD: torch.Tensor | None,
    wt_VD: torch.Tensor | None,
    weight_n: torch.Tensor,
    top_n: torch.Tensor,
    lengths: list[int],
    *,
    chunk_rows: int = 4096,
    compute_dtype: torch.dtype | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
    align: tuple | None = None,
    teacher_lse: torch.Tensor | None = None,
):
    """`head_soft_ce` over consecutive row ranges of the given `lengths` (e.g. the TTT steps) in one
    call -> (total, [len(lengths)] per-range sums (detached), hits [n]). With `f_nD` and `wt_VD`,
    `teacher_rows` (optional) picks row n's final state from f (no [n, D] copy of them). `align`:
    (positions of the rows, number of positions, K), `_HeadSoftCE`'s reachability mask. `teacher_lse`: fp32
    log-sum-exp of each row of `teacher_logits` (PackedTeacher.lse_N), for the fused kernel."""
    if compute_dtype is None:
        dev = x_nD.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_nD.dtype
    ends = list(itertools.accumulate((int(n) for n in lengths), initial=0))
    if ends[-1] != x_nD.shape[0]:
        raise ValueError(f"head_soft_ce_ranges: lengths sum to {ends[-1]}, x has {x_nD.shape[0]} rows")
    bounds = tuple(zip(ends[:-1], ends[1:]))
    if teacher_logits is not None:
        return _HeadSoftCE.apply(
            x_nD,
            w_VD,
            teacher_logits,
            None,
            teacher_rows,
            teacher_lse,
            weight_n,
            top_n,
            chunk_rows,
            compute_dtype,
            bounds,
            None,
            align,
        )
    groups = None
    if teacher_rows is not None and len(lengths) > 1:
        groups = teacher_groups(teacher_rows, lengths, f_nD.shape[0], chunk_rows)
    return _HeadSoftCE.apply(
        x_nD, w_VD, f_nD, wt_VD, teacher_rows, None, weight_n, top_n, chunk_rows, compute_dtype, bounds, groups, align
    )


def reference_head_soft_ce(x_nD, w_VD, f_nD, wt_VD, weight_n):
    """The plain version of `head_soft_ce`: whole [n, V] logits in fp32 (tests)."""
    s = x_nD.float() @ w_VD.float().T
    p = torch.softmax(f_nD.float() @ wt_VD.float().T, -1)
    return (soft_ce(s, p) * weight_n.float()).sum()


def top_rank_below(s_cV: torch.Tensor, top_c: torch.Tensor, topk: int) -> torch.Tensor:
    """[c] bool: fewer than `topk` logits of each row of s_cV above the one of token `top_c` (that token among the
    row's top `topk`; ties count for it). Compiled on CUDA (`_fast`): one pass over the logits."""
    s_top = s_cV.gather(1, top_c[:, None].clamp(0, s_cV.shape[1] - 1))
    return (s_cV > s_top).sum(1) < topk
