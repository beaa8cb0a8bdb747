"""A static-KV-cache forward for Llama/Qwen-style targets, built on the Hugging Face modules.

Why not transformers' StaticCache: the per-step cost that limits `generate` on a small target is
Python and kernel-launch overhead (for SmolLM2 nearly the whole step, whatever the batch). Here a
decode step is a fixed-shape function of static buffers (token, position, cache), so on CUDA it is
captured once as a CUDA graph and replayed for the cost of one launch.

The layers' own modules do the arithmetic (norms, q/k/v/o projections, Qwen3's q/k norms, the MLP,
the rotary table), so the weights, biases and rounding are Hugging Face's; only the cache and the
attention call are ours (eyas.regen.attention). Each row of the batch is an independent sequence
with its own position: rows start at position 0 in their own cache slot, so finished rows can be
refilled with a new prompt while the others keep decoding.

Decode attention reads only each row's own keys: with `attention="triton"` a kernel takes the
per-row lengths on the device (one graph for every length); with "sdpa" (CPU, or no Triton) SDPA
attends over a span of the cache that covers every row, masked per row, and the engine captures one
graph per span. Prefill packs the prompts without padding.

Shape legend: B batch rows, N prefill prompts, T packed prompt tokens, S cache length, D hidden,
H query heads, K kv heads, G = H/K, d head dim, V vocab.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from eyas.common import log
from eyas.regen import attention as A

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

    def __init__(self, model, *, batch: int, max_len: int, attention: str = "auto", prefill: str = "auto"):
        """`attention`: decode attention, "triton" (per-row lengths), "sdpa" (span + mask), or "auto"
        (triton where it runs and passes a check against sdpa, else sdpa). `prefill`: "flash"
        (varlen, CUDA bf16/fp16), "sdpa" (per prompt), or "auto"."""
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise ValueError(f"StaticLM cannot run this model: {reason}")
        if attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"attention must be auto, triton or sdpa, got {attention!r}")
        if prefill not in ("auto", "flash", "sdpa"):
            raise ValueError(f"prefill must be auto, flash or sdpa, got {prefill!r}")
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
        self.attention_note: str | None = None  # why the fast path is not used, when it is not
        self.attention = self._choose_attention(attention)
        self.prefill_note: str | None = None
        self.prefill_kind = self._choose_prefill(prefill)

    # -- backend choice ----------------------------------------------------------------------------
    def _choose_attention(self, want: str) -> str:
        if want == "sdpa":
            return "sdpa"
        why = A.triton_unavailable(self.device)
        if why is None:
            why = self._check_triton()
        if why is None:
            return "triton"
        if want == "triton":
            raise ValueError(f"attention='triton': {why}")
        self.attention_note = why
        if self.device.type == "cuda":
            log(f"regen: decode attention falls back to SDPA over spans ({why})")
        return "sdpa"

    @torch.no_grad()
    def _check_triton(self) -> str | None:
        """Run the kernel once on random data shaped like this cache against SDPA (a failed compile
        or a wrong answer on a new machine must cost speed, not correctness)."""
        g = torch.Generator(device="cpu").manual_seed(0)
        B, S = 3, min(self.max_len, 2 * A.SPLIT + 3)
        q = torch.randn(B, self.heads, self.head_dim, generator=g).to(self.device, self.dtype)
        k = torch.randn(B, self.kv_heads, S, self.head_dim, generator=g).to(self.device, self.dtype)
        v = torch.randn(B, self.kv_heads, S, self.head_dim, generator=g).to(self.device, self.dtype)
        len_B = torch.tensor([1, max(1, S // 2 - 5), S], device=self.device)
        try:
            got = A.decode_triton(q, k, v, len_B, 0.125).float()
        except Exception as exc:  # compile or launch failure
            return f"the Triton kernel failed: {type(exc).__name__}: {str(exc)[:300]}"
        ref = A.decode_reference(q, k, v, len_B, 0.125, S).float()
        err = (got - ref).abs().max().item()
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        if not err <= tol:
            return f"the Triton kernel disagrees with SDPA (max error {err:.3g} > {tol})"
        return None

    def _choose_prefill(self, want: str) -> str:
        if want == "sdpa":
            return "sdpa"
        why = A.flash_varlen_unavailable(self.device, self.dtype)
        if why is None:
            why = self._check_flash()
        if why is None:
            return "flash"
        if want == "flash":
            raise ValueError(f"prefill='flash': {why}")
        self.prefill_note = why
        return "sdpa"

    @torch.no_grad()
    def _check_flash(self) -> str | None:
        g = torch.Generator(device="cpu").manual_seed(1)
        lens = [5, 1, 70]
        T = sum(lens)
        q = torch.randn(T, self.heads, self.head_dim, generator=g).to(self.device, self.dtype)
        k = torch.randn(T, self.kv_heads, self.head_dim, generator=g).to(self.device, self.dtype)
        v = torch.randn(T, self.kv_heads, self.head_dim, generator=g).to(self.device, self.dtype)
        cu = torch.tensor([0, 5, 6, T], dtype=torch.int32, device=self.device)
        try:
            got = A.prefill_flash(q, k, v, cu, max(lens), 0.125).float()
        except Exception as exc:
            return f"varlen flash attention failed: {type(exc).__name__}: {str(exc)[:300]}"
        err = (got - A.prefill_per_prompt(q, k, v, lens, 0.125).float()).abs().max().item()
        return None if err <= 3e-2 else f"varlen flash attention disagrees with SDPA (max error {err:.3g})"

    @property
    def cache_bytes(self) -> int:
        return 2 * sum(c.numel() * c.element_size() for c in self.cache_k)

    # -- shared pieces ---------------------------------------------------------------------------
    def _qkv(self, attn, h_TD: torch.Tensor):
        """q [T, H, d], k and v [T, K, d] of T tokens (any leading shape flattened to T)."""
        q = attn.q_proj(h_TD).view(-1, self.heads, self.head_dim)
        k = attn.k_proj(h_TD).view(-1, self.kv_heads, self.head_dim)
        v = attn.v_proj(h_TD).view(-1, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x_ND)).float()

    # -- prefill: new prompts into chosen rows ---------------------------------------------------
    @torch.no_grad()
    def prefill(self, rows: list[int], ids_T: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Run prompts packed end to end (ids_T = prompt 0's ids, then prompt 1's, ...; lens their
        lengths), write their K/V into cache rows `rows` at positions 0..len-1, return the logits
        at each prompt's last token, [N, V] float32."""
        assert max(lens) <= self.max_len and sum(lens) == ids_T.shape[0]
        dev = self.device
        # Per token: its position within its prompt and its cache row (host-built, one copy each).
        pos_T = torch.cat([torch.arange(n) for n in lens]).to(dev, non_blocking=True)
        row_T = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lens)).to(dev, non_blocking=True)
        cu_list = [0]
        for n in lens:
            cu_list.append(cu_list[-1] + n)
        cu_N1 = torch.tensor(cu_list, dtype=torch.int32, device=dev)
        last_N = cu_N1[1:].long() - 1
        cos = self.cos_Sd[pos_T][:, None]  # T,1,d
        sin = self.sin_Sd[pos_T][:, None]
        x = self.embed(ids_T)[None]  # 1,T,D: the layers' modules see a batch of one
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x))
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache_k[i][row_T, :, pos_T] = k  # [T, K, d] into [B, K, S, d] at (row, :, pos)
            self.cache_v[i][row_T, :, pos_T] = v
            if self.prefill_kind == "flash":
                o = A.prefill_flash(q, k, v, cu_N1, max(lens), attn.scaling)
            else:
                o = A.prefill_per_prompt(q, k, v, lens, attn.scaling)
            x = x + attn.o_proj(o.reshape(1, -1, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[0, last_N])

    # -- decode: one token per row (the function a CUDA graph captures) --------------------------
    def decode(
        self, tok_B: torch.Tensor, pos_B: torch.Tensor, len_B: torch.Tensor | None = None, span: int | None = None
    ) -> torch.Tensor:
        """Feed tok_B at pos_B (writing the cache there), attend to each row's keys [0, len_B)
        (default pos_B + 1), return next-token logits [B, V] float32. Fixed shapes, no host syncs.

        `span` (sdpa attention only; default the whole cache) must cover every row's length."""
        if len_B is None:
            len_B = pos_B + 1
        with self._decode_kernels():
            return self._decode(tok_B, pos_B, len_B, span or self.max_len)

    def _decode_kernels(self):
        """On CUDA with SDPA, pin decode attention to the memory-efficient kernel (masks,
        GQA-as-queries and graph capture all supported), with math as the fallback."""
        if self.device.type != "cuda" or self.attention != "sdpa":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _decode(self, tok_B: torch.Tensor, pos_B: torch.Tensor, len_B: torch.Tensor, span: int) -> torch.Tensor:
        B = tok_B.shape[0]
        cos = self.cos_Sd[pos_B][:, None]  # B,1,d
        sin = self.sin_Sd[pos_B][:, None]
        write_BK1d = pos_B.view(B, 1, 1, 1).expand(B, self.kv_heads, 1, self.head_dim)
        x = self.embed(tok_B)[:, None]  # B,1,D
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x))  # B,H,d / B,K,d
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache_k[i].scatter_(2, write_BK1d, k[:, :, None])
            self.cache_v[i].scatter_(2, write_BK1d, v[:, :, None])
            if self.attention == "triton":
                o = A.decode_triton(q, self.cache_k[i], self.cache_v[i], len_B, attn.scaling)
            else:
                o = A.decode_reference(q, self.cache_k[i], self.cache_v[i], len_B, attn.scaling, span)
            x = x + attn.o_proj(o.reshape(B, 1, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[:, 0])

    def describe(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "max_len": self.max_len,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "cache_bytes": self.cache_bytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "decode_attention": self.attention,
            "decode_attention_note": self.attention_note,
            "prefill_attention": self.prefill_kind,
            "prefill_note": self.prefill_note,
        }
