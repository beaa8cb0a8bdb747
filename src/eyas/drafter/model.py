"""The EAGLE-3 draft model, laid out exactly as SGLang and vLLM serve it.

Architecture. For one draft step at position t:

    feature_BTD  = fc(aux_BT3D)                      first step: the target's low/mid/high states
                 | hidden_prenorm of the previous step  later steps: the draft's own output
    x_BT2D       = cat(input_layernorm(embed(token)), hidden_norm(feature))   embedding first
    attn_BTD     = o_proj(attention(q/k/v_proj(x_BT2D), RoPE))               q/k/v map 2D -> heads
    h_BTD        = feature + attn                     the residual is the feature BEFORE hidden_norm
    hidden_BTD   = h + mlp(post_attention_layernorm(h))                      SwiGLU
    logits_BTV   = lm_head(norm(hidden_BTD))          over the DRAFT vocabulary (V = draft vocab)

The state_dict uses SGLang's key names (`fc.weight`, `midlayer.self_attn.q_proj.weight`, ...,
`norm.weight`, `lm_head.weight`, `embed_tokens.weight`, buffers `d2t` int64 offsets and `t2d`
bool), so exporting is a rename-free copy. `embed_tokens` is the target's, copied in and frozen.

API for callers (training, speculative decoding, export):
    DrafterConfig.from_target_config(hf_cfg, draft_vocab_size=, aux_layer_ids=)
    drafter.project_aux(aux_BTAD)                       -> feature_BTD   (fc; first step only)
    drafter.forward_step(ids_BT, feature_BTD, pos_BT, attention_mask=, cache=)
                                                        -> (hidden_prenorm_BTD, logits_BTV)
    drafter.compute_logits(hidden_prenorm_BTD)          -> logits_BTV over the draft vocab
    drafter.draft_to_target(draft_ids)                  -> target ids (via d2t offsets)
    drafter.save(dir, target=...), Eagle3Drafter.load(dir)   (the eyas layout, drafter/writer.py)
The training-time-test loop (drafter/ttt/) uses the lower-level `midlayer.project_qkv` /
`midlayer.finish` pair so it can run its own attention.

Shape legend: B batch, T new tokens, S keys (cached + new), D hidden size, A aux layers,
H query heads, K key/value heads, d head dim, V draft vocab, Vt target vocab.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.errors import EyasError

SUPPORTED_ROPE = ("default", "linear", "llama3")


# ----------------------------------------------------------------------------------------------
# config


@dataclass(kw_only=True)
class DrafterConfig:
    """Everything needed to build or run an EAGLE-3 draft layer, whatever layout it was read from.

    Defaults come from the target (`from_target_config`); drafters read from SGLang or speculators
    layouts fill the same fields (drafter/reader.py), with where they came from kept apart.
    """

    hidden_size: int
    """Width D of the draft layer (the target's hidden size by default)."""
    num_attention_heads: int
    """Query heads H."""
    num_key_value_heads: int
    """Key/value heads K (grouped-query attention when K < H)."""
    head_dim: int
    """Per-head width d (q/k/v project 2D -> H*d / K*d, o_proj maps H*d -> D)."""
    intermediate_size: int
    """SwiGLU inner width (the target's by default)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    """The target's HF RoPE dict: `rope_type` (default | linear | llama3 train; any type evaluates),
    `rope_theta` and the type's fields."""
    rope_theta: InitVar[float | None] = None
    """Accepted for older configs and callers: folded into `rope_parameters["rope_theta"]`."""
    max_position_embeddings: int = 2048
    """Longest position the RoPE settings are meant for (the target's)."""
    vocab_size: int
    """The TARGET vocabulary size Vt (embedding rows; t2d length)."""
    draft_vocab_size: int
    """Rows of lm_head V (d2t length); <= vocab_size."""
    target_hidden_size: int
    """Width of each target hidden state in aux (fc input = len(aux_layer_ids) * this)."""
    aux_layer_ids: list[int]
    """Target layers whose states feed fc, low/mid/high, in `layer_convention`."""
    layer_convention: str = "hf-input"
    """'hf-input': id i = INPUT to decoder layer i = HF output_hidden_states[i] (SGLang's id = i - 1)."""
    norm_before_residual: bool = False
    """speculators' variant: the residual is the normalised feature. EAGLE-3, SGLang and eyas: False."""
    target_num_layers: int | None = None
    """Decoder layers of the target (checked against stores and targets); None when a foreign layout omits it."""
    target_model_type: str | None = None
    """The target's HF model_type when known (SGLang converts DeepSeek ids differently)."""

    def __post_init__(self, rope_theta: float | None):
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {v!r}")
        if self.target_num_layers is not None and (
            not isinstance(self.target_num_layers, int) or self.target_num_layers <= 0
        ):
            raise ValueError(f"DrafterConfig.target_num_layers must be a positive int, got {self.target_num_layers!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} exceeds the target vocab {self.vocab_size}"
            )
        if not self.aux_layer_ids:
            raise ValueError("DrafterConfig.aux_layer_ids is empty")
        if self.layer_convention != "hf-input":
            raise ValueError(f"DrafterConfig.layer_convention must be 'hf-input', got {self.layer_convention!r}")
        rope = dict(self.rope_parameters or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope_theta is not None:
            rope["rope_theta"] = float(rope_theta)
        rope["rope_theta"] = float(rope.get("rope_theta") or 10000.0)
        self.rope_parameters = rope
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @classmethod
    def from_target_config(
        cls, cfg, *, draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None, **overrides
    ) -> DrafterConfig:
        """Defaults from a target's HF config (object or dict): same width, heads, MLP and RoPE."""
        from eyas.drafter.layouts import check_layer_ids, default_aux_layer_ids
        from eyas.drafter.reader import llama_dims

        if not isinstance(cfg, dict):
            text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            cfg = text.to_dict()
        n_layers = int(cfg["num_hidden_layers"])
        aux = (
            check_layer_ids(aux_layer_ids, n_layers, what="--aux-layers")
            if aux_layer_ids
            else default_aux_layer_ids(n_layers)
        )
        dims = llama_dims(cfg, where="target", max_positions=2048)
        values = dict(
            **dims,
            draft_vocab_size=int(draft_vocab_size or min(32000, dims["vocab_size"])),
            target_hidden_size=dims["hidden_size"],
            aux_layer_ids=aux,
            target_num_layers=n_layers,
            target_model_type=str(cfg.get("model_type", "llama")),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in fields(cls)} | {"rope_theta"}  # rope_theta: configs written before it moved
        return cls(**{k: v for k, v in d.items() if k in names})


# ----------------------------------------------------------------------------------------------
# building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in fp32, back to x's dtype, then scale by `weight`."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """Llama RMSNorm (`rms_norm`) with its weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    """Inverse frequencies [d/2] for the target's RoPE (default, linear or llama3 scaling)."""
    d = cfg.head_dim
    p = cfg.rope_parameters
    inv = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind = p.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE:
        raise EyasError(f"rope_type {kind!r}: the training drafter supports {', '.join(SUPPORTED_ROPE)}")
    if kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, position_ids_BT: torch.Tensor, dtype: torch.dtype):
    """cos/sin [B, 1, T, d] for `apply_rope` (HF's rotate-half layout)."""
    freqs = position_ids_BT[..., None].float() * inv_freq.to(position_ids_BT.device)  # B T d/2
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHTd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BHTd.shape[-1] // 2
    rotated = torch.cat([-x_BHTd[..., half:], x_BHTd[..., :half]], dim=-1)
    return x_BHTd * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * D, H * d, bias=False)
        self.k_proj = nn.Linear(2 * D, K * d, bias=False)
        self.v_proj = nn.Linear(2 * D, K * d, bias=False)
        self.o_proj = nn.Linear(H * d, D, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741 (I: the intermediate size, as in [2I, D])
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer; attention itself is left to the caller (step or TTT)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def linear_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The linear weights cast to `dtype` once (differentiable casts) for several steps to share:
        q/k/v as one [H*d + 2*K*d, 2D] matrix and gate/up as one [2I, D] matrix (one matmul each per
        step), o_proj and down_proj alone; autograd sums the steps' gradients in the compute dtype. (Summing
        them inside each matmul instead, through a shared-weight autograd function, was slower: every use broke the
        compiled pieces' graphs.)"""
        a, m = self.self_attn, self.mlp

        def cast(*mods):
            return torch.cat([mod.weight.to(dtype) for mod in mods]) if len(mods) > 1 else mods[0].weight.to(dtype)

        return {
            "qkv": cast(a.q_proj, a.k_proj, a.v_proj),
            "o_proj": cast(a.o_proj),
            "gate_up": cast(m.gate_proj, m.up_proj),
            "down_proj": cast(m.down_proj),
        }

    def project_qkv(self, embeds_BTD, feature_BTD, cos, sin, w: dict[str, torch.Tensor] | None = None):
        """-> q_BHTd, k_BKTd, v_BKTd (RoPE applied to q and k). `w`: `linear_weights` to use instead of
        the modules' own."""
        B, T, _ = embeds_BTD.shape
        H, K, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        x_BT2D = torch.cat([self.input_layernorm(embeds_BTD), self.hidden_norm(feature_BTD)], dim=-1)
        attn = self.self_attn
        if w is None:
            q, k, v = attn.q_proj(x_BT2D), attn.k_proj(x_BT2D), attn.v_proj(x_BT2D)
        else:
            q, k, v = _cast_linear(x_BT2D, w["qkv"]).split([H * d, K * d, K * d], dim=-1)
        q = q.view(B, T, H, d).transpose(1, 2)
        k = k.view(B, T, K, d).transpose(1, 2)
        v = v.view(B, T, K, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(
        self, attn_BHTd: torch.Tensor, feature_BTD: torch.Tensor, w: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """o_proj, residual from the (un-normalised) feature, then the MLP block -> hidden_prenorm_BTD."""
        B, H, T, d = attn_BHTd.shape
        o = attn_BHTd.transpose(1, 2).reshape(B, T, H * d)
        if w is None:
            h = feature_BTD + self.self_attn.o_proj(o)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = feature_BTD + _cast_linear(o, w["o_proj"])
        gate, up = _cast_linear(self.post_attention_layernorm(h), w["gate_up"]).chunk(2, dim=-1)
        return h + _cast_linear(F.silu(gate) * up, w["down_proj"])


def _cast_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(w.dtype), w)


@dataclass
class DrafterCache:
    """Keys/values of earlier draft tokens for incremental drafting (chain or tree).

    k, v: [B, K, S, d] (None when empty). `crop(n)` keeps the first n positions (rollback after a
    rejected draft). The caller owns position ids and the attention mask over the S keys.
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def append(self, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k_BKTd if self.k is None else torch.cat([self.k, k_BKTd], dim=2)
        self.v = v_BKTd if self.v is None else torch.cat([self.v, v_BKTd], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


def repeat_kv(x_BKTd: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BKTd if groups == 1 else x_BKTd.repeat_interleave(groups, dim=1)


# ----------------------------------------------------------------------------------------------
# the drafter


class Eagle3Drafter(nn.Module):
    """fc + one Llama layer + norm + lm_head over the draft vocab; state_dict in SGLang's layout."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # a plain fp32 tensor, not a buffer: `.to(bfloat16)` must not round the RoPE frequencies
        self.inv_freq = rope_inv_freq(cfg)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) [P, d] (`rope_at`)
        self.reset_parameters()

    # -- setup --------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, 0.02) linears, unit norms; the identity vocab map until `set_vocab`."""
        # seeded: drawn on the CPU so the weights do not depend on the device; unseeded: in place
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)

        def normal_(w: torch.Tensor) -> None:
            if gen is None:
                w.normal_(0.0, 0.02)
            else:
                w.copy_(torch.empty(w.shape, device="cpu").normal_(0.0, 0.02, generator=gen))

        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                normal_(mod.weight)
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
        normal_(self.embed_tokens.weight)
        self.set_vocab(torch.arange(self.config.draft_vocab_size, device="cpu"))

    @torch.no_grad()
    def set_vocab(self, used_target_ids: torch.Tensor) -> None:
        """Install the draft vocab: `used_target_ids` [V] ascending target ids -> d2t offsets, t2d mask."""
        used = torch.as_tensor(used_target_ids, dtype=torch.int64).cpu()
        if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
            raise ValueError("set_vocab: target ids must be strictly ascending")
        from eyas.drafter.vocab import vocab_maps

        V, Vt = self.config.draft_vocab_size, self.config.vocab_size
        if used.shape != (V,) or (used[1:] <= used[:-1]).any() or used.min() < 0 or used.max() >= Vt:
            raise ValueError(
                f"set_vocab: need {V} strictly ascending target ids in [0, {Vt}), got shape {tuple(used.shape)}"
            )
        d2t, t2d = vocab_maps(used, Vt)  # CPU: callers may run under a `with torch.device("cuda")` context
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_from_target(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor | None = None,
        final_norm_weight: torch.Tensor | None = None,
    ) -> None:
        """Copy the target's embedding (frozen); optionally start lm_head from the target's rows of the
        draft vocab and `norm` from its final norm (a better start than random; EAGLE-3 keeps both trainable)."""
        if tuple(embed_weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise EyasError(
                f"target embedding has shape {tuple(embed_weight.shape)}, the drafter expects "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab x hidden)"
            )
        self.embed_tokens.weight.copy_(embed_weight)
        if lm_head_weight is not None:
            self.lm_head.weight.copy_(lm_head_weight[self.used_target_ids().to(lm_head_weight.device)])
        if final_norm_weight is not None:
            self.norm.weight.copy_(final_norm_weight)

    def used_target_ids(self) -> torch.Tensor:
        """[V] target id of each draft id (ascending)."""
        from eyas.drafter.vocab import target_ids_of

        return target_ids_of(self.d2t)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids: target = draft + d2t[draft]."""
        return draft_ids + self.d2t[draft_ids]

    # -- compute ------------------------------------------------------------------------------

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux_BTAD (or already concatenated aux_BT(A*D), low/mid/high order) -> feature_BTD via fc."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)
        if aux.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"aux width {aux.shape[-1]} != {len(self.config.aux_layer_ids)} aux layers x "
                f"target hidden {self.config.target_hidden_size}"
            )
        return self.fc(aux.to(self.fc.weight.dtype) if not torch.is_autocast_enabled(aux.device.type) else aux)

    def compute_logits(self, hidden_prenorm_BTD: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, T, V] from the pre-norm hidden state."""
        return self.lm_head(self.norm(hidden_prenorm_BTD))

    def rope(self, position_ids_BT: torch.Tensor, dtype: torch.dtype):
        """cos/sin [B, 1, T, d] for these positions (fp32 frequencies, cast to `dtype`)."""
        if self.inv_freq.device != position_ids_BT.device:
            self.inv_freq = self.inv_freq.to(position_ids_BT.device)
        return rope_cos_sin(self.inv_freq, position_ids_BT, dtype)

    def rope_at(self, positions_N: torch.Tensor, offset: int, dtype: torch.dtype, size: int):
        """`rope` [1, 1, n, d] at positions_N + offset, every one below `size`: rows of a table of positions
        0..size-1 made once (the same values as `rope`), two gathers a call instead of the few kernels that make
        them (a training step's TTT unroll calls this once per step)."""
        t = self._rope_table
        dev = positions_N.device
        if t is None or t[0].shape[0] < size or t[0].dtype != dtype or t[0].device != dev:
            size = -(-size // 1024) * 1024  # (grown rarely: the longest sample so far, in steps of 1024)
            cos, sin = self.rope(torch.arange(size, device=dev)[None], dtype)
            t = self._rope_table = (cos[0, 0], sin[0, 0])
        idx = positions_N + offset if offset else positions_N
        return t[0].index_select(0, idx)[None, None], t[1].index_select(0, idx)[None, None]

    def forward_step(
        self,
        input_ids_BT: torch.Tensor,
        feature_BTD: torch.Tensor,
        position_ids_BT: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: DrafterCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over T new tokens -> (hidden_prenorm_BTD, logits_BTV).

        input_ids_BT: target-vocab token ids (token x_{t+1} paired with feature of position t).
        feature_BTD:  fc(aux) for tokens following target states, or an earlier hidden_prenorm.
        position_ids_BT: RoPE positions (EAGLE: the position of the feature; +1 per draft depth).
        cache: keys/values of earlier tokens; the new ones are appended to it (S = cached + T).
        attention_mask: bool [T, S] or [B, T, S], True = may attend. None = causal over the
            cache plus the new tokens (query i sees all cached keys and new keys 0..i).
        """
        emb = self.embed_tokens(input_ids_BT)
        dtype = (
            emb.dtype if not torch.is_autocast_enabled(emb.device.type) else torch.get_autocast_dtype(emb.device.type)
        )
        cos, sin = self.rope(position_ids_BT, dtype)
        q, k, v = self.midlayer.project_qkv(emb, feature_BTD, cos, sin)
        T = q.shape[2]
        if cache is not None:
            k, v = cache.append(k, v)
        S = k.shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if attention_mask.dim() == 3:
            attention_mask = attention_mask[:, None]
        g = self.config.num_attention_heads // self.config.num_key_value_heads
        out = F.scaled_dot_product_attention(
            q, repeat_kv(k, g).to(q.dtype), repeat_kv(v, g).to(q.dtype), attn_mask=attention_mask
        )
        hidden = self.midlayer.finish(out, feature_BTD)
        return hidden, self.compute_logits(hidden)

    # -- files --------------------------------------------------------------------------------

    def save(
        self, out_dir: str | Path, *, target: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> Path:
        """Write the eyas layout: config.json (every DrafterConfig field + target identity), model.safetensors."""
        from eyas.drafter.writer import write_eyas

        return write_eyas(out_dir, self.config, self.state_dict(), target=target, extra=extra)

    @classmethod
    def load(
        cls, path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Eagle3Drafter:
        """Load a drafter saved by `save`; checks that every SGLang key is present with its shape."""
        from safetensors.torch import load_file

        from eyas.drafter.layouts import WEIGHTS_FILE
        from eyas.drafter.reader import read_eyas_config

        path = Path(path)
        w_file = path / WEIGHTS_FILE
        config, _meta = read_eyas_config(path)
        if not w_file.exists():
            raise EyasError(
                f"{path} is not an eyas drafter directory (needs {WEIGHTS_FILE}); train one with `eyas train`"
            )
        model = cls(config)
        sd = load_file(str(w_file))
        want = model.state_dict()
        missing = sorted(set(want) - set(sd))
        unexpected = sorted(set(sd) - set(want))
        bad = [k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
        if missing or unexpected or bad:
            raise EyasError(
                f"{w_file}: missing keys {missing[:5]}, unexpected {unexpected[:5]}, "
                f"wrong shapes {bad[:5]}; the file does not match its config.json"
            )
        model.load_state_dict(sd)
        return model.to(device=device, dtype=dtype)  # d2t (int64) and t2d (bool) keep their dtypes

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
