"""Packed sequences: several samples laid end to end in one row, attention kept inside each sample.

Why: padding a batch to its longest sample spends compute on nothing (on ShareGPT-like lengths,
often more than on the samples), and batches of variable shape defeat allocator reuse. A packed row
of N tokens holds samples s = 0..S-1 at [bounds[s], bounds[s+1]); every attention is causal WITHIN
a sample and never crosses a boundary, and positions restart at 0 in each sample. A tail of padding
(to a fixed N) is one more segment of token 0 with loss mask 0, so it attends only to itself.

    samples  [a b c] [d e] pad pad        bounds [0, 3, 5, 7]
    position  0 1 2   0 1   0   1
    ends      3 3 3   5 5   7   7         (exclusive end of each position's segment)

Attention kernels (forward returns the output and the log-sum-exp, backward takes them back, so
callers can merge extra keys by the split-KV identity; see drafter/ttt/attention.py):
- "cuda-flash": aten's flash kernel in its variable-length form (cumulative sequence lengths), one
  launch for the whole row, no mask tensor;
- "cpu-flash": aten's CPU flash kernel once per segment;
- "math": a dense block-diagonal causal mask in fp32 (the reference; tests and odd head sizes).

`target_forward_packed` runs a Llama/Qwen-style target over a packed row with the same modules as
Hugging Face (norms, projections, rotary table, MLP) and varlen attention, capturing the aux layers'
inputs and the final norm's output exactly as `eyas.target.forward_capture` does on padded batches;
`tail_forward_packed` runs only the last layers from given states (`eyas verify`'s tail invariant).

Shape legend: N packed tokens, S segments, H heads, K kv heads, d head dim, D hidden, A aux layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas import kernels


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the GPU: on CUDA through pinned memory with an
    asynchronous copy (a copy from pageable memory first waits for all the work queued on the stream)."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass
class Segments:
    """Where each sample of a packed row starts and ends."""

    bounds: list[int]
    """[S + 1] segment boundaries on the host (bounds[0] = 0, bounds[-1] = N)."""
    cu_seqlens: torch.Tensor
    """The same, int32 on the compute device (what the varlen kernel reads)."""
    max_len: int
    """Longest segment."""
    positions_N: torch.Tensor
    """int64 position of each token inside its segment (restarts at 0)."""
    ends_N: torch.Tensor
    """int64 exclusive end index of each token's segment."""

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> Segments:
        lengths = [int(x) for x in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed segments need positive lengths, got {lengths[:8]}")
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        lens_t = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.tensor(bounds[:-1], dtype=torch.int64)
        ends = torch.tensor(bounds[1:], dtype=torch.int64)
        positions = torch.arange(bounds[-1], dtype=torch.int64) - starts.repeat_interleave(lens_t)
        return cls(
            bounds=bounds,
            cu_seqlens=torch.tensor(bounds, dtype=torch.int32).to(device),
            max_len=max(lengths),
            positions_N=positions.to(device),
            ends_N=ends.repeat_interleave(lens_t).to(device),
        )

    def to(self, device) -> Segments:
        nb = torch.device(device).type == "cuda"
        return Segments(
            self.bounds,
            self.cu_seqlens.to(device, non_blocking=nb),
            self.max_len,
            self.positions_N.to(device, non_blocking=nb),
            self.ends_N.to(device, non_blocking=nb),
        )

    def pin_memory(self) -> Segments:
        return Segments(
            self.bounds,
            self.cu_seqlens.pin_memory(),
            self.max_len,
            self.positions_N.pin_memory(),
            self.ends_N.pin_memory(),
        )


# ----------------------------------------------------------------------------------------------
# causal attention within segments: q [1, H, N, d], k/v [1, H, N, d] (kv already repeated to H heads)


def segment_causal_mask(seg: Segments, device) -> torch.Tensor:
    """[N, N] bool: key j visible to query i (causal, same segment)."""
    idx = torch.arange(seg.total, device=device)
    starts = idx - seg.positions_N.to(device)
    return (idx[None, :] <= idx[:, None]) & (idx[None, :] >= starts[:, None])


def math_fwd(q, k, v, scale, seg: Segments):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~segment_causal_mask(seg, q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse, None


def math_bwd(dout, q, k, v, out, lse, scale, seg: Segments, aux):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~segment_causal_mask(seg, q.device), float("-inf"))
    p = torch.exp(s - lse.float()[..., None])
    do = dout.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.float().transpose(-1, -2)
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-1, -2) @ q.float()).to(k.dtype), dv.to(v.dtype)


