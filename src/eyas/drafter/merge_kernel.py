"""Triton kernels for the TTT attention's merge of the diagonal keys (`eyas.drafter.ttt._merge_fwd` / `_merge_bwd`).

What they compute, per query row r of head h (q [B, H, T, d], the causal step-0 attention's output out_c and fp32
log-sum-exp lse_c, and J diagonal keys and values k_j, v_j [B, H, T, d], one per earlier TTT step):

    s_j = scale * q . k_j           lse = log(exp(lse_c) + sum_j exp(s_j))
    out = exp(lse_c - lse) * out_c + sum_j exp(s_j - lse) * v_j

and, given the merged out and lse, the output gradient dout and the causal keys' share dq_c of dq (the flash
backward run with the merged out and lse):

    p_j = exp(s_j - lse)     D = dout . out     ds_j = p_j * (dout . v_j - D) * scale
    dq = dq_c + sum_j ds_j k_j          dk_j = ds_j q          dv_j = p_j dout

Why kernels: this is pure memory traffic (a few flops per loaded number); the torch version leaves it to inductor's
fusion of its pieces (per-diagonal products, a stack of the scores, a log-sum-exp, weighted sums). Here one program
owns BLOCK_T rows of one head and reads each input once and writes each output once: the forward keeps an online
max and sum-exp across the J diagonals (the causal part enters as one more "key" with logit lse_c and value out_c),
the backward recomputes the scores from q and k_j. All math in fp32; outputs in the inputs' dtypes.

Limits (else `merge_unsupported` says why and the caller keeps the torch version): the diagonals repeated to the
query heads (K = H, ttt.GROUPED_DIAGONALS off), 1 <= J <= MAX_J, the last dimension contiguous, every k_j with the
strides and dtype of k_1 (and every v_j with those of v_1). Triton is imported on first use; on CPU the kernels run
under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported; the tests do that in a child process).
`eyas.drafter.ttt` uses them under its TRITON_MERGE setting after a start-up check against the torch version.

Shape legend: B batch (1 for a packed row), H query heads, T rows (all positions, or the `rows` subset), d head dim,
J diagonals.
"""

from __future__ import annotations

import torch

MAX_J = 6
"""Diagonals one launch takes (TTT 7: steps 1-6 add 1-6 diagonals)."""
BLOCK_T = 32
"""Rows a program owns. At 32 rows of a 64-wide head and 4 warps, ptxas (sm_90, Triton 3.9, strides specialized as
multiples of 16 as real launches are) gives the forward 64 registers and the backward 96, no spills; at 64 rows
127 and 168."""
NUM_WARPS = 4

_STATE: dict[str, object] = {}  # "error": why triton is unusable, "kernels": (forward, backward)


def _kernels():
    """(forward, backward) jitted kernels, built (and triton imported) on first use; None when triton is unusable."""
    from eyas.common import built_triton_kernels

    return built_triton_kernels(_STATE, _build)


