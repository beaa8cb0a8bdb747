"""One fused Triton kernel for the per-chunk soft cross-entropy of the drafter's head loss.

What it computes, per row n of a chunk (student logits s [c, V], teacher logits t [c, V], row
weights w [c], teacher top-1 draft ids top [c]) -- the contract of `eyas.drafter.ttt.head_loss._chunk_ce`:

    lse_s = log sum_v exp(s_v)          lse_t = log sum_v exp(t_v)          p_v = exp(t_v - lse_t)
    CE_n  = lse_s - sum_v p_v s_v       hit_n = (argmax_v s_v == top_n)     (first index of the max)
    g_nv  = (exp(s_v - lse_s) - p_v) * w_n                                   (in s's dtype)

and returns (sum_n w_n CE_n as an fp32 scalar, hits [c] bool, g [c, V]); with `rank_topk` K also
below_n = (#{v : s_v > s_top_n} < K), the head loss's reachability test (the teacher's top token among the
drafter's top K), counted in pass 1 instead of in a pass over s of its own. With `t_rows` ([c] int64)
the teacher row of chunk row n is t[t_rows[n]] of a whole table t [N, V]: the head loss keeps the
teacher's logits for a packed row and its chunks pick rows of it, which the kernel then reads in
place instead of reading a gathered copy (an index_select writes and re-reads a [c, V] copy per
chunk per TTT step, a visible share of a training step's GPU time).

Why a kernel: at V = 32000 this is pure memory traffic (a handful of flops per element), and the
compiled torch version reads s and t from HBM several times (max, sum-exp, the p*s sum, argmax,
then once more for g). Here one program owns one row and makes two passes over it, back to back:
pass 1 streams s and t in blocks of BLOCK_V keeping online (rescaled as the max moves) max and
sum-exp of s and of t, sum_v exp(t_v - m_t) s_v, and the running argmax of s; pass 2 reads the row
again, last block first (the blocks read last are the likeliest to still be in L2), and writes g.
With BLOCK_V >= V (block_v=32768 for a 32,000-token vocab) the row is one block held in registers
(spread over the program's warps): s and t are read from HBM exactly once and there is no pass 2.
The HBM traffic is between one and two reads of s and t plus one write of g: how much of a row
survives in L2 depends on how many rows are in flight (block size and warps set that; the
benchmark, benchmarks/ce_kernel_bench.py, compares a few; BLOCK_V=2048 with 4 warps was the fastest measured).
Everything accumulates in fp32. Per-row
w_n CE_n are written to an fp32 [c] vector and summed by torch (deterministic).

With `t_lse`, the teacher's log-sum-exp per row given in fp32 (indexed like t: the head loss makes it once a
training step for its kept teacher table and uses it in every TTT step), pass 1
reads s only (max, sum-exp, argmax and the rank count of s), and pass 2 reads s and t once, writes
g = (exp(s - lse_s) - exp(t - t_lse)) * w and sums exp(t - t_lse) * s on the way; CE_W is stored after pass 2.
That is one of the five [c, V] streams less (two reads of s, one of t, one write of g). The whole-row mode uses
the given log-sum-exp instead of the teacher's max and sum-exp.

Triton is imported on first use, so machines without it (CPU CI) still import eyas; the kernel also
runs on CPU under Triton's interpreter when TRITON_INTERPRET=1 is set before triton is imported
(the tests do that in a child process). The training loop picks this kernel only after
`eyas.drafter.ttt.head_loss` has checked it against the torch version on the device (`eyas.kernels`: `ce`).

Shape legend: c rows of the chunk, V draft vocab, N rows of a teacher table (indexed mode).
"""

from __future__ import annotations

import os

import torch

BLOCK_V = int(os.environ.get("EYAS_CE_BLOCK", 2048))
"""Vocabulary entries per block of a pass (a power of two; V need not be a multiple of it).
EYAS_CE_BLOCK overrides it (read at import), e.g. 32768 to hold a 32,000-token row whole."""
NUM_WARPS = int(os.environ.get("EYAS_CE_WARPS", 4))
"""Warps per program (one program per row); EYAS_CE_WARPS overrides it."""

_STATE: dict[str, object] = {}  # "error": why triton is unusable, "kernels": the jitted kernel


def _kernel():
    """The jitted kernel, building it (and importing triton) on first use; None when triton is unusable."""
    from eyas.common import built_triton_kernels

    return built_triton_kernels(_STATE, _build)