def cpu_fwd(q, k, v, scale, seg: Segments):
    outs, lses = [], []
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:]):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], 0.0, True, scale=scale
        )
        outs.append(o)
        lses.append(lse[..., : b - a])
    return torch.cat(outs, 2), torch.cat(lses, -1), None


def cpu_bwd(dout, q, k, v, out, lse, scale, seg: Segments, aux):
    grads = []
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:]):
        sl = slice(a, b)
        grads.append(
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, sl].contiguous(),
                q[:, :, sl].contiguous(),
                k[:, :, sl].contiguous(),
                v[:, :, sl].contiguous(),
                out[:, :, sl].contiguous(),
                lse[..., sl].contiguous(),
                0.0,
                True,
                scale=scale,
            )
        )
    return tuple(torch.cat([g[i] for g in grads], 2) for i in range(3))


def _segment_ids(seg: Segments, device) -> torch.Tensor:
    idx = torch.arange(seg.total, device=device)
    return torch.searchsorted(seg.cu_seqlens[1:].to(device=device, dtype=torch.int64), idx, right=True)


def cuda_fwd(q, k, v, scale, seg: Segments):
    """Varlen flash: q/k/v [1, H, N, d] -> out [1, H, N, d], lse [1, H, N] (fp32)."""
    cu = seg.cu_seqlens
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # N, H, d
    res = torch.ops.aten._flash_attention_forward(
        qt, kt, vt, cu, cu, seg.max_len, seg.max_len, 0.0, True, False, scale=scale
    )
    out, lse, rng_state, unused = res[0], res[1], res[2], res[3]
    padded_shape = None
    if lse.dim() == 3:  # older flash builds: [segments, heads, longest] padded per segment
        padded_shape = tuple(lse.shape)
        lse = lse[_segment_ids(seg, lse.device), :, seg.positions_N].T  # -> [H, N]
    return out.transpose(0, 1)[None], lse[None], (rng_state, unused, padded_shape)


def cuda_bwd(dout, q, k, v, out, lse, scale, seg: Segments, aux):
    rng_state, unused, padded_shape = aux
    cu = seg.cu_seqlens
    t = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731
    lse = lse[0].float().contiguous()
    if padded_shape is not None:
        padded = lse.new_zeros(padded_shape)
        padded[_segment_ids(seg, lse.device), :, seg.positions_N] = lse.T
        lse = padded
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        t(dout),
        t(q),
        t(k),
        t(v),
        t(out),
        lse,
        cu,
        cu,
        seg.max_len,
        seg.max_len,
        0.0,
        True,
        rng_state,
        unused,
        scale=scale,
    )
    return tuple(x.transpose(0, 1)[None] for x in (dq, dk, dv))


def segments_fwd(q, k, v, scale, seg: Segments):
    """The math kernel one segment at a time (memory O(longest segment^2)): the safe fallback."""
    outs, lses = [], []
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:]):
        one = Segments.from_lengths([b - a], q.device)
        o, lse, _ = math_fwd(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale, one)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, -1), None


def segments_bwd(dout, q, k, v, out, lse, scale, seg: Segments, aux):
    grads = []
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:]):
        one = Segments.from_lengths([b - a], q.device)
        sl = slice(a, b)
        grads.append(
            math_bwd(
                dout[:, :, sl], q[:, :, sl], k[:, :, sl], v[:, :, sl], out[:, :, sl], lse[..., sl], scale, one, None
            )
        )
    return tuple(torch.cat([g[i] for g in grads], 2) for i in range(3))


VARLEN_KERNELS = {
    "math": (math_fwd, math_bwd),
    "segments": (segments_fwd, segments_bwd),
    "cpu-flash": (cpu_fwd, cpu_bwd),
    "cuda-flash": (cuda_fwd, cuda_bwd),
}


def pick_varlen_kernel(q: torch.Tensor) -> str:
    return _pick_kernel(q.device, q.dtype, q.shape[-1])


def _pick_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    if device.type == "cuda":
        ok = dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and head_dim % 8 == 0
        return "cuda-flash" if ok and kernels.use("varlen_flash", device, dtype) else "segments"
    return "cpu-flash" if device.type == "cpu" else "segments"


