"""Training-time test (TTT): the EAGLE-3 loss, unrolled over several draft steps.

Notation for one sample of T tokens x_0..x_{T-1} with loss mask m_t (True on assistant tokens):
f_t = fc(aux_t), the target's low/mid/high states after reading x_0..x_t; p_j = the target's
distribution for x_{j+1} (softmax of lm_head(final_j) restricted to the draft vocab); h^k_t = the
drafter's pre-norm output at step k, position t.

Step k at position t (k = 0..K-1):
    feature   f_t (k = 0)  |  h^{k-1}_t (k > 0)
    token     x_{t+1+k}                       (ground truth, shifted one more per step)
    position  t + k                           (RoPE id: one further per step)
    teacher   p_{t+1+k}                       (the target's distribution for x_{t+2+k})
    valid     m_{t+2+k}  and  argmax(target logits_{t+1+k}) is in the draft vocab
              (t + 2 + k <= T - 1; later positions have nothing to predict)

Worked example, T = 6, x = [s u A B C E], m = [0 0 1 1 1 1] (A, B, C, E are the answer):

    t              0    1    2    3    4    5
    step 0 token   u    A    B    C    E    -       features f_0..f_4
           teacher p1   p2   p3   p4   p5   -
           target  A    B    C    E    -    -       (the token p_{t+1} predicts)
           mask    1    1    1    1    0    0       = m_2..m_5, then nothing
    step 1 token   A    B    C    E    -    -       features h0_0..h0_3, positions 1..4
           teacher p2   p3   p4   p5   -    -
           mask    1    1    1    0    0    0       = m_3..m_5
    step 2 token   B    C    E    -    -    -
           mask    1    1    0    0    0    0       = m_4..m_5

The FIRST answer token A is supervised (step 0, t = 0). A known bug elsewhere shifts tokens and
teachers but leaves the mask at m_t, which drops A and B from step 0 and supervises past the end.

Attention: a query at step k, position t sees the step-0 keys at positions <= t (causal) plus the
keys of steps 1..k at position t only (one diagonal per step), under ONE softmax.
- `attention="reference"`: a dense bool mask over [T, (k+1)T] keys (simple, O(k T^2) memory).
- `attention="fast"`: flash attention over the step-0 keys (causal) returning its log-sum-exp,
  plus the k diagonal scores as row-wise dot products, merged by one logsumexp. Backward runs the
  flash backward with the MERGED output and log-sum-exp (the split-KV identity), so no T x T (let
  alone T x T x steps) tensor is ever built. CUDA uses aten's flash kernels, CPU its flash kernel;
  `check_fast_attention` compares against the reference on the current device.

Loss: per step, soft cross-entropy -sum_v p(v) log q(v) over valid positions; loss_k = its sum over
the global batch divided by the number of LOSS-MASK positions of step k in the global batch
(sum_t m_{t+2+k}; known before any forward, so micro-batches and ranks normalise identically);
total = sum_k w_k loss_k with w_k = 0.8**k by default. The head's logits are made chunk by chunk
(`head_soft_ce`); each chunk's CE, top-1 hits and logit gradient come from one fused Triton kernel
on CUDA (`eyas.drafter.ce_kernel`, after a start-up check against `_chunk_ce`; EYAS_KERNELS=ce:off
forces the compiled torch version), else from `_chunk_ce`. Where the teacher's logits are kept for
the whole packed row, the kernel reads each chunk's teacher rows from that table through an index
vector; the torch version gathers them first.

Shape legend: B batch, T tokens, D hidden, A aux layers, H heads, K kv heads, d head dim,
V draft vocab, Vt target vocab, J diagonal (earlier-step) keys.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eyas.drafter import ce_kernel as CE
from eyas.drafter.model import Eagle3Drafter, repeat_kv, rms_norm
from eyas import kernels
from eyas.packing import to_device


@dataclass(kw_only=True)
class TTTConfig:
    steps: int = 7
    """Draft steps unrolled in training (K)."""
    decay: float = 0.8
    """Step k's loss weight is decay**k."""
    attention: str = "fast"
    """'fast' (flash + diagonal merge) or 'reference' (dense mask; tests and tiny runs)."""
    align_topk: int = 0
    """0: every supervised row of every step carries its loss. K > 0 (packed path): the loss of step k at
    position t counts only while the draft chain rooted at t is still reachable, i.e. at each step j < k the
    target's top token was among the drafter's top K at t (a tree of branching K could still hold it; the chain
    decoder is K = 1). Rows past a miss train the drafter on states decoding never reaches; the per-step losses
    then sum the reachable rows only (the accuracies still count every row)."""
    feature_loss: float = 0.0
    """Packed path: > 0 adds this weight times a regression of the drafter's head input (its normed state) at each
    supervised row of step k onto the target's final post-norm state of the teacher row (the state whose head gives
    the distribution the row learns), smooth L1 averaged over the hidden size, weighted by w_k / denominator_k:
    every supervised row, also those the cross-entropy leaves out (past a miss under `align_topk`, or whose target
    token lies outside the draft vocabulary). A dense signal besides the distribution (EAGLE-1's feature loss,
    which EAGLE-3 dropped); 0 (default): the cross-entropy alone."""
    cast_once: bool | None = None
    """Packed path under autocast: the mid layer's linear weights cast to the compute dtype once per
    forward (q/k/v and gate/up concatenated, one matmul each) and shared by the K steps, instead of every
    step casting the weights itself (autograd sums the K steps' weight gradients in the compute dtype).
    None (default): on for drafters of hidden size >= CAST_ONCE_MIN_HIDDEN (wide drafters are bound by the casts,
    narrow ones by the extra concatenation)."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"--ttt-steps must be >= 1, got {self.steps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"TTT decay must be in (0, 1], got {self.decay}")
        if self.attention not in ("fast", "reference"):
            raise ValueError(f"TTT attention must be 'fast' or 'reference', got {self.attention!r}")
        if self.align_topk < 0:
            raise ValueError(f"--align-topk must be >= 0, got {self.align_topk}")
        if not self.feature_loss >= 0:
            raise ValueError(f"--feature-loss must be >= 0, got {self.feature_loss}")

    @property
    def weights(self) -> list[float]:
        return [self.decay**k for k in range(self.steps)]

    def cast_once_for(self, hidden_size: int) -> bool:
        """`cast_once` resolved for a drafter of this hidden size."""
        return hidden_size >= CAST_ONCE_MIN_HIDDEN if self.cast_once is None else self.cast_once


CAST_ONCE_MIN_HIDDEN = 2048
"""The smallest drafter hidden size that casts its weights once by default (the 8B shape gains, SmolLM2's loses;
sizes between are unmeasured)."""

# cast_once precision: autograd adds the K steps' bf16 gradients of the once-cast weights in bf16 before the one
# cast back to the fp32 master weight; the loss and gradients match per-step casts within bf16 rounding
# (tests/test_train_packed.py::test_cast_once_casts_each_weight_once_and_trains_alike).


# ----------------------------------------------------------------------------------------------
# teacher


@dataclass
class Teacher:
    probs_BTV: torch.Tensor
    """fp32 softmax of the target's logits restricted to the draft vocab, at every position."""
    top_BT: torch.Tensor
    """Draft id of the target's argmax over the draft vocab."""
    in_vocab_BT: torch.Tensor
    """True where the target's full-vocab argmax is in the draft vocab."""


