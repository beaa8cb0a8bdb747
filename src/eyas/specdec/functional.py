"""The EAGLE-3 draft layer as plain functions over its weights, with the KV layout speculative decoding needs.

Why a second implementation beside eyas.drafter.model: decoding needs a step the training model does not
have, a draft step whose queries attend to (a) the step-0 keys of the accepted prefix and (b) the keys
of their own ancestors in a draft tree. Written over SGLang-named weights, it also runs drafters read
from SGLang and vLLM/speculators checkpoints. tests/test_export_formats.py checks it against
Eagle3Drafter's logits.

Shape legend: B sequences, L positions, N queries per sequence, E tree slots, H draft hidden,
F target feature width (A aux layers x target hidden), Vd draft vocab, k heads, d head dim.

Step 0 (one causal pass over the accepted sequence s_0..s_{L-1} with target features aux_0..aux_{L-1}):
    position t: token s_{t+1}, feature fc(aux_t), RoPE position t  ->  output o_t predicts s_{t+2}
    tokens [a b c d], features [Fa Fb Fc Fd] -> step-0 inputs (b,Fa) (c,Fb) (d,Fc) at positions 0 1 2
Draft step j >= 1 from round start t (the last position with target features):
    token = the draft token chosen at step j-1, feature = the PRE-norm output that proposed it,
    RoPE position t + j, attends to step-0 keys at positions <= t and to its tree ancestors' keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eyas.drafter.model import DrafterConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in fp32, scale in the input dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FunctionalDrafter:
    """An EAGLE-3 draft layer bound to weights, a device and a dtype; no autograd."""

    def __init__(
        self,
        config: DrafterConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        embed_tokens: torch.Tensor | None = None,
    ):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        w = {}
        for key, t in weights.items():
            if key in ("d2t", "t2d"):
                continue
            w[key] = t.to(device=self.device, dtype=dtype)
        if "embed_tokens.weight" not in w:
            if embed_tokens is None:
                raise ValueError("the drafter has no embed_tokens.weight: pass the target's input embedding")
            w["embed_tokens.weight"] = embed_tokens.to(device=self.device, dtype=dtype)
        self.w = w
        self.d2t = weights["d2t"].to(device=self.device, dtype=torch.long)
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._inv_freq, self._attention_scaling = self._rope_frequencies()

    # ---- RoPE -----------------------------------------------------------------------------------
    def _rope_frequencies(self):
        """inv_freq for the config's rope type: default/linear/llama3 as the training model computes them,
        anything else (yarn, ...) through transformers' own initialisers."""
        from eyas.drafter.model import SUPPORTED_ROPE, rope_inv_freq

        s = self.config
        rp = dict(s.rope_parameters)
        rope_type = rp["rope_type"]
        if rope_type in SUPPORTED_ROPE:
            return rope_inv_freq(s).to(self.device), 1.0
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = LlamaConfig(
            hidden_size=s.num_attention_heads * s.head_dim,
            num_attention_heads=s.num_attention_heads,
            head_dim=s.head_dim,
            max_position_embeddings=s.max_position_embeddings,
            rope_parameters=rp,
        )
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, self.device)
        return inv.float().to(self.device), float(scaling)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [..., N, heads, d], pos [..., N] -> rotated x (neox/HF rotate-half layout)."""
        freqs = pos.to(torch.float32)[..., None] * self._inv_freq  # [..., N, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self._attention_scaling).to(x.dtype)[..., None, :]
        sin = (emb.sin() * self._attention_scaling).to(x.dtype)[..., None, :]
        return x * cos + rotate_half(x) * sin

    # ---- pieces ---------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w["embed_tokens.weight"])

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [..., A*Ht] (low, mid, high concatenated) -> draft features [..., H]."""
        return F.linear(aux.to(self.dtype), self.w["fc.weight"])

    def qkv(self, ids: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor):
        """ids [B, N], feat [B, N, H], pos [B, N] -> q [B, k, N, d], key/value [B, kv, N, d], residual [B, N, H]."""
        s, w = self.config, self.w
        hidden = rms_norm(feat, w["midlayer.hidden_norm.weight"], self.eps)
        residual = hidden if s.norm_before_residual else feat
        x = torch.cat([rms_norm(self.embed(ids), w["midlayer.input_layernorm.weight"], self.eps), hidden], dim=-1)
        B, N = ids.shape
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"]).view(B, N, s.num_attention_heads, s.head_dim)
        k = F.linear(x, w["midlayer.self_attn.k_proj.weight"]).view(B, N, s.num_key_value_heads, s.head_dim)
        v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(B, N, s.num_key_value_heads, s.head_dim)
        q, k = self.rope(q, pos), self.rope(k, pos)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B, k, N, d] -> the layer's PRE-norm output [B, N, H] (the feature for the next step)."""
        w = self.w
        B, _, N, _ = attn.shape
        h = residual + F.linear(attn.transpose(1, 2).reshape(B, N, -1), w["midlayer.self_attn.o_proj.weight"])
        x = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        mlp = F.linear(
            F.silu(F.linear(x, w["midlayer.mlp.gate_proj.weight"])) * F.linear(x, w["midlayer.mlp.up_proj.weight"]),
            w["midlayer.mlp.down_proj.weight"],
        )
        return h + mlp

    def attend(self, q, k, v, *, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        gqa = self.config.num_attention_heads != self.config.num_key_value_heads
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
        )

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """PRE-norm output [..., H] -> draft-vocabulary logits [..., Vd] in fp32."""
        return F.linear(rms_norm(out, self.w["norm.weight"], self.eps), self.w["lm_head.weight"]).float()

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(out), dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft id i -> target id i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids]

    # ---- whole passes ---------------------------------------------------------------------------
    @torch.no_grad()
    def causal_forward(self, ids: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor):
        """A plain causal pass: ids [B, N], feat [B, N, H] (already fused), pos [B, N].

        Returns (out [B, N, H] pre-norm, key [B, kv, N, d], value [B, kv, N, d]).
        """
        q, k, v, residual = self.qkv(ids, feat, pos)
        return self.finish(self.attend(q, k, v, causal=True), residual), k, v

    @torch.no_grad()
    def step0(self, ids_BL: torch.Tensor, aux_BLF: torch.Tensor):
        """The step-0 pass over whole sequences (right-padded): position t gets (s_{t+1}, fc(aux_t)).

        Returns (out [B, L-1, H], key [B, kv, L-1, d], value [B, kv, L-1, d]); rows past a sequence's
        end are garbage that no later query may attend to.
        """
        B, L = ids_BL.shape
        pos = torch.arange(L - 1, device=ids_BL.device).expand(B, L - 1)
        return self.causal_forward(ids_BL[:, 1:], self.fuse(aux_BLF[:, :-1]), pos)
