"""A static-KV-cache forward for Llama/Qwen-style targets, built on the Hugging Face modules.

Why not transformers' StaticCache: the per-step cost that limits `generate` on a small target is
Python and kernel-launch overhead (~60 ms a step on the H200 for SmolLM2 whatever the batch). Here a
decode step is a fixed-shape function of static buffers (token, position, cache), so on CUDA it is
captured once per attention-length bucket as a CUDA graph and replayed for the cost of one launch.

The layers' own modules do the arithmetic (norms, q/k/v/o projections, Qwen3's q/k norms, the MLP,
the rotary table), so the weights, biases and rounding are Hugging Face's; only the cache and the
attention call are ours. Each row of the batch is an independent sequence with its own position:
rows start at position 0 (no padding inside the cache), so finished rows can be refilled with a
new prompt while the others keep decoding.

Decode attention is grouped-query without copying the cache: the G = H/KV query heads that share a
KV head are laid out as G query "positions" of that head, q_BKGd @ k_BKSd, one SDPA call, masked to
keys at positions <= the row's position.

Shape legend: B batch rows, N prefill rows, L prompt tokens, S cache length (bucket), D hidden,
H query heads, K kv heads, G = H/K, d head dim, V vocab.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported_reason(model, max_len: int) -> str | None:
    """None when StaticLM can run `model` exactly; else why not (the caller falls back to generate)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mtype = getattr(config, "model_type", "?")
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in _DYNAMIC_ROPE:
        return f"rope type {rope.get('rope_type')!r} depends on the sequence length"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not laid out as model.embed_tokens / layers / norm / rotary_emb"
    for layer in base.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < max_len:
            return f"sliding-window attention ({window} < max length {max_len})"
        for name in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn"):
            if not hasattr(layer, name):
                return f"decoder layer lacks `{name}`"
    return None


class StaticLM:
    """Static cache [B, K, S_max, d] per layer over a Hugging Face causal LM's modules."""

    def __init__(self, model, *, batch: int, max_len: int):
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise ValueError(f"StaticLM cannot run this model: {reason}")
        self.model = model
        base = model.model
        self.embed, self.layers, self.norm, self.lm_head = base.embed_tokens, base.layers, base.norm, model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.heads = int(attn.q_proj.out_features) // self.head_dim
        self.kv_heads = int(attn.k_proj.out_features) // self.head_dim
        self.groups = self.heads // self.kv_heads
        self.batch, self.max_len = batch, max_len
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        self.cache_k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.cache_v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        # Hugging Face computes cos/sin elementwise per position, so a table equals its per-call values.
        with torch.no_grad():
            pos_1S = torch.arange(max_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = base.rotary_emb(probe, pos_1S)
        self.cos_Sd, self.sin_Sd = cos[0].contiguous(), sin[0].contiguous()
        self.key_pos_S = torch.arange(max_len, device=self.device)

    @property
    def cache_bytes(self) -> int:
        return 2 * sum(c.numel() * c.element_size() for c in self.cache_k)

    # -- shared pieces ---------------------------------------------------------------------------
    def _qkv(self, attn, h_BTD: torch.Tensor):
        B, T, _ = h_BTD.shape
        q = attn.q_proj(h_BTD).view(B, T, -1, self.head_dim)
        k = attn.k_proj(h_BTD).view(B, T, -1, self.head_dim)
        v = attn.v_proj(h_BTD).view(B, T, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # B,H,T,d / B,K,T,d

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x_ND)).float()

    # -- prefill: new prompts into chosen rows ---------------------------------------------------
    @torch.no_grad()
    def prefill(self, rows_N: torch.Tensor, ids_NL: torch.Tensor, lens_N: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts, write their K/V into cache rows `rows_N` at positions 0..L-1,
        return the logits at each prompt's last token, [N, V] float32."""
        N, L = ids_NL.shape
        assert L <= self.max_len
        cos = self.cos_Sd[:L][None, None]  # 1,1,L,d (same positions for every row: all start at 0)
        sin = self.sin_Sd[:L][None, None]
        x = self.embed(ids_NL)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(attn, h)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache_k[i][rows_N, :, :L] = k
            self.cache_v[i][rows_N, :, :L] = v
            # Right padding: a real token only sees earlier real tokens under the causal mask.
            kr = k.repeat_interleave(self.groups, dim=1) if self.groups > 1 else k
            vr = v.repeat_interleave(self.groups, dim=1) if self.groups > 1 else v
            o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=attn.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(N, L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last_ND = x[torch.arange(N, device=x.device), lens_N - 1]
        return self._logits(last_ND)

    # -- decode: one token per row (the function a CUDA graph captures) --------------------------
    def decode(self, tok_B: torch.Tensor, pos_B: torch.Tensor, span: int | tuple[int, ...],
               lanes: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Feed tok_B at pos_B (writing the cache there), attend to keys [0, span) masked to
        <= pos_B, return next-token logits [B, V] float32. Fixed shapes, no host syncs.

        With `lanes` (row ranges [lo, hi) covering the batch in order) `span` is one span per lane:
        each lane's rows attend over their own span, so rows with short contexts do not pay for the
        longest row's. Everything but attention still runs on the whole batch at once."""
        spans = (span,) if isinstance(span, int) else tuple(span)
        lanes = lanes or [(0, tok_B.shape[0])]
        assert len(spans) == len(lanes) and lanes[0][0] == 0 and lanes[-1][1] == tok_B.shape[0], (spans, lanes)
        with self._decode_kernels():
            return self._decode(tok_B, pos_B, spans, lanes)

    def _decode_kernels(self):
        """On CUDA, pin decode attention to the memory-efficient kernel (masks, GQA-as-queries and
        graph capture all supported), with math as the fallback; elsewhere, PyTorch's choice."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _decode(self, tok_B: torch.Tensor, pos_B: torch.Tensor, spans: tuple[int, ...],
                lanes: list[tuple[int, int]]) -> torch.Tensor:
        B = tok_B.shape[0]
        cos = self.cos_Sd[pos_B][:, None, None]  # B,1,1,d
        sin = self.sin_Sd[pos_B][:, None, None]
        masks = [(self.key_pos_S[:s][None, :] <= pos_B[lo:hi, None])[:, None, None, :]  # b,1,1,S per lane
                 for (lo, hi), s in zip(lanes, spans)]
        write_BK1d = pos_B.view(B, 1, 1, 1).expand(B, self.kv_heads, 1, self.head_dim)
        x = self.embed(tok_B)[:, None]  # B,1,D
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(attn, h)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache_k[i].scatter_(2, write_BK1d, k)
            self.cache_v[i].scatter_(2, write_BK1d, v)
            q_BKGd = q.reshape(B, self.kv_heads, self.groups, self.head_dim)
            parts = [F.scaled_dot_product_attention(q_BKGd[lo:hi], self.cache_k[i][lo:hi, :, :s],
                                                    self.cache_v[i][lo:hi, :, :s], attn_mask=m, scale=attn.scaling)
                     for (lo, hi), s, m in zip(lanes, spans, masks)]
            o = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            x = x + attn.o_proj(o.reshape(B, 1, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[:, 0])

    def describe(self) -> dict[str, Any]:
        return {"batch": self.batch, "max_len": self.max_len, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "cache_bytes": self.cache_bytes, "dtype": str(self.dtype).removeprefix("torch.")}