@torch.no_grad()
def teacher_from_final(final_BTD: torch.Tensor, head_weight_VtD: torch.Tensor, used_V: torch.Tensor,
                       t2d_Vt: torch.Tensor, *, chunk_rows: int = 2048) -> Teacher:
    """Teacher logits = target lm_head(final) computed on the fly, in row chunks so the full-vocab
    logits exist for at most `chunk_rows` positions at a time."""
    B, T, D = final_BTD.shape
    flat = final_BTD.reshape(B * T, D).to(head_weight_VtD.dtype)
    probs, tops, inv = [], [], []
    for a in range(0, B * T, chunk_rows):
        logits = flat[a:a + chunk_rows] @ head_weight_VtD.T  # [n, Vt]
        inv.append(t2d_Vt[logits.argmax(-1)])
        restricted = logits.index_select(1, used_V).float()
        tops.append(restricted.argmax(-1))
        probs.append(torch.softmax(restricted, dim=-1))
    return Teacher(torch.cat(probs).view(B, T, -1), torch.cat(tops).view(B, T), torch.cat(inv).view(B, T))


def step_mask(loss_mask_BT: torch.Tensor, k: int) -> torch.Tensor:
    """m_{t+2+k} for t in [0, T-1-k): the loss mask of step k (before the vocab filter)."""
    B, T = loss_mask_BT.shape
    n = max(T - 1 - k, 0)
    shifted = loss_mask_BT[:, 2 + k:].bool()
    return torch.cat([shifted, shifted.new_zeros(B, n - shifted.shape[1])], dim=1)


def step_denominators(loss_mask_BT: torch.Tensor, steps: int) -> torch.Tensor:
    """[K] float: number of loss-mask positions per step (the normaliser, summed over a global batch)."""
    return torch.stack([step_mask(loss_mask_BT, k).sum() for k in range(steps)]).double()


# ----------------------------------------------------------------------------------------------
# attention over causal step-0 keys + one diagonal per later step


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
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


def _cuda_flash_fwd(q, k, v, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused = res[:8]
    return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)


def _cuda_flash_bwd(dout, q, k, v, out, lse, scale, aux):
    cum_q, cum_k, max_q, max_k, rng_state, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng_state, unused, scale=scale)


KERNELS = {"math": (_math_fwd, _math_bwd), "cpu-flash": (_cpu_flash_fwd, _cpu_flash_bwd),
           "cuda-flash": (_cuda_flash_fwd, _cuda_flash_bwd)}


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


_COMPILED: dict[tuple[str, str], object] = {}


