"""Attention of TTT step k: a query at position t reads the step-0 keys at positions <= t (causal, within its sample
on a packed row) plus the keys of steps 1..k at position t only (one diagonal per step), under ONE softmax.

- `reference_attention`: a dense bool mask over [T, (k+1)T] keys (simple, O(k T^2) memory).
- `fast_attention`: flash attention over the step-0 keys (causal) returning its log-sum-exp, plus the k diagonal
  scores as row-wise dot products, merged by one logsumexp. Backward runs the flash backward with the MERGED output
  and log-sum-exp (the split-KV identity), so no T x T (let alone T x T x steps) tensor is ever built. CUDA uses
  aten's flash kernels, CPU its flash kernel; `check_fast_attention` compares against the reference on the current
  device.

docs/ttt.md draws the mask of step k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eyas.drafter.model import repeat_kv
from eyas.drafter.ttt.compiled import _fast


def reference_attention(q_BHTd, keys, values, *, seg=None, rows=None) -> torch.Tensor:
    """Dense-mask reference. keys/values: lists of [B, K, T, d] (K key/value heads, K divides H;
    each shared by H/K query heads), index 0 causal (within each segment of a packed row when `seg`
    is given), the rest diagonal. `rows`: as `fast_attention` (the queries and diagonals at those positions)."""
    if rows is not None:
        T = keys[0].shape[2]
        q_BHTd = _scatter_rows(q_BHTd, rows, T)
        keys = keys[:1] + [_scatter_rows(k, rows, T) for k in keys[1:]]
        values = values[:1] + [_scatter_rows(v, rows, T) for v in values[1:]]
        return reference_attention(q_BHTd, keys, values, seg=seg).index_select(2, rows)
    H = q_BHTd.shape[1]
    keys, values = [repeat_kv(k, H // k.shape[1]) for k in keys], [repeat_kv(v, H // v.shape[1]) for v in values]
    T = q_BHTd.shape[2]
    dev = q_BHTd.device
    if seg is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    else:
        from eyas.packing import segment_causal_mask

        causal = segment_causal_mask(seg, dev)
    blocks = [causal]
    blocks += [torch.eye(T, dtype=torch.bool, device=dev)] * (len(keys) - 1)
    mask = torch.cat(blocks, dim=1)
    return F.scaled_dot_product_attention(q_BHTd, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)


def _math_fwd(q, k, v, scale):
    """Dense fp32 causal attention: the packed math kernel with one segment per row."""
    from eyas.packing import Segments, math_fwd

    return math_fwd(q, k, v, scale, Segments.from_lengths([q.shape[2]], q.device))


def _math_bwd(dout, q, k, v, out, lse, scale, aux):
    from eyas.packing import Segments, math_bwd

    return math_bwd(dout, q, k, v, out, lse, scale, Segments.from_lengths([q.shape[2]], q.device), aux)


def _cpu_flash_fwd(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def _cpu_flash_bwd(dout, q, k, v, out, lse, scale, aux):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


def _cuda_flash_fwd(q, k, v, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused = res[:8]
    return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)


def _cuda_flash_bwd(dout, q, k, v, out, lse, scale, aux):
    cum_q, cum_k, max_q, max_k, rng_state, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng_state, unused, scale=scale
    )


KERNELS = {
    "math": (_math_fwd, _math_bwd),
    "cpu-flash": (_cpu_flash_fwd, _cpu_flash_bwd),
    "cuda-flash": (_cuda_flash_fwd, _cuda_flash_bwd),
}


def pick_kernel(q: torch.Tensor) -> str:
    if q.device.type == "cuda":
        ok = q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        return "cuda-flash" if ok else "math"
    if q.device.type == "cpu":
        return "cpu-flash"
    return "math"


def _grouped(x_BHTd: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, d] -> [B, K, H/K, T, d]: query head h reads key/value head h // (H/K) (repeat_kv's order)."""
    B, H, T, d = x_BHTd.shape
    return x_BHTd.reshape(B, kv_heads, H // kv_heads, T, d)


class _CausalPlusDiagonals(torch.autograd.Function):
    """out = softmax over [causal step-0 keys | J diagonal keys] without materialising T x T. The J diagonals
    come one tensor each, kv = (k_1, ..., k_J, v_1, ..., v_J) of [B, K, T, d] (J may be 0): never
    stacked, so no step copies the earlier steps' keys and values again.

    `rows` (or None): q and the diagonals hold only these n of the T positions (sorted), the step-0 keys all T.
    The causal kernel runs on a [T] query whose other rows are zero (their output is dropped, and a zero query
    with a zero output gradient adds nothing to the keys' gradients), and the merge runs on the n rows."""

    @staticmethod
    def forward(ctx, q, k0, v0, kernel, scale, seg, rows, *kv):
        with torch.autocast(q.device.type, enabled=False):  # the merge must stay in fp32
            fwd, _ = _kernel_pair(kernel, seg)
            T = k0.shape[2]
            q_all = q if rows is None else _scatter_rows(q, rows, T)
            out_c, lse_c, aux = fwd(q_all, k0, v0, scale)
            lse_c32 = lse_c[..., :T].float()  # some kernels pad the lse's last dim
            if rows is not None:
                out_c, lse_c32 = out_c.index_select(2, rows), lse_c32.index_select(2, rows)
            J = len(kv) // 2
            if J:
                kds, vds = list(kv[:J]), list(kv[J:])
                out, lse = _merges(q, kds, vds)[0](q, kds, vds, out_c, lse_c32, scale)
            else:
                out, lse = out_c, lse_c32
            lse_k = lse_c.clone()
            if rows is None:
                lse_k[..., :T] = lse.to(lse_c.dtype)
                out_all = out
            else:  # the flash backward reads the merged out/lse at all T rows (the others' are never used)
                lse_k.index_copy_(2, rows, lse.to(lse_c.dtype))
                out_all = _scatter_rows(out, rows, T)
            ctx.save_for_backward(q_all, k0, v0, out_all, lse_k, *([] if rows is None else [rows]), *kv)
            ctx.kernel, ctx.scale, ctx.aux, ctx.seg, ctx.subset = kernel, scale, aux, seg, rows is not None
            return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            q, k0, v0, out, lse_k, *kv = ctx.saved_tensors
            rows = kv.pop(0) if ctx.subset else None
            _, bwd = _kernel_pair(ctx.kernel, ctx.seg)
            dout = dout.to(q.dtype)
            T = k0.shape[2]
            dout_all = dout.contiguous() if rows is None else _scatter_rows(dout, rows, T)
            # flash backward with the MERGED out/lse gives the causal keys' share of the joint softmax
            dq, dk0, dv0 = bwd(dout_all, q, k0, v0, out, lse_k, ctx.scale, ctx.aux)
            lse = lse_k[..., :T]
            if rows is not None:
                q, out, lse, dq = (x.index_select(2, rows) for x in (q, out, lse, dq))
            J = len(kv) // 2
            if not J:
                return dq, dk0, dv0, None, None, None, None
            kds, vds = list(kv[:J]), list(kv[J:])
            dq, dk, dv = _merges(q, kds, vds)[1](q, kds, vds, out, lse, dout, dq, ctx.scale)
            return dq, dk0, dv0, None, None, None, None, *dk, *dv


def _scatter_rows(x_BHnd: torch.Tensor, rows: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, n, d] at positions `rows` -> [B, H, T, d], zero elsewhere, laid out [B, T, H, d] in memory (as the
    varlen kernels read it: no copy there)."""
    B, H, _, d = x_BHnd.shape
    out = x_BHnd.new_zeros(B, T, H, d)
    return out.index_copy_(1, rows, x_BHnd.transpose(1, 2)).transpose(1, 2)


def _merge_fwd(q, kds, vds, out_c, lse_c32, scale: float):
    """Merge J diagonal keys into the causal attention's (out, lse) under one softmax (fp32 math). kds/vds: lists
    of J [B, K, T, d], K key/value heads each shared by H/K query heads (never repeated)."""
    B, H, T, d = q.shape
    K = kds[0].shape[1]
    qg = _grouped(q.float(), K)  # B,K,G,T,d
    s = torch.stack([(qg * k.float()[:, :, None]).sum(-1) for k in kds], -1) * scale  # B,K,G,T,J
    s = s.reshape(B, H, T, -1)
    lse = torch.logsumexp(torch.cat([lse_c32[..., None], s], -1), -1)
    p = _grouped(torch.exp(s - lse[..., None]), K)  # B,K,G,T,J
    pv = sum(p[..., j, None] * v.float()[:, :, None] for j, v in enumerate(vds)).reshape(B, H, T, d)
    out = torch.exp(lse_c32 - lse)[..., None] * out_c.float() + pv
    return out.to(q.dtype), lse


def _merge_bwd(q, kds, vds, out, lse, dout, dq_c, scale: float):
    """Gradients through the diagonal keys, (dq, [dk_j], [dv_j]); dq_c is the causal keys' share from the flash
    backward. dk_j/dv_j sum the H/K query heads that share each key/value head."""
    B, H, T, d = q.shape
    K = kds[0].shape[1]
    qf, do = _grouped(q.float(), K), _grouped(dout.float(), K)  # B,K,G,T,d
    s = torch.stack([(qf * k.float()[:, :, None]).sum(-1) for k in kds], -1) * scale  # B,K,G,T,J
    p = torch.exp(s - _grouped(lse.float()[..., None], K))
    D = (do * _grouped(out.float(), K)).sum(-1, keepdim=True)
    dp = torch.stack([(do * v.float()[:, :, None]).sum(-1) for v in vds], -1)
    ds = p * (dp - D) * scale
    dq = _grouped(dq_c.float(), K) + sum(ds[..., j, None] * k.float()[:, :, None] for j, k in enumerate(kds))
    dks = [(ds[..., j, None] * qf).sum(2).to(k.dtype) for j, k in enumerate(kds)]
    dvs = [(p[..., j, None] * do).sum(2).to(v.dtype) for j, v in enumerate(vds)]
    return dq.reshape(B, H, T, d).to(q.dtype), dks, dvs


def _merges(q: torch.Tensor, kds: list[torch.Tensor], vds: list[torch.Tensor]):
    """(forward, backward) of the merge of the diagonal keys: the torch version, compiled on CUDA."""
    return _fast(_merge_fwd, q.device), _fast(_merge_bwd, q.device)


def _kernel_pair(kernel: str, seg):
    """(fwd, bwd) of the step-0 attention: dense rows, or a packed row (`seg`: packing.Segments)."""
    if seg is None:
        return KERNELS[kernel]
    from eyas.packing import VARLEN_KERNELS

    fwd, bwd = VARLEN_KERNELS[kernel]
    return (
        lambda q, k, v, scale: fwd(q, k, v, scale, seg),
        lambda dout, q, k, v, out, lse, scale, aux: bwd(dout, q, k, v, out, lse, scale, seg, aux),
    )


def _step_keys(x_BKTd: torch.Tensor, heads: int, *, packed_step0: bool = False) -> torch.Tensor:
    """One step's keys or values as the unrolls keep them: repeated to the query heads, unless, for a packed row's
    step 0, the varlen flash kernel reads them grouped (packing.gqa_flash: the same test `fast_attention` makes, so
    they are repeated here once or never)."""
    from eyas.packing import gqa_flash, pick_varlen_kernel

    if packed_step0 and gqa_flash(pick_varlen_kernel(x_BKTd), x_BKTd):
        return x_BKTd
    return repeat_kv(x_BKTd, heads // x_BKTd.shape[1])


def fast_attention(q_BHTd, keys, values, *, kernel: str | None = None, seg=None, rows=None) -> torch.Tensor:
    """Same result as `reference_attention`, O(T) extra memory per diagonal. With `seg` (a packed
    row, B = 1) the step-0 keys are causal within each segment. With `rows` (sorted positions, n of the
    T), the queries and the diagonal keys/values hold those n positions only; the step-0 keys all T.
    keys/values: [B, K, T, d], K dividing H (K = H once repeated, as the unrolls keep them); the step-0 ones are
    repeated to the H query heads for the flash kernels (unless the varlen one reads them grouped: packing.gqa_flash),
    the others always."""
    from eyas.packing import gqa_flash, pick_varlen_kernel

    if kernel is None:
        kernel = pick_varlen_kernel(q_BHTd) if seg is not None else pick_kernel(q_BHTd)
    if rows is not None and seg is None:
        raise ValueError("fast_attention: rows= needs a packed row (seg=)")
    scale = 1.0 / math.sqrt(q_BHTd.shape[-1])
    H = q_BHTd.shape[1]
    rep = lambda x: repeat_kv(x, H // x.shape[1])  # noqa: E731  (a no-op for tensors of H heads)
    k0, v0 = keys[0], values[0]
    if seg is None or not gqa_flash(kernel, q_BHTd):  # (the dense kernels have no grouped-query mode)
        k0, v0 = rep(k0), rep(v0)
    kd, vd = [rep(k) for k in keys[1:]], [rep(v) for v in values[1:]]
    return _CausalPlusDiagonals.apply(q_BHTd, k0, v0, kernel, scale, seg, rows, *kd, *vd)


def check_fast_attention(
    device: str | torch.device, dtype: torch.dtype = torch.bfloat16, *, T: int = 96, steps: int = 3, seed: int = 0
) -> float:
    """Max abs difference of output and grads between fast and reference on random inputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def mk():
        return torch.randn(2, 4, T, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q = mk()
    ks, vs = [mk() for _ in range(steps)], [mk() for _ in range(steps)]
    dout = torch.randn(2, 4, T, 64, generator=g).to(device=device, dtype=dtype)
    worst = 0.0
    results = []
    for fn in (reference_attention, fast_attention):
        out = fn(q, ks, vs)
        grads = torch.autograd.grad(out, [q, *ks, *vs], dout)
        results.append([out, *grads])
    for a, b in zip(*results):
        worst = max(worst, float((a.detach().float() - b.detach().float()).abs().max()))
    return worst
