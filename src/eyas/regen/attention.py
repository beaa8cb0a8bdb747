"""Attention for the static-cache engine: decode over each row's own keys, prefill without padding.

Decode. The cache is one slot per row, [B, K, S, d], and row b's keys are positions 0..len_b-1.
A decode step at batch 512 on a small target is bound by reading those keys, so the fast path
(`decode_triton`, a Triton kernel) reads exactly them: one program per (row, KV head, split of
SPLIT keys); a split past the row's length returns at once; the G query heads that share a KV head
are the rows of one tile, so each key is read once for all of them. The grid and every shape are
fixed, so the call is captured in a CUDA graph like the rest of the step; lengths are read on the
device. Splits are merged by log-sum-exp weights (flash-decoding). `decode_reference` is the SDPA
version over a span of the cache with a per-row mask: the CPU path and what the kernel is tested
against. The kernel also runs on CPU under Triton's interpreter (TRITON_INTERPRET=1), so the tests
exercise it without a GPU (the variable must be set before triton is imported).

Prefill. Prompts are packed end to end, [T, heads, d], with int32 cumulative lengths: no padding.
On CUDA in bf16/fp16 one varlen flash-attention call (PyTorch's own kernel) does every prompt;
otherwise (CPU, fp32) SDPA runs per prompt over its slice.

Shape legend: B rows, H query heads, K kv heads, G = H/K, S cache length, d head dim,
T packed prompt tokens, N prompts, P splits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.common import triton_kernel_unavailable

SPLIT = 256
"""Keys per decode program (a multiple of BLOCK_N)."""
BLOCK_N = 64
"""Keys per tile inside a program: attended keys are rounded up to this per row."""

try:  # Triton is optional: CI and CPU-only machines use the SDPA path.
    import triton
    import triton.language as tl

    TRITON_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the machine
    triton = tl = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"


def triton_unavailable(device: torch.device) -> str | None:
    """None when the Triton decode kernel can run on `device`; else why not."""
    return triton_kernel_unavailable(None if TRITON_ERROR else _decode_split, device, import_error=TRITON_ERROR)


if triton is not None:

    @triton.jit
    def _decode_split(
        Q,
        Kc,
        Vc,
        LEN,
        O,  # noqa: E741 (the output, beside Q, M, L)
        M,
        L,
        scale,
        s_qb,
        s_qh,
        s_kb,
        s_kh,
        s_ks,
        s_ob,
        s_oh,
        s_op,
        s_mb,
        s_mh,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        SPLIT_: tl.constexpr,
        BN: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(LEN + b).to(tl.int32)
        start = sp * SPLIT_
        end = tl.minimum(start + SPLIT_, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        heads = kh * G + g
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        kbase = Kc + b * s_kb + kh * s_kh
        vbase = Vc + b * s_kb + kh * s_kh
        for n0 in range(start, end, BN):
            n = n0 + tl.arange(0, BN)
            nmask = n < end
            k = tl.load(kbase + n[:, None] * s_ks + d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 (a constexpr branch of a Triton kernel, compiled away)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vbase + n[:, None] * s_ks + d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(O + b * s_ob + heads[:, None] * s_oh + sp * s_op + d[None, :], acc, mask=gmask[:, None])
        tl.store(M + b * s_mb + heads * s_mh + sp, m_i, mask=gmask)
        tl.store(L + b * s_mb + heads * s_mh + sp, l_i, mask=gmask)


def decode_triton(
    q_BHd: torch.Tensor, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor, len_B: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over keys [0, len_b) of each row; [B, H, d] in q's dtype.

    len_B must be >= 1 for every row (an empty row has no softmax). No host syncs."""
    B, H, D = q_BHd.shape
    _, K, S, _ = k_BKSd.shape
    G = H // K
    assert k_BKSd.stride(-1) == 1 and q_BHd.stride(-1) == 1 and k_BKSd.stride() == v_BKSd.stride()
    P = -(-S // SPLIT)
    o_BHPd = torch.empty(B, H, P, D, device=q_BHd.device, dtype=torch.float32)
    m_BHP = torch.empty(B, H, P, device=q_BHd.device, dtype=torch.float32)
    l_BHP = torch.empty_like(m_BHP)
    _decode_split[(B, K, P)](
        q_BHd,
        k_BKSd,
        v_BKSd,
        len_B,
        o_BHPd,
        m_BHP,
        l_BHP,
        float(scale),
        q_BHd.stride(0),
        q_BHd.stride(1),
        k_BKSd.stride(0),
        k_BKSd.stride(1),
        k_BKSd.stride(2),
        o_BHPd.stride(0),
        o_BHPd.stride(1),
        o_BHPd.stride(2),
        m_BHP.stride(0),
        m_BHP.stride(1),
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=D,
        SPLIT_=SPLIT,
        BN=BLOCK_N,
        IEEE=q_BHd.dtype == torch.float32,
        num_warps=4,
    )
    # Merge the splits: split p's partial sum weighs exp(m_p - max_p m_p); empty splits have m = -inf.
    w_BHP = torch.exp(m_BHP - m_BHP.amax(-1, keepdim=True))
    out_BHd = (o_BHPd * w_BHP[..., None]).sum(2) / (l_BHP * w_BHP).sum(-1, keepdim=True)
    return out_BHd.to(q_BHd.dtype)


def decode_reference(
    q_BHd: torch.Tensor, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor, len_B: torch.Tensor, scale: float, span: int
) -> torch.Tensor:
    """The same attention with SDPA over keys [0, span) masked to each row's length (span >= max len).

    Grouped-query without copying the cache: the G query heads of a KV head are G query "positions"."""
    B, H, D = q_BHd.shape
    K = k_BKSd.shape[1]
    mask_B11S = (torch.arange(span, device=q_BHd.device)[None, :] < len_B[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q_BHd.reshape(B, K, H // K, D), k_BKSd[:, :, :span], v_BKSd[:, :, :span], attn_mask=mask_B11S, scale=scale
    )
    return o.reshape(B, H, D)


def flash_varlen_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when PyTorch's varlen flash kernel can take this device and dtype."""
    if device.type != "cuda":
        return f"device {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (flash attention takes bf16/fp16)"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch has no aten._flash_attention_forward"
    return None


def prefill_flash(
    q_THd: torch.Tensor, k_TKd: torch.Tensor, v_TKd: torch.Tensor, cu_N1: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """Causal attention within each packed prompt, one varlen flash call; [T, H, d].

    The KV heads are repeated to the query heads first (a prefill-sized copy, small next to the
    projections), so the call does not depend on the kernel's grouped-query support."""
    G = q_THd.shape[1] // k_TKd.shape[1]
    if G > 1:
        k_TKd, v_TKd = k_TKd.repeat_interleave(G, dim=1), v_TKd.repeat_interleave(G, dim=1)
    out = torch.ops.aten._flash_attention_forward(
        q_THd, k_TKd.contiguous(), v_TKd.contiguous(), cu_N1, cu_N1, max_len, max_len, 0.0, True, False, scale=scale
    )
    return out[0]


def prefill_per_prompt(
    q_THd: torch.Tensor, k_TKd: torch.Tensor, v_TKd: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """The same with SDPA per prompt over its slice (CPU, fp32, and the reference); [T, H, d]."""
    G = q_THd.shape[1] // k_TKd.shape[1]
    out, start = [], 0
    for n in lens:
        q = q_THd[start : start + n].transpose(0, 1)  # H,n,d
        k = k_TKd[start : start + n].transpose(0, 1)
        v = v_TKd[start : start + n].transpose(0, 1)
        if G > 1:
            k, v = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)
        out.append(
            F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0].transpose(0, 1)
        )
        start += n
    return torch.cat(out, 0)