def _build(triton, tl):
    """The two kernels (and their jitted helpers), given the imported triton and triton.language."""

    @triton.jit
    def _select(j, P1, P2, P3, P4, P5, P6):
        """Pointer argument j (0-based, a runtime value) of six."""
        p = tl.where(j == 1, P2, P1)
        p = tl.where(j == 2, P3, p)
        p = tl.where(j == 3, P4, p)
        p = tl.where(j == 4, P5, p)
        return tl.where(j == 5, P6, p)

    @triton.jit
    def _rows(T, H, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's batch b and head h, its BLOCK rows t, the head dims dd, the rows' mask, the tiles' mask."""
        bh = tl.program_id(1)
        t = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)
        tm = t < T
        return (bh // H).to(tl.int64), (bh % H).to(tl.int64), t, dd, tm, tm[:, None] & (dd < D)[None, :]

    @triton.jit
    def _tile(P, b, h, t, dd, s_b, s_h, s_t, mask):
        """The [BLOCK, BLOCK_D] tile of rows t of head h of batch b of a [B, H, T, d] tensor, in fp32."""
        return tl.load(P + b * s_b + h * s_h + t[:, None] * s_t + dd[None, :], mask=mask, other=0.0).to(tl.float32)

    # jitted helpers are looked up by name among the module's globals
    globals().update(_select=_select, _rows=_rows, _tile=_tile, tl=tl)

    @triton.jit
    def _merge_fwd_rows(Q, K1, K2, K3, K4, K5, K6, V1, V2, V3, V4, V5, V6, OC, LC, OUT, LSE, T, H, scale,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, sl_b, sl_h, sl_t,
                        su_b, su_h, su_t, se_b, se_h, se_t, J,
                        D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        b, h, t, dd, tm, m2 = _rows(T, H, D, BLOCK, BLOCK_D)
        q = _tile(Q, b, h, t, dd, sq_b, sq_h, sq_t, m2)
        m = tl.load(LC + b * sl_b + h * sl_h + t * sl_t, mask=tm, other=0.0).to(tl.float32)
        acc = _tile(OC, b, h, t, dd, so_b, so_h, so_t, m2)
        l_sum = tl.full([BLOCK], 1.0, tl.float32)  # the causal part: exp(lse_c - m) with m = lse_c
        for j in range(J):  # a loop over a runtime count, not unrolled: one diagonal's k and v live at a time
            kp = _select(j, K1, K2, K3, K4, K5, K6)
            vp = _select(j, V1, V2, V3, V4, V5, V6)
            s = tl.sum(q * _tile(kp, b, h, t, dd, sk_b, sk_h, sk_t, m2), 1) * scale
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = _tile(vp, b, h, t, dd, sv_b, sv_h, sv_t, m2)
            acc = acc * alpha[:, None] + p[:, None] * v
            l_sum = l_sum * alpha + p
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(OUT + b * su_b + h * su_h + t[:, None] * su_t + dd[None, :], out.to(OUT.dtype.element_ty), mask=m2)
        tl.store(LSE + b * se_b + h * se_h + t * se_t, m + tl.log(l_sum), mask=tm)

    @triton.jit
    def _merge_bwd_rows(Q, K1, K2, K3, K4, K5, K6, V1, V2, V3, V4, V5, V6, O, LSE, DO, DQC, DQ,
                        DK1, DK2, DK3, DK4, DK5, DK6, DV1, DV2, DV3, DV4, DV5, DV6, T, H, scale,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, se_b, se_h, se_t,
                        sd_b, sd_h, sd_t, sc_b, sc_h, sc_t, sg_b, sg_h, sg_t, sw_b, sw_h, sw_t, J,
                        D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        b, h, t, dd, tm, m2 = _rows(T, H, D, BLOCK, BLOCK_D)
        q = _tile(Q, b, h, t, dd, sq_b, sq_h, sq_t, m2)
        do = _tile(DO, b, h, t, dd, sd_b, sd_h, sd_t, m2)
        lse = tl.load(LSE + b * se_b + h * se_h + t * se_t, mask=tm, other=0.0).to(tl.float32)
        delta = tl.sum(do * _tile(O, b, h, t, dd, so_b, so_h, so_t, m2), 1)
        dq = _tile(DQC, b, h, t, dd, sc_b, sc_h, sc_t, m2)
        for j in range(J):  # (as in the forward)
            kp = _select(j, K1, K2, K3, K4, K5, K6)
            vp = _select(j, V1, V2, V3, V4, V5, V6)
            dkp = _select(j, DK1, DK2, DK3, DK4, DK5, DK6)
            dvp = _select(j, DV1, DV2, DV3, DV4, DV5, DV6)
            k = _tile(kp, b, h, t, dd, sk_b, sk_h, sk_t, m2)
            v = _tile(vp, b, h, t, dd, sv_b, sv_h, sv_t, m2)
            p = tl.exp(tl.sum(q * k, 1) * scale - lse)
            ds = p * (tl.sum(do * v, 1) - delta) * scale
            dq += ds[:, None] * k
            at = b * sw_b + h * sw_h + t[:, None] * sw_t + dd[None, :]  # dk_j and dv_j: one layout, k's shape
            tl.store(dkp + at, (ds[:, None] * q).to(dkp.dtype.element_ty), mask=m2)
            tl.store(dvp + at, (p[:, None] * do).to(dvp.dtype.element_ty), mask=m2)
        tl.store(DQ + b * sg_b + h * sg_h + t[:, None] * sg_t + dd[None, :], dq.to(DQ.dtype.element_ty), mask=m2)

    return _merge_fwd_rows, _merge_bwd_rows


def kernel_unavailable(device: torch.device) -> str | None:
    """None when the kernels can run on `device`; else why not (a sentence for a log line)."""
    from eyas.common import triton_kernel_unavailable

    ks = _kernels()
    return triton_kernel_unavailable(ks[0] if ks else None, device, import_error=_STATE.get("error"))


def merge_unsupported(q: torch.Tensor, kds: list[torch.Tensor], vds: list[torch.Tensor]) -> str | None:
    """None when the kernels take these inputs (see the module's limits); else why not."""
    J = len(kds)
    if not 1 <= J <= MAX_J or len(vds) != J:
        return f"{J} diagonals (the kernels take 1 to {MAX_J})"
    if kds[0].shape != q.shape:
        return f"diagonal keys of shape {tuple(kds[0].shape)} against queries {tuple(q.shape)} (grouped diagonals)"
    for xs in (kds, vds):
        if any(x.shape != q.shape or x.stride() != xs[0].stride() or x.dtype != xs[0].dtype for x in xs):
            return "diagonals of different shapes, strides or dtypes"
    if any(x.stride(-1) != 1 for x in (q, kds[0], vds[0])):
        return "a last dimension that is not contiguous"
    return None


def _bht(x: torch.Tensor) -> tuple[int, int, int]:
    """Strides of dims 0-2 of a [B, H, T, d] tensor (or of a [B, H, T] one)."""
    return x.stride(0), x.stride(1), x.stride(2)


def _grid(q: torch.Tensor, block_t: int) -> tuple[int, int]:
    B, H, T, _ = q.shape
    return ((T + block_t - 1) // block_t, B * H)


def _launchable(name: str, q: torch.Tensor, kds: list[torch.Tensor], vds: list[torch.Tensor]):
    """The kernels, for inputs they take (`merge_unsupported`); else an error naming the caller."""
    ks = _kernels()
    if ks is None:
        raise RuntimeError(f"{name}: triton is not importable ({_STATE['error']})")
    why = merge_unsupported(q, kds, vds)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    return ks


def _six(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The J tensors padded to six pointer arguments with the first one (never read past J)."""
    return list(xs) + [xs[0]] * (MAX_J - len(xs))


def merge_fwd(q, kds, vds, out_c, lse_c32, scale: float, *, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS):
    """(out in q's dtype [B, H, T, d], fp32 lse [B, H, T]): `eyas.drafter.ttt._merge_fwd` in one launch. q, out_c
    [B, H, T, d] (any strides but a contiguous last dim), lse_c32 [B, H, T] fp32; kds, vds: lists of J [B, H, T, d]."""
    ks = _launchable("merge_fwd", q, kds, vds)
    B, H, T, d = q.shape
    out_c = out_c if out_c.stride(-1) == 1 else out_c.contiguous()
    out = torch.empty((B, H, T, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if T > 0:
        ks[0][_grid(q, block_t)](q, *_six(kds), *_six(vds), out_c, lse_c32, out, lse, T, H, float(scale),
                                 *_bht(q), *_bht(kds[0]), *_bht(vds[0]), *_bht(out_c), *_bht(lse_c32), *_bht(out),
                                 *_bht(lse), len(kds), D=d, BLOCK=block_t, BLOCK_D=triton_pow2(d),
                                 num_warps=num_warps)
    return out, lse


def merge_bwd(q, kds, vds, out, lse, dout, dq_c, scale: float, *, block_t: int = BLOCK_T,
              num_warps: int = NUM_WARPS):
    """(dq in q's dtype, [dk_j] in k's dtype, [dv_j] in v's dtype): `eyas.drafter.ttt._merge_bwd` in one launch.
    out: the merged output, lse its fp32 log-sum-exp [B, H, T], dout its gradient, dq_c the causal keys' share."""
    ks = _launchable("merge_bwd", q, kds, vds)
    B, H, T, d = q.shape
    out, dout, dq_c = (x if x.stride(-1) == 1 else x.contiguous() for x in (out, dout, dq_c))
    dq = torch.empty((B, H, T, d), dtype=q.dtype, device=q.device)
    dks = [torch.empty((B, H, T, d), dtype=k.dtype, device=q.device) for k in kds]
    dvs = [torch.empty((B, H, T, d), dtype=v.dtype, device=q.device) for v in vds]
    if T > 0:
        ks[1][_grid(q, block_t)](q, *_six(kds), *_six(vds), out, lse, dout, dq_c, dq, *_six(dks), *_six(dvs), T, H,
                                 float(scale), *_bht(q), *_bht(kds[0]), *_bht(vds[0]), *_bht(out), *_bht(lse),
                                 *_bht(dout), *_bht(dq_c), *_bht(dq), *_bht(dks[0]), len(kds), D=d, BLOCK=block_t,
                                 BLOCK_D=triton_pow2(d), num_warps=num_warps)
    return dq, dks, dvs


def triton_pow2(n: int) -> int:
    """The smallest power of two >= n (a Triton block's length)."""
    return 1 << max(0, (int(n) - 1).bit_length())