def gqa_flash(kernel: str, like: torch.Tensor) -> bool:
    """Keys/values with fewer heads than the queries go to the varlen flash kernel as they are, read in its
    grouped-query mode, instead of repeated to every query head first (a [tokens, heads, d] copy each and, in
    training, a sum of the repeated gradients): with the "cuda-flash" kernel where that mode passed its check on
    tensors like `like` (kernels: `gqa_flash`); elsewhere the keys are repeated."""
    return kernel == "cuda-flash" and kernels.use("gqa_flash", like.device, like.dtype)


def _random_packed(device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    seg = Segments.from_lengths([37, 1, 200, 64, 9], device)
    mk = lambda: torch.randn(1, 4, seg.total, 64, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return seg, mk(), mk(), mk()


def _max_diff(a: tuple, b: tuple) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def check_varlen_flash(device, dtype=torch.bfloat16) -> str | None:
    """None when the varlen flash kernel's output and log-sum-exp equal the per-segment math kernel's (within 0.05)
    on random packed inputs; else why not (training then runs the slower exact kernel instead of learning from wrong
    attention)."""
    seg, q, k, v = _random_packed(device, dtype)
    ref = segments_fwd(q, k, v, 0.125, seg)[:2]
    try:
        err = _max_diff(cuda_fwd(q, k, v, 0.125, seg)[:2], ref)
    except Exception as exc:  # noqa: BLE001  (any failure of a fast kernel means: do not use it)
        return f"the varlen flash kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None if err <= 0.05 else f"the varlen flash kernel differs from the math kernel by {err:.3g}"


def check_gqa_flash(device, dtype=torch.bfloat16) -> str | None:
    """None when the varlen flash kernel reading 2 key/value heads for 4 query heads equals the math kernel on the
    keys repeated (within 0.05); else why not."""
    if not kernels.use("varlen_flash", device, dtype):
        return "the varlen flash kernel does not run here"
    seg, q, k, v = _random_packed(device, dtype)
    kg, vg = k[:, :2].contiguous(), v[:, :2].contiguous()
    ref = segments_fwd(q, kg.repeat_interleave(2, 1), vg.repeat_interleave(2, 1), 0.125, seg)[:2]
    try:
        err = _max_diff(cuda_fwd(q, kg, vg, 0.125, seg)[:2], ref)
    except Exception as exc:  # noqa: BLE001  (then the keys are repeated)
        return f"the flash kernel's grouped-query mode failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None if err <= 0.05 else f"the flash kernel's grouped-query mode differs by {err:.3g}"


def check_varlen_kernel(device, dtype=torch.bfloat16, *, seed: int = 0) -> float:
    """Max |difference| of the picked kernel's output and log-sum-exp against the per-segment math kernel on random
    packed inputs (the picked kernel passed its start-up check, or is the exact one)."""
    seg, q, k, v = _random_packed(device, dtype, seed)
    kernel = pick_varlen_kernel(q)
    return _max_diff(VARLEN_KERNELS[kernel][0](q, k, v, 0.125, seg)[:2], segments_fwd(q, k, v, 0.125, seg)[:2])


@torch.no_grad()
def causal_attention(
    q_1HNd: torch.Tensor,
    k_1HNd: torch.Tensor,
    v_1HNd: torch.Tensor,
    seg: Segments,
    *,
    scale: float,
    kernel: str | None = None,
) -> torch.Tensor:
    """Forward-only causal attention inside each segment (the target's forward)."""
    kernel = kernel or pick_varlen_kernel(q_1HNd)
    return VARLEN_KERNELS[kernel][0](q_1HNd, k_1HNd, v_1HNd, scale, seg)[0]


# ----------------------------------------------------------------------------------------------
# the target over a packed row


SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def packed_unsupported_reason(model) -> str | None:
    """None when `target_forward_packed` reproduces the model's own forward; else why not."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mtype = getattr(config, "model_type", "?")
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not laid out as model.embed_tokens / layers / norm / rotary_emb"
    for layer in base.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        if getattr(layer, "attention_type", "full_attention") != "full_attention":
            return f"attention type {layer.attention_type!r}"
    return None


@torch.no_grad()
def target_forward_packed(
    model, input_ids_N: torch.Tensor, seg: Segments, *, layer_ids: list[int], kernel: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_NAD, final_ND) for a packed row: aux[:, a] = input to decoder layer layer_ids[a]
    (pre-norm residual stream), final = the final norm's output; samples never see each other."""
    base = model.model
    wanted: dict[int, list[int]] = {}  # layer -> aux slots (an id may be asked for twice)
    for a, i in enumerate(layer_ids):
        wanted.setdefault(i, []).append(a)
    x = base.embed_tokens(input_ids_N[None])  # 1, N, D
    cos, sin = base.rotary_emb(x, seg.positions_N[None])  # 1, N, d
    cos, sin = cos[:, None], sin[:, None]  # 1, 1, N, d
    aux = [None] * len(layer_ids)
    for i, layer in enumerate(base.layers):
        for a in wanted.get(i, ()):
            aux[a] = x[0]
        x = _decoder_layer_packed(layer, x, cos, sin, seg, kernel=kernel)
    final = base.norm(x)[0]
    return torch.stack(aux, dim=1), final


@torch.no_grad()
def tail_forward_packed(
    model, start_ND: torch.Tensor, seg: Segments, *, first_layer: int, kernel: str | None = None
) -> torch.Tensor:
    """final_ND = norm(layers[first_layer:](start)) for a packed row whose residual stream entering
    layer `first_layer` is given (`start_ND`, e.g. a stored aux layer): the last layers alone, with
    positions restarting in each segment, as `target_forward_packed` would run them."""
    base = model.model
    dtype = base.embed_tokens.weight.dtype
    x = start_ND.to(dtype)[None]  # 1, N, D
    cos, sin = base.rotary_emb(x, seg.positions_N[None])
    cos, sin = cos[:, None], sin[:, None]
    assert x.shape[1] == seg.total, (tuple(x.shape), seg.total)
    for layer in list(base.layers)[first_layer:]:
        x = _decoder_layer_packed(layer, x, cos, sin, seg, kernel=kernel)
    return base.norm(x)[0]


_COMPILE_ON = ("cuda",)
"""Device types whose packed target forward runs each decoder layer's pieces around the attention as two compiled
functions shared by every layer (fewer elementwise kernels a layer); eager elsewhere (the CPU's compile is slow)."""
_LAYER_FNS: dict[str, tuple] = {}


def _attn_inputs(layer, x, cos, sin, repeat: bool = True):
    """q [1, H, N, d], k, v [1, K, N, d] (repeated to the H query heads when `repeat`) for the layer's attention
    over x [1, N, D]. (q/k/v's and gate/up's weights stacked, one product each, were slower.)"""
    attn = layer.self_attn
    d = int(attn.head_dim)
    N = x.shape[1]
    h = layer.input_layernorm(x)
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q, k, v = q.view(1, N, -1, d), k.view(1, N, -1, d), v.view(1, N, -1, d)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and repeat:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return q, k, v


def _attn_output_and_mlp(layer, x, o):
    """The residual stream after the layer, from its input x [1, N, D] and the attention's output o [1, H, N, d]."""
    N = x.shape[1]
    x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(1, N, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _layer_fns(compiled: bool):
    if not compiled:
        return _attn_inputs, _attn_output_and_mlp
    if "compiled" not in _LAYER_FNS:
        _LAYER_FNS["compiled"] = (
            torch.compile(_attn_inputs, dynamic=True),
            torch.compile(_attn_output_and_mlp, dynamic=True),
        )
    return _LAYER_FNS["compiled"]


def _decoder_layer_packed(layer, x_1ND: torch.Tensor, cos, sin, seg: Segments, *, kernel: str | None) -> torch.Tensor:
    """One Llama/Qwen decoder layer over a packed row (residual stream in, residual stream out)."""
    pre, post = _layer_fns(x_1ND.device.type in _COMPILE_ON)
    attn = layer.self_attn
    d = int(attn.head_dim)
    kernel = kernel or _pick_kernel(x_1ND.device, x_1ND.dtype, d)
    q, k, v = pre(layer, x_1ND, cos, sin, not gqa_flash(kernel, x_1ND))
    scale = float(getattr(attn, "scaling", 1.0 / math.sqrt(d)))
    o = causal_attention(q, k, v, seg, scale=scale, kernel=kernel)
    return post(layer, x_1ND, o)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def pad_lengths(lengths: Sequence[int], pad_to: int | None) -> list[int]:
    """Segment lengths with a padding segment appended to reach `pad_to` tokens (if longer)."""
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    if pad_to is not None and pad_to > total:
        lengths.append(pad_to - total)
    return lengths
