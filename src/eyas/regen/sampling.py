"""Token choice for regeneration: greedy, or sampled with a counter-based RNG that needs no state.

Why counter-based: a batched decode loop mixes rows of many conversations, refills finished rows
and (on GPU) replays a captured CUDA graph, so a stateful `torch.Generator` would make an answer
depend on which other answers shared its batch. Here the uniform noise for (row seed, position,
vocab id) is a pure integer hash, so a sampled answer depends only on (global seed, conversation,
turn) and the model: the same on CPU and GPU, at any batch size, after a resume.

Sampling = Gumbel-max over the nucleus: next = argmax(logits/T + g) over the smallest set of tokens
whose probability mass reaches top_p, with g = -log(-log u), which draws exactly from
softmax(logits/T) renormalised over that set. temperature == 0 means greedy (argmax; ties go to the
lowest id, as in `torch.argmax` and Hugging Face `generate`).

Shape legend: B rows, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash-prospector). The second constant is >= 2**31: multiplying by
# (c - 2**32) instead gives the same low 32 bits without overflowing int64.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)


@dataclass(kw_only=True, frozen=True)
class Sampling:
    """How each answer token is chosen."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 = sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus: sample only among the most likely tokens whose mass reaches top_p (1 = all)."""
    seed: int = 0
    """Global seed; each (conversation, turn) derives its own stream from it."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**62:
            raise ValueError(f"--seed must be in [0, 2**62), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "greedy": self.greedy,
            "rng": "eyas.lowbias32-gumbel/1",
        }


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32): bijective, well mixed."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * _C1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


def hash32_py(x: int) -> int:
    """The same hash on one Python int (the reference the tensor version is tested against)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def request_seed(seed: int, index: int, turn: int) -> int:
    """The stream of one answer: a 32-bit key from (global seed, conversation index, turn).

    Each stage mixes in a different constant, so the hash's fixed point at 0 never shows."""
    h = 0
    for k, part in enumerate((seed & MASK32, seed >> 32, index & MASK32, index >> 32, turn & MASK32)):
        h = hash32_py(h ^ part ^ ((0x9E3779B9 * (k + 1)) & MASK32))
    return h


def vocab_keys(vocab_size: int, device) -> torch.Tensor:
    """Per-vocab-id keys [V], computed once per engine."""
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) * _GOLDEN)


def uniforms(seed_B: torch.Tensor, pos_B: torch.Tensor, vkeys_V: torch.Tensor) -> torch.Tensor:
    """u_BV in (0, 1): one independent uniform per (row stream, position, vocab id), float32."""
    row_B = hash32(hash32(seed_B) ^ (pos_B & MASK32))
    h_BV = hash32(vkeys_V[None, :] ^ row_B[:, None])
    return ((h_BV >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def choose(
    logits_BV: torch.Tensor,
    *,
    sampling: Sampling,
    seed_B: torch.Tensor | None = None,
    pos_B: torch.Tensor | None = None,
    vkeys_V: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row [B] (int64). Graph-safe: no host syncs, fixed shapes.

    `pos_B` is the position the chosen token will occupy minus one (the position of the token whose
    logits these are); with `seed_B` it picks the noise, so a row's draw never depends on its batch.
    """
    if sampling.greedy:
        return torch.argmax(logits_BV, dim=-1)
    assert seed_B is not None and pos_B is not None and vkeys_V is not None
    scaled_BV = logits_BV.float() / sampling.temperature
    if sampling.top_p < 1.0:
        probs_BV = torch.softmax(scaled_BV, dim=-1)
        sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True)
        mass_before_BV = torch.cumsum(sorted_BV, dim=-1) - sorted_BV
        keep_sorted_BV = mass_before_BV < sampling.top_p  # the most likely token is always kept
        keep_BV = torch.zeros_like(keep_sorted_BV).scatter(1, order_BV, keep_sorted_BV)
        scaled_BV = scaled_BV.masked_fill(~keep_BV, float("-inf"))
    gumbel_BV = -torch.log(-torch.log(uniforms(seed_B, pos_B, vkeys_V)))
    return torch.argmax(scaled_BV + gumbel_BV, dim=-1)