def _fast(fn, device: torch.device):
    """`fn` compiled into a few fused kernels on CUDA (eager elsewhere, or where compiling fails):
    the fp32 elementwise math around the matmuls is memory-bound, and fusing it removes the
    fp32 copies eager mode writes between steps."""
    if device.type != "cuda":
        return fn
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        # the merges take lists of J diagonals: one graph per J (1..TTT steps - 1) for packed rows and again for
        # dense batches, past dynamo's default of 8 graphs a function (beyond it, calls fall back to eager)
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        try:
            _COMPILED[key] = torch.compile(fn, dynamic=True)
        except Exception:  # noqa: BLE001  (compilation is an optimisation)
            _COMPILED[key] = fn
    return _COMPILED[key]


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
    return (lambda q, k, v, scale: fwd(q, k, v, scale, seg),
            lambda dout, q, k, v, out, lse, scale, aux: bwd(dout, q, k, v, out, lse, scale, seg, aux))


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


def check_fast_attention(device: str | torch.device, dtype: torch.dtype = torch.bfloat16, *, T: int = 96,
                         steps: int = 3, seed: int = 0) -> float:
    """Max abs difference of output and grads between fast and reference on random inputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda: torch.randn(2, 4, T, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()
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


# ----------------------------------------------------------------------------------------------
# the unrolled loss


@dataclass
class TTTOutput:
    loss: torch.Tensor
    """Scalar: sum_k w_k * ce_sum_k / denominators_k (differentiable)."""
    ce_sum: torch.Tensor
    """[K] summed soft CE over valid positions (detached, fp64)."""
    correct: torch.Tensor
    """[K] valid positions where the draft's top-1 equals the target's."""
    valid: torch.Tensor
    """[K] valid positions (loss mask and target argmax in the draft vocab)."""
    accepted: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Sum over step-0-valid positions of the simulated chain accepted length."""
    rounds: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Number of step-0-valid positions (simulated drafting rounds)."""


def soft_ce(logits_BnV: torch.Tensor, probs_BnV: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log softmax(logits)(v), per position (fp32)."""
    return -(probs_BnV * torch.log_softmax(logits_BnV.float(), -1)).sum(-1)


