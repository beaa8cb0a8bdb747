"""What the TTT loss is asked (`TTTConfig`) and what it reports (`TTTOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