def _build(triton, tl):
    """The kernel, given the imported triton and triton.language."""

    @triton.jit
    def _soft_ce_rows(
        S,
        T,
        T_ROWS,
        T_LSE,
        W,
        TOP,
        G,
        CE_W,
        HIT,
        BELOW,
        V,
        TOPK,
        s_row,
        t_row,
        g_row,
        BLOCK: tl.constexpr,
        INDEXED: tl.constexpr,
        ONE_BLOCK: tl.constexpr,
        RANK: tl.constexpr,
        TLSE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride may pass 2**31 for big tables
        if INDEXED:  # noqa: SIM108 (a compile-time switch: the plain mode never touches T_ROWS)
            t_at = tl.load(T_ROWS + row).to(tl.int64)  # the teacher table's row for this chunk row
        else:
            t_at = row
        s_ptr, t_ptr, g_ptr = S + row * s_row, T + t_at * t_row, G + row * g_row
        offs = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        if TLSE:  # the teacher's log-sum-exp is given (indexed like T): pass 1 never reads t
            lse_t = tl.load(T_LSE + t_at).to(tl.float32)
        if RANK:  # the logit of token TOP (clamped into the row), for the count of the logits above it
            top_at = tl.minimum(tl.maximum(tl.load(TOP + row).to(tl.int64), 0), V - 1)
            s_top = tl.load(s_ptr + top_at).to(tl.float32)
        if ONE_BLOCK:  # BLOCK >= V: the whole row stays in registers, s and t are read once
            ok = offs < V
            s0 = tl.load(s_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            s = tl.where(ok, s0, neg_inf)
            t = tl.load(t_ptr + offs, mask=ok, other=neg_inf).to(tl.float32)
            m_s = tl.max(s, 0)
            best_i = tl.min(tl.where(s == m_s, offs, V), 0)
            e_s = tl.exp(s - m_s)
            l_s = tl.sum(e_s, 0)
            if TLSE:
                p = tl.exp(t - lse_t)  # 0 on masked entries
                a_t = tl.sum(p * s0, 0)
            else:
                m_t = tl.max(t, 0)
                e_t = tl.exp(t - m_t)
                l_t = tl.sum(e_t, 0)
                a_t = tl.sum(e_t * s0, 0) / l_t
                p = e_t / l_t
            w = tl.load(W + row).to(tl.float32)
            tl.store(CE_W + row, (m_s + tl.log(l_s) - a_t) * w)
            tl.store(HIT + row, (best_i.to(tl.int64) == tl.load(TOP + row).to(tl.int64)).to(tl.int8))
            if RANK:  # (masked entries are -inf: never above)
                tl.store(BELOW + row, (tl.sum((s > s_top).to(tl.int32), 0) < TOPK).to(tl.int8))
            g = (e_s / l_s - p) * w
            tl.store(g_ptr + offs, g.to(G.dtype.element_ty), mask=ok)
            return
        # pass 1: online max / sum-exp of s and its first argmax; without TLSE also online max / sum-exp of t and
        # sum exp(t - m_t) * s
        m_s = tl.full((), neg_inf, tl.float32)
        l_s = tl.zeros((), tl.float32)
        if not TLSE:
            m_t = tl.full((), neg_inf, tl.float32)
            l_t = tl.zeros((), tl.float32)
            a_t = tl.zeros((), tl.float32)
        best = tl.full((), neg_inf, tl.float32)
        best_i = tl.zeros((), tl.int32)
        above = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            ok = idx < V
            s0 = tl.load(s_ptr + idx, mask=ok, other=0.0).to(tl.float32)  # 0 where masked: for the p*s sum
            s = tl.where(ok, s0, neg_inf)  # -inf where masked: for max, sum-exp and argmax
            # argmax: the first index holding the block's max; a later block wins only if strictly larger
            bmax = tl.max(s, 0)
            bidx = tl.min(tl.where(s == bmax, idx, V), 0)
            take = bmax > best
            if RANK:
                above += tl.sum((s > s_top).to(tl.int32), 0)
            best_i = tl.where(take, bidx, best_i)
            best = tl.where(take, bmax, best)
            # every block holds at least one valid entry, so the new maxima are finite from block 1 on
            ms_new = tl.maximum(m_s, bmax)
            l_s = l_s * tl.exp(m_s - ms_new) + tl.sum(tl.exp(s - ms_new), 0)
            m_s = ms_new
            if not TLSE:
                t = tl.load(t_ptr + idx, mask=ok, other=neg_inf).to(tl.float32)
                mt_new = tl.maximum(m_t, tl.max(t, 0))
                scale = tl.exp(m_t - mt_new)
                e_t = tl.exp(t - mt_new)  # 0 on masked entries
                l_t = l_t * scale + tl.sum(e_t, 0)
                a_t = a_t * scale + tl.sum(e_t * s0, 0)
                m_t = mt_new
        lse_s = m_s + tl.log(l_s)
        w = tl.load(W + row).to(tl.float32)
        if not TLSE:
            lse_t = m_t + tl.log(l_t)
            tl.store(CE_W + row, (lse_s - a_t / l_t) * w)
        tl.store(HIT + row, (best_i.to(tl.int64) == tl.load(TOP + row).to(tl.int64)).to(tl.int8))
        if RANK:
            tl.store(BELOW + row, (above < TOPK).to(tl.int8))
        # pass 2: the same row again, g = (softmax(s) - softmax(t)) * w (with TLSE also sum p * s, for CE_W), last
        # block first: the blocks pass 1 read last are the likeliest to still be in L2
        if TLSE:
            a_p = tl.zeros((), tl.float32)
        n_blocks = tl.cdiv(V, BLOCK)
        for i in range(0, n_blocks):
            idx = (n_blocks - 1 - i) * BLOCK + offs
            ok = idx < V
            s = tl.load(s_ptr + idx, mask=ok, other=0.0).to(tl.float32)
            t = tl.load(t_ptr + idx, mask=ok, other=neg_inf).to(tl.float32)
            p = tl.exp(t - lse_t)  # 0 on masked entries
            g = (tl.exp(s - lse_s) - p) * w
            tl.store(g_ptr + idx, g.to(G.dtype.element_ty), mask=ok)
            if TLSE:
                a_p += tl.sum(p * s, 0)
        if TLSE:
            tl.store(CE_W + row, (lse_s - a_p) * w)

    return _soft_ce_rows


def kernel_unavailable(device: torch.device) -> str | None:
    """None when the kernel can run on `device`; else why not (a sentence for a log line)."""
    from eyas.common import triton_kernel_unavailable

    return triton_kernel_unavailable(_kernel(), device, import_error=_STATE.get("error"))


def fused_chunk_ce(
    s: torch.Tensor,
    t: torch.Tensor,
    w: torch.Tensor,
    top: torch.Tensor,
    *,
    t_rows: torch.Tensor | None = None,
    t_lse: torch.Tensor | None = None,
    rank_topk: int | None = None,
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, ...]:
    """(sum_n w_n CE_n fp32 scalar, hits [c] bool, g [c, V] in s's dtype): `_chunk_ce` in one launch.
    With `rank_topk` K, a fourth output: [c] bool, fewer than K logits of row n above the one of token top[n]
    (`eyas.drafter.ttt.head_loss.top_rank_below`, the head loss's reachability test), counted in the same pass over s
    instead of a pass of its own.

    s: [c, V] float; t: [c, V] float, or with `t_rows` [c] integer a table [N, V] whose row
    t_rows[n] is the teacher of row n (`_chunk_ce(s, t[t_rows], w, top)` without the copy; ids may
    repeat and come in any order; they are not bounds-checked, which would cost a host sync). `t_lse`:
    fp32 log-sum-exp of each row of t ([N] with `t_rows`, else [c]), taken as given: p_v = exp(t_v - t_lse),
    and the first pass reads s only. Any float dtypes; rows may be strided, entries must be contiguous.
    w: [c] weights; top: [c] integer ids. No host syncs."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError(f"fused_chunk_ce: triton is not importable ({_STATE['error']})")
    c, V = s.shape
    t_shape = (t.shape[0] if t_rows is not None else c, V)
    assert t.dim() == 2 and t.shape == t_shape and w.shape == (c,) and top.shape == (c,), (
        s.shape,
        t.shape,
        w.shape,
        top.shape,
    )
    if t_rows is not None:
        assert t_rows.shape == (c,) and not t_rows.is_floating_point(), (t_rows.shape, t_rows.dtype)
        t_rows = t_rows.contiguous()
    if t_lse is not None:
        assert t_lse.shape == t_shape[:1] and t_lse.dtype == torch.float32, (t_lse.shape, t_lse.dtype)
        t_lse = t_lse.contiguous()
    assert block_v & (block_v - 1) == 0, f"block_v={block_v} must be a power of two"
    s = s if s.stride(-1) == 1 else s.contiguous()
    t = t if t.stride(-1) == 1 else t.contiguous()
    w = w.contiguous()
    top = top.contiguous()
    g = torch.empty((c, V), dtype=s.dtype, device=s.device)
    ce_w = torch.empty(c, dtype=torch.float32, device=s.device)
    hit = torch.empty(c, dtype=torch.int8, device=s.device)
    below = torch.empty(c, dtype=torch.int8, device=s.device) if rank_topk is not None else hit
    if c > 0:
        # placeholder pointers the kernel never reads: T_ROWS without t_rows, T_LSE without t_lse, BELOW without
        # rank_topk
        kernel[(c,)](
            s,
            t,
            top if t_rows is None else t_rows,
            ce_w if t_lse is None else t_lse,
            w,
            top,
            g,
            ce_w,
            hit,
            below,
            V,
            int(rank_topk or 0),
            s.stride(0),
            t.stride(0),
            g.stride(0),
            BLOCK=block_v,
            INDEXED=t_rows is not None,
            ONE_BLOCK=block_v >= V,
            RANK=rank_topk is not None,
            TLSE=t_lse is not None,
            num_warps=num_warps,
        )
    if rank_topk is not None:
        return ce_w.sum(), hit.view(torch.bool), g, below.view(torch.bool)
    return ce_w.sum(), hit.view(torch.bool), g


# ----------------------------------------------------------------------------------------------
# the teacher table's row statistics (`eyas.kernels`: teacher_stats)

_STATS_STATE: dict[str, object] = {}  # as _STATE, for the row statistics kernel


def _stats_kernel():
    from eyas.common import built_triton_kernels

    return built_triton_kernels(_STATS_STATE, _build_stats)


def _build_stats(triton, tl):
    """The row statistics kernel, given the imported triton and triton.language."""

    @triton.jit
    def _row_max_lse(X, MAX, ARG, LSE, V, x_row, BLOCK: tl.constexpr):
        # one program per row, one pass in blocks of BLOCK: online max (rescaling the sum-exp as it moves), the
        # first index of the max (a later block takes over only when its max is strictly larger), fp32 throughout
        row = tl.program_id(0).to(tl.int64)
        x_ptr = X + row * x_row
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)  # noqa: E741
        best = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, idx, V), 0)
            new_m = tl.maximum(m, bm)
            l = l * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)  # noqa: E741
            best = tl.where(bm > m, bi, best)
            m = new_m
        tl.store(MAX + row, m.to(MAX.dtype.element_ty))  # (the max of the row's values: exact in their dtype)
        tl.store(ARG + row, best.to(tl.int64))
        tl.store(LSE + row, m + tl.log(l))

    return _row_max_lse


def stats_unavailable(device: torch.device) -> str | None:
    """None when `row_max_lse`'s kernel can run on `device`; else why not (a sentence for a log line)."""
    from eyas.common import triton_kernel_unavailable

    return triton_kernel_unavailable(_stats_kernel(), device, import_error=_STATS_STATE.get("error"))


def row_max_lse(
    x: torch.Tensor, *, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max [n] in x's dtype, first index of the max [n] int64, fp32 log-sum-exp [n]) of each row of x [n, V] in one
    read of it: `eyas.drafter.ttt.teacher._teacher_max_lse` (x.max(-1) and logsumexp(x.float(), -1)) as one launch.
    Rows may be strided, entries must be contiguous. No host syncs."""
    kernel = _stats_kernel()
    if kernel is None:
        raise RuntimeError(f"row_max_lse: triton is not importable ({_STATS_STATE['error']})")
    assert x.dim() == 2 and x.is_floating_point(), (x.shape, x.dtype)
    assert block_v & (block_v - 1) == 0, f"block_v={block_v} must be a power of two"
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, V = x.shape
    top_max = torch.empty(n, dtype=x.dtype, device=x.device)
    top = torch.empty(n, dtype=torch.int64, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n > 0:
        kernel[(n,)](x, top_max, top, lse, V, x.stride(0), BLOCK=block_v, num_warps=num_warps)
    return top_max, top, lse