def compile_drafter(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """torch.compile the per-step pieces (norms + q/k/v + RoPE; o_proj + residual + MLP; final norm +
    lm_head; the soft cross-entropy; the head's normed rows): small graphs that compile
    in seconds and fuse the elementwise work around the matmuls. The attention and the step loop stay eager."""
    mid = drafter.midlayer
    mid.project_qkv = torch.compile(mid.project_qkv)
    mid.finish = torch.compile(mid.finish)
    drafter.compute_logits = torch.compile(drafter.compute_logits)
    drafter._soft_ce = torch.compile(soft_ce)
    drafter._normed_rows = torch.compile(normed_rows, dynamic=True)  # the rows' count changes every step
    return drafter


def normed_rows(hidden_ND: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """`rms_norm` of rows `rows` of hidden_ND, cast to `dtype` when given."""
    out = rms_norm(hidden_ND.index_select(0, rows), weight, eps)
    return out if dtype is None else out.to(dtype)


def ttt_unroll(drafter: Eagle3Drafter, input_ids_BT: torch.Tensor, aux_BTAD: torch.Tensor, *, steps: int,
               attention: str = "fast"):
    """Yield (k, hidden_prenorm_BTD) for k = 0..steps-1 (positions t >= T-1-k carry no meaning).

    Step k feeds token x_{t+1+k} at RoPE position t+k with feature fc(aux_t) (k = 0) or the
    previous step's hidden state; attention: causal step-0 keys + the diagonal keys of steps 1..k.
    """
    B, T = input_ids_BT.shape
    dev = input_ids_BT.device
    attn_fn = fast_attention if attention == "fast" else reference_attention
    feature = drafter.project_aux(aux_BTAD)
    positions = torch.arange(T, device=dev)[None].expand(B, T)
    keys, values = [], []
    for k in range(steps):
        tokens = torch.cat([input_ids_BT[:, 1 + k:], input_ids_BT.new_zeros(B, min(1 + k, T))], dim=1)[:, :T]
        emb = drafter.embed_tokens(tokens)
        cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else emb.dtype
        cos, sin = drafter.rope(positions + k, cdtype)
        q, kk, vv = drafter.midlayer.project_qkv(emb, feature, cos, sin)
        keys.append(_step_keys(kk, drafter.config.num_attention_heads))
        values.append(_step_keys(vv, drafter.config.num_attention_heads))
        hidden = drafter.midlayer.finish(attn_fn(q, keys, values), feature)
        yield k, hidden
        feature = hidden


def ttt_loss(
    drafter: Eagle3Drafter,
    *,
    input_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    aux_BTAD: torch.Tensor,
    teacher: Teacher,
    cfg: TTTConfig,
    denominators: torch.Tensor | None = None,
) -> TTTOutput:
    """Unroll K draft steps over one batch and return the weighted loss and per-step statistics.

    `denominators` [K]: the loss-mask counts of the GLOBAL batch (all micro-batches and ranks);
    default this batch's own (`step_denominators`). The padded reference has no `align_topk` nor `feature_loss`.
    """
    if cfg.align_topk or cfg.feature_loss:
        raise ValueError("TTTConfig.align_topk and feature_loss: the packed path (ttt_loss_packed) only")
    T = input_ids_BT.shape[1]
    K = cfg.steps
    dev = input_ids_BT.device
    if denominators is None:
        denominators = step_denominators(loss_mask_BT, K)
    denominators = denominators.to(dev).clamp_min(1)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    ce_sums, corrects, valids = [zero] * K, [zero] * K, [zero] * K
    chain_alive = None  # [B, n] step-0 positions whose simulated chain is still fully accepted
    accepted, rounds = zero, zero
    for k, hidden in ttt_unroll(drafter, input_ids_BT, aux_BTAD, steps=K, attention=cfg.attention):
        n = T - 1 - k  # positions with a teacher at this step
        if n <= 0:
            break
        logits = drafter.compute_logits(hidden[:, :n]).float()  # [B, n, V]
        valid = step_mask(loss_mask_BT, k) & teacher.in_vocab_BT[:, 1 + k:]
        ce = getattr(drafter, "_soft_ce", soft_ce)(logits, teacher.probs_BTV[:, 1 + k:])  # [B, n]
        ce_sum = (ce * valid).sum()
        loss = loss + cfg.weights[k] * ce_sum / denominators[k].float()
        with torch.no_grad():
            hit = (logits.argmax(-1) == teacher.top_BT[:, 1 + k:]) & valid
            ce_sums[k], corrects[k], valids[k] = ce_sum.detach().double(), hit.sum().double(), valid.sum().double()
            if k == 0:
                chain_alive, rounds = hit, valid.sum().double()
            else:
                chain_alive = chain_alive[:, :n] & hit
            accepted = accepted + chain_alive.sum().double()
    return TTTOutput(loss=loss, ce_sum=torch.stack(ce_sums), correct=torch.stack(corrects),
                     valid=torch.stack(valids), accepted=accepted, rounds=rounds)


# ----------------------------------------------------------------------------------------------
# the fast path: packed rows, supervised rows only, a fused chunked head + soft cross-entropy
#
# Samples are laid end to end in one row (eyas.packing.Segments): step-0 attention is causal
# within each sample, positions restart per sample, and the step-k shift x_{t+1+k} never crosses
# a sample's end (those positions get token 0 and no loss). Only the positions that carry a loss
# at step k (`supervised_rows`) go through the head, and the head's [rows x vocab] logits exist for
# `chunk_rows` rows at a time: forward and backward are done chunk by chunk inside one autograd
# Function, so peak memory grows with tokens x hidden, not tokens x vocab.


def supervised_rows(loss_mask_N: torch.Tensor, ends_N: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """[K] int64 positions t that carry a loss at step k: m_{t+2+k} and t+2+k inside t's sample.

    Host tensors in, host tensors out (computed by the data loader, before the batch reaches the GPU).
    Their lengths are the step's loss-mask counts (the denominators of `ttt_loss`)."""
    N = loss_mask_N.shape[0]
    mask = loss_mask_N.bool()
    left = ends_N - torch.arange(N, dtype=ends_N.dtype)  # positions from t to its sample's end
    rows = []
    for k in range(steps):  # (shifted slices, not a gather of j = t + 2 + k: about half the host time)
        ok = torch.zeros(N, dtype=torch.bool)
        ok[:max(0, N - 2 - k)] = mask[2 + k:]
        ok &= left > 2 + k
        rows.append(ok.nonzero().squeeze(1))
    return rows


def live_positions(rows: list[torch.Tensor], N: int) -> torch.Tensor:
    """int64 sorted positions that carry a loss at some TTT step (the union of `supervised_rows`): the only ones
    whose hidden states the packed unroll computes past step 0's keys and values."""
    live = torch.zeros(N, dtype=torch.bool, device=rows[0].device if rows else "cpu")
    for r in rows:
        live[r] = True
    return live.nonzero().squeeze(1)


@dataclass
class PackedTeacher:
    final_ND: torch.Tensor
    """The target's final (post-norm) states of the packed row, in the compute dtype."""
    head_VD: torch.Tensor
    """The target's lm_head rows of the draft vocab: teacher logits = final @ head_VD.T."""
    top_N: torch.Tensor
    """Draft id of the target's argmax over the draft vocab."""
    in_vocab_N: torch.Tensor
    """True where the target's full-vocab argmax is in the draft vocab."""
    logits_NV: torch.Tensor | None = None
    """The draft-vocab teacher logits of every row, kept when they fit `cache_bytes` (small
    batches: no recomputation per TTT step); None = recomputed chunk by chunk."""
    lse_N: torch.Tensor | None = None
    """fp32 log-sum-exp of each row of `logits_NV`, made with it where the fused CE kernel (its one reader) runs, so
    that the kernel's first pass reads the student's logits only; else None."""


TEACHER_CACHE_BYTES = 1 << 30
"""Keep the draft-vocab teacher logits of a row when they take at most this much (1 GiB): memory
stays bounded by a constant and by tokens x hidden beyond it."""


def _teacher_lse(logits_nV: torch.Tensor) -> torch.Tensor:
    """[n] fp32 log-sum-exp of each row (the kept teacher's `lse_N`), summed in fp32 whatever the logits' dtype (in bf16 it would
    keep 3 significant digits). Compiled on CUDA (`_fast`): one pass over the logits."""
    return torch.logsumexp(logits_nV.float(), -1)


def _teacher_max_lse(logits_nV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, first index of the max, fp32 log-sum-exp) of each row: `packed_teacher`'s fallback for the row statistics
    kernel, compiled on CUDA (`_fast`) so that the three reductions read each chunk of the table once, not twice."""
    top_max, top = logits_nV.max(-1)
    return top_max, top, _teacher_lse(logits_nV)


def teacher_stats_for(device: torch.device, dtype: torch.dtype):
    """`packed_teacher`'s (max, first index of the max, fp32 log-sum-exp) of the rows of a kept chunk: the Triton
    kernel where it runs and passed its check on this device at this dtype (kernels: `teacher_stats`), else the
    torch reduction (compiled on CUDA)."""
    if kernels.use("teacher_stats", device, dtype):
        return CE.row_max_lse
    return _fast(_teacher_max_lse, device)


@torch.no_grad()
def check_row_max_lse(device: torch.device, dtype: torch.dtype, *, rows: int = 37, vocab: int = 32000) -> str | None:
    """None when `ce_kernel.row_max_lse` equals `_teacher_max_lse` (eager) on random rows on `device`; else why not.
    Logits ~ N(0, 3); rows strided (a wider table's columns); row 0 holds its maximum twice in different blocks
    (the first index wins), row 1 its maximum in the last, partial block, row 2 a maximum far above the rest (the
    sum-exp rescaled past the block that held it)."""
    why = CE.stats_unavailable(device)
    if why is not None:
        return why
    g = torch.Generator(device="cpu").manual_seed(0)
    wide = (3 * torch.randn(rows, vocab + 16, generator=g)).to(dtype)
    wide[0, 5], wide[0, vocab - 7] = 40.0, 40.0
    wide[1, vocab - 1] = 41.0
    wide[2, 1] = 90.0
    x = wide.to(device)[:, :vocab]
    try:
        got = CE.row_max_lse(x)
    except Exception as exc:  # noqa: BLE001  (a kernel that cannot compile or run here: the torch version)
        return f"the row statistics kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    ref = _teacher_max_lse(x)
    if not torch.equal(got[0], ref[0]):
        return "the row statistics kernel's maximum differs from torch's"
    if not torch.equal(got[1], ref[1]):
        return "the row statistics kernel's index of the maximum differs from torch's first index"
    err = float((got[2] - ref[2]).abs().max())
    if not err <= 1e-4:
        return f"the row statistics kernel's log-sum-exp differs from torch's by {err:.2e}"
    return None


def unused_head(head_weight_VtD: torch.Tensor, t2d_Vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's rows outside the draft vocab [U, D], their ascending target ids [U]) for `packed_teacher` (reads
    the draft-vocab mask once: call it at set-up, not per step)."""
    unused_U = (~t2d_Vt.bool()).nonzero().squeeze(1)
    return head_weight_VtD.index_select(0, unused_U), unused_U


@torch.no_grad()
def packed_teacher(final_ND: torch.Tensor, head_weight_VtD: torch.Tensor, head_used_VD: torch.Tensor,
                   used_V: torch.Tensor, t2d_Vt: torch.Tensor, *, chunk_rows: int = 4096,
                   cache_bytes: int = TEACHER_CACHE_BYTES,
                   unused: tuple[torch.Tensor, torch.Tensor] | None = None) -> PackedTeacher:
    """Argmax flags over the full target vocab, in row chunks; the draft-vocab logits are kept only
    when they fit `cache_bytes` (else the fused loss recomputes them chunk by chunk), with their log-sum-exp where the
    fused CE kernel runs on this device. `unused`: `unused_head(...)` (made here when not given).

    The final states are multiplied by the draft vocab's rows and by the other rows apart, and the full-vocab argmax
    comes from the two maxima (ties to the smaller target id, as one argmax over the whole row takes its first): the
    same products as one [rows x target vocab] product, without writing and re-reading a copy of its draft columns.
    The flags can differ from one product's only where two logits tie to the last bit of one product and not of the
    other."""
    flat = final_ND.to(head_weight_VtD.dtype)
    N, V = flat.shape[0], used_V.shape[0]
    keep = N * V * flat.element_size() <= cache_bytes
    if unused is None:
        unused = unused_head(head_weight_VtD, t2d_Vt)
    # (only where the fused kernel, its one reader, can run: on the CPU no chunk CE would read it)
    lse_wanted = keep and kernels.setting("ce") != "off" and CE.kernel_unavailable(flat.device) is None
    max_lse_of = teacher_stats_for(flat.device, flat.dtype) if lse_wanted else None
    # the kept table is written in place, chunk by chunk (no [N, V] concatenation at the end: a copy of the whole
    # table, and twice its memory for a moment)
    table = flat.new_empty(N, V) if keep else None
    tops, inv, lses = [], [], []
    for a in range(0, N, chunk_rows):
        into = table[a:a + chunk_rows] if keep else None
        restricted = torch.matmul(flat[a:a + chunk_rows], head_used_VD.T, out=into)  # [n, V]
        if max_lse_of is not None:  # the maximum and the log-sum-exp in one read of the chunk
            top_max, top, lse = max_lse_of(restricted)
            lses.append(lse)
        else:
            top_max, top = restricted.max(-1)  # (the first index of the maximum, as argmax)
        inv.append(_draft_argmax_wins(flat[a:a + chunk_rows], top_max, used_V[top], *unused))
        tops.append(top)
    return PackedTeacher(flat, head_used_VD, torch.cat(tops), torch.cat(inv), table, torch.cat(lses) if lses else None)


def _draft_argmax_wins(flat_nD, used_max_n, used_id_n, head_unused_UD, unused_U) -> torch.Tensor:
    """[n] bool: the full-vocab argmax is a draft-vocab id, given the draft vocab's maximum and its target id: above
    the other rows' maximum, or equal to it at a smaller target id."""
    if unused_U.numel() == 0:
        return torch.ones_like(used_max_n, dtype=torch.bool)
    other_max, other = (flat_nD @ head_unused_UD.T).max(-1)
    return (used_max_n > other_max) | ((used_max_n == other_max) & (used_id_n < unused_U[other]))


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
def check_fused_chunk_ce(device: torch.device, s_dtype: torch.dtype, t_dtype: torch.dtype, *, rows: int = 64,
                         vocab: int = 32000) -> str | None:
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
    cases += [(" (teacher log-sum-exp given)", (s, t, w, top), {"t_lse": table_lse[t_rows]}, ref),
              (" (teacher rows by index, log-sum-exp given)", (s, table, w, top), by_index, ref),
              (" (teacher rows by index, log-sum-exp moved by 0.5)", (s, table, w, top),
               {"t_rows": t_rows, "t_lse": moved}, _chunk_ce(s, t, w, top, moved[t_rows]))]
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
    rtol = 1e-4 if s_dtype == torch.float32 else 2 ** -7
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
    def forward(ctx, x_nD, w_VD, t_src, wt_VD, t_idx, t_lse, weight_n, top_n, chunk_rows, compute_dtype, bounds,
                groups, align=None):
        with torch.autocast(x_nD.device.type, enabled=False):
            need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            xb, wb = x_nD.to(compute_dtype), w_VD.to(compute_dtype)
            wtb = wt_VD.to(compute_dtype) if wt_VD is not None else None
            n = x_nD.shape[0]
            sums = torch.zeros(len(bounds), dtype=torch.float32, device=x_nD.device)
            hits = torch.zeros(n, dtype=torch.bool, device=x_nD.device)
            dx = torch.empty_like(xb) if need and ctx.needs_input_grad[0] else None
            dw = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need and ctx.needs_input_grad[1] else None
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


def head_soft_ce(x_nD: torch.Tensor, w_VD: torch.Tensor, f_nD: torch.Tensor | None, wt_VD: torch.Tensor | None,
                 weight_n: torch.Tensor, top_n: torch.Tensor, *, chunk_rows: int = 4096,
                 compute_dtype: torch.dtype | None = None, teacher_logits: torch.Tensor | None = None,
                 teacher_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted soft CE, top-1 hits [n]) of the draft head over rows x (already normed)
    against the teacher logits f @ wt.T (or rows `teacher_rows` of a `teacher_logits` table),
    never holding more than `chunk_rows` x V logits."""
    total, _, hits = head_soft_ce_ranges(x_nD, w_VD, f_nD, wt_VD, weight_n, top_n, [x_nD.shape[0]],
                                         chunk_rows=chunk_rows, compute_dtype=compute_dtype,
                                         teacher_logits=teacher_logits, teacher_rows=teacher_rows)
    return total, hits


def head_soft_ce_ranges(x_nD: torch.Tensor, w_VD: torch.Tensor, f_nD: torch.Tensor | None,
                        wt_VD: torch.Tensor | None, weight_n: torch.Tensor, top_n: torch.Tensor, lengths: list[int],
                        *, chunk_rows: int = 4096, compute_dtype: torch.dtype | None = None,
                        teacher_logits: torch.Tensor | None = None, teacher_rows: torch.Tensor | None = None,
                        align: tuple | None = None, teacher_lse: torch.Tensor | None = None):
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
        return _HeadSoftCE.apply(x_nD, w_VD, teacher_logits, None, teacher_rows, teacher_lse, weight_n, top_n,
                                 chunk_rows, compute_dtype, bounds, None, align)
    groups = None
    if teacher_rows is not None and len(lengths) > 1:
        groups = teacher_groups(teacher_rows, lengths, f_nD.shape[0], chunk_rows)
    return _HeadSoftCE.apply(x_nD, w_VD, f_nD, wt_VD, teacher_rows, None, weight_n, top_n, chunk_rows,
                             compute_dtype, bounds, groups, align)


def reference_head_soft_ce(x_nD, w_VD, f_nD, wt_VD, weight_n):
    """The plain version of `head_soft_ce`: whole [n, V] logits in fp32 (tests)."""
    s = (x_nD.float() @ w_VD.float().T)
    p = torch.softmax(f_nD.float() @ wt_VD.float().T, -1)
    return (soft_ce(s, p) * weight_n.float()).sum()


class PackedUnroll:
    """`ttt_unroll` over one packed row, one TTT step per `step` call. Step k feeds x_{t+1+k} when t+1+k is inside
    t's sample (else token 0: such positions never carry a loss) at RoPE position (t - start of t's sample) + k;
    step-0 keys are causal within each sample.

    Past step 0's keys and values, a position's states reach nothing but the same position's later steps (its
    queries read the step-0 keys of earlier positions and its own diagonals). So each step may run on fewer
    positions than the last (`pos`, sorted, a subset of the previous step's): the positions that carry no loss at
    any step (`live_positions`) are computed at step 0 up to their keys and values and then dropped."""

    def __init__(self, drafter: Eagle3Drafter, input_ids_N: torch.Tensor, seg, aux_NAD: torch.Tensor, *,
                 steps: int, attention: str = "fast", cast_once: bool = False):
        self.drafter, self.ids, self.seg = drafter, input_ids_N, seg
        N = input_ids_N.shape[0]
        dev = input_ids_N.device
        self.all = torch.arange(N, device=dev)
        # every step's input tokens at once, [steps, N]: x_{t+1+k} where t+1+k lies inside t's sample, else token 0
        j = self.all[None] + torch.arange(1, steps + 1, device=dev)[:, None]
        self.tokens_KN = torch.where(j < seg.ends_N[None], input_ids_N[j.clamp_max(N - 1)], 0)
        self.feature = drafter.project_aux(aux_NAD[None])
        self.pos = self.all  # positions of `feature`'s rows (and of the diagonal keys' rows)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.w = None  # the mid layer's weights cast once for all steps (cast_once)
        if cast_once and torch.is_autocast_enabled(dev.type):
            cdtype = torch.get_autocast_dtype(dev.type)
            if drafter.midlayer.self_attn.q_proj.weight.dtype != cdtype:
                self.w = drafter.midlayer.linear_weights(cdtype)
        self.attend = fast_attention if attention == "fast" else reference_attention

    def step(self, k: int, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Step k's hidden_prenorm [1, n, D] at positions `pos` (None: all N), which hold a subset of the last
        step's positions (step 0: computed at all N up to its keys and values, then kept at `pos`)."""
        d, seg = self.drafter, self.seg
        if pos is None:
            pos = self.all
        if k and pos is not self.pos:  # fewer positions than the last step: its states and diagonals narrowed
            sub = torch.searchsorted(self.pos, pos)
            self.feature = self.feature.index_select(1, sub)
            self.keys[1:] = [x.index_select(2, sub) for x in self.keys[1:]]
            self.values[1:] = [x.index_select(2, sub) for x in self.values[1:]]
        t = self.all if k == 0 else pos
        full = t is self.all
        positions = seg.positions_N if full else seg.positions_N.index_select(0, t)
        tokens = self.tokens_KN[k] if full else self.tokens_KN[k].index_select(0, t)
        emb = d.embed_tokens(tokens[None])
        dev = self.ids.device
        cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else emb.dtype
        cos, sin = d.rope_at(positions, k, cdtype, seg.max_len + k)  # (positions restart per sample: < max_len)
        q, kk, vv = d.midlayer.project_qkv(emb, self.feature, cos, sin, self.w)
        if k == 0:  # laid out [1, N, K, d] as the varlen kernels read them, once: v is a strided slice of the
            # q/k/v product, which every step's attention (forward and backward) would copy again otherwise
            vv = vv.transpose(1, 2).contiguous().transpose(1, 2)
        self.keys.append(_step_keys(kk, d.config.num_attention_heads, packed_step0=k == 0))
        self.values.append(_step_keys(vv, d.config.num_attention_heads, packed_step0=k == 0))
        att = self.attend(q, self.keys, self.values, seg=seg, rows=None if full else t)
        feature = self.feature
        if k == 0 and pos is not self.all:  # step 0's keys and values are made for all N; the rest for `pos`
            att, feature = att.index_select(2, pos), feature.index_select(1, pos)
        hidden = d.midlayer.finish(att, feature, self.w)
        self.feature, self.pos = hidden, pos
        return hidden


def top_rank_below(s_cV: torch.Tensor, top_c: torch.Tensor, topk: int) -> torch.Tensor:
    """[c] bool: fewer than `topk` logits of each row of s_cV above the one of token `top_c` (that token among the
    row's top `topk`; ties count for it). Compiled on CUDA (`_fast`): one pass over the logits."""
    s_top = s_cV.gather(1, top_c[:, None].clamp(0, s_cV.shape[1] - 1))
    return (s_cV > s_top).sum(1) < topk


def ttt_loss_packed(
    drafter: Eagle3Drafter,
    *,
    input_ids_N: torch.Tensor,
    seg,
    rows: list[torch.Tensor],
    aux_NAD: torch.Tensor,
    teacher: PackedTeacher,
    cfg: TTTConfig,
    denominators: torch.Tensor,
    chunk_rows: int = 4096,
    live: torch.Tensor | None = None,
) -> TTTOutput:
    """`ttt_loss` on a packed row: same loss, same statistics, same normalisation (`denominators`:
    the global batch's loss-mask counts per step = the summed lengths of `rows`). `live`: `live_positions(rows)`
    (made by the data loader on the host: its length sets shapes): the only positions computed past step 0's keys
    and values (the same loss and gradients)."""
    K = cfg.steps
    dev = input_ids_N.device
    N = input_ids_N.shape[0]
    denominators = denominators.to(dev).clamp_min(1)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    # the head's loss never feeds a later step: all steps' supervised rows go through ONE head call
    # after the unroll (one weight-gradient buffer for the head instead of one per step), each row
    # weighted by its step's w_k / denominator_k
    # each step's rows are gathered, normed and cast to the head's compute dtype by one `normed_rows` (compiled
    # with the drafter), then concatenated once: written slice by slice into one buffer instead, autograd would
    # clone the buffer's whole gradient once per step
    supervised = sum(int(r.numel()) for r in rows)
    cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else drafter.lm_head.weight.dtype
    parts: list[torch.Tensor] = []
    norm_rows = getattr(drafter, "_normed_rows", normed_rows)
    if not (live is not None and 0 < live.shape[0] < N):
        live = None  # (no supervised row: the filler below needs a hidden row)
    unroll = PackedUnroll(drafter, input_ids_N, seg, aux_NAD, steps=K, attention=cfg.attention,
                          cast_once=cfg.cast_once_for(drafter.config.hidden_size))
    pos = live
    for k in range(K):
        hidden = unroll.step(k, pos)
        if k == K - 1 and not supervised:
            # no supervised position (a rank's loss-free filler at an epoch's end): a zero that still
            # reaches every trainable weight, so backward runs and DDP/FSDP2 reduce as on the other ranks
            last = torch.nn.functional.linear(drafter.norm(hidden[0, :1]), drafter.lm_head.weight)
            loss = loss + 0.0 * last.float().sum()
        r = rows[k]
        if r.numel():
            at = r if pos is None else torch.searchsorted(pos, r)  # rows of the step's states
            parts.append(norm_rows(hidden[0], at, drafter.norm.weight, drafter.norm.eps, cdtype))
    lengths = [int(r.numel()) for r in rows]
    x = torch.cat(parts) if parts else torch.empty(0, drafter.config.hidden_size, dtype=cdtype, device=dev)
    # the statistics are made for all steps at once, over the steps' rows concatenated (each row's step from the
    # host's lengths): a few kernels a step instead of a few per TTT step (the 8B-shaped step is bound by its host)
    f64 = dict(dtype=torch.float64, device=dev)
    ce_sum, correct, accepted = torch.zeros(K, **f64), torch.zeros(K, **f64), zero
    if sum(lengths):  # one range per step (empty ones too): per_step[k] is step k's weighted sum
        k_of_row = _step_of_rows(lengths, dev)
        r_cat = torch.cat(rows)
        tr = r_cat + 1 + k_of_row  # teacher row of step k's row t: p_{t+1+k}
        valid = teacher.in_vocab_N[tr]  # the target's top token in the draft vocabulary
        scale = to_device(torch.tensor(cfg.weights, dtype=torch.float32), dev) / denominators.float()
        scale_n = scale.index_select(0, k_of_row)  # each row's w_k / denominator_k
        w = valid.float() * scale_n  # (0 where the target's top token is outside the draft vocab)
        top = teacher.top_N[tr]
        align = (r_cat, N, cfg.align_topk) if cfg.align_topk else None
        if teacher.logits_NV is not None:
            total, per_step, hits = head_soft_ce_ranges(x, drafter.lm_head.weight, None, None, w, top, lengths,
                                                        chunk_rows=chunk_rows, teacher_logits=teacher.logits_NV,
                                                        teacher_rows=tr, align=align, teacher_lse=teacher.lse_N)
        else:
            total, per_step, hits = head_soft_ce_ranges(x, drafter.lm_head.weight, teacher.final_ND, teacher.head_VD, w,
                                                        top, lengths, chunk_rows=chunk_rows, teacher_rows=tr,
                                                        align=align)
        loss = loss + total
        if cfg.feature_loss:
            loss = loss + cfg.feature_loss * _feature_term(x, teacher.final_ND, tr, scale_n)
        with torch.no_grad():
            hit = hits & valid
            ce_sum = (per_step / scale).double()  # each step's unweighted soft-CE sum (0 for an empty step)
            correct = torch.zeros(K, **f64).index_add_(0, k_of_row, hit.double())
            # the simulated chain: a position's step k is accepted while its steps 0..k all hit
            hit_KN = torch.zeros(K, N, dtype=torch.float32, device=dev).index_put_((k_of_row, r_cat), hit.float())
            accepted = hit_KN.cumprod(0).sum().double()
    # every supervised row whose target top token is in the draft vocab (the statistics' denominators)
    valids = torch.zeros(K, **f64)
    if sum(lengths):
        valids.index_add_(0, k_of_row, valid.double())
    return TTTOutput(loss=loss, ce_sum=ce_sum, correct=correct, valid=valids, accepted=accepted, rounds=valids[0])


def _feature_term(x_nD: torch.Tensor, final_ND: torch.Tensor, rows_n: torch.Tensor, w_n: torch.Tensor) -> torch.Tensor:
    """sum_n w_n * mean_D smooth_l1(x_n, final[rows_n]) (TTTConfig.feature_loss), in fp32."""
    reg = F.smooth_l1_loss(x_nD.float(), final_ND.index_select(0, rows_n).float(), reduction="none").mean(-1)
    return (reg * w_n).sum()


def _step_of_rows(lengths: list[int], device) -> torch.Tensor:
    """[sum(lengths)] the step k of each row of the steps' rows concatenated (k repeated lengths[k] times), made on
    the host."""
    return to_device(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), device)
