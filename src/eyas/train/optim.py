"""The optimizers of `eyas train` (TrainConfig.optimizer): AdamW, and Muon for the drafter's hidden matrices beside
AdamW for the rest, as one torch optimizer (one learning-rate schedule, one checkpoint state, DDP alike).

Muon (momentum, then the update orthogonalized by a Newton-Schulz iteration) updates every matrix the same amount
in every direction of its singular spectrum, where AdamW's update follows the gradient's dominant directions: on
small language models it has reached a loss in fewer steps than tuned AdamW. Here it covers fc and the decoder
layer's projections; lm_head (the output layer) and the norms stay with AdamW, as usual for Muon (the embedding is
the target's, frozen). Its update is scaled by 0.2 * sqrt(max(rows, cols)) so its RMS matches AdamW's and the same learning rate and
weight decay serve both groups.

Cost: five Newton-Schulz iterations a matrix a step, each three matmuls on [min x min] and [min x max] products
(in bf16 on CUDA). Counted: 0.07 TFLOP a step for SmolLM2's 576-wide drafter (0.16 with the recipe's 6,144-wide
MLP), small beside a step of 131,072 tokens; 27 TFLOP a step for an 8B-shaped drafter (4,096 wide, 14,336 MLP),
which makes its step much slower than AdamW's. So `eyas train` uses it by default for drafters under hidden size 2048
only (`default_optimizer` below), where it also trained better drafters. Not with
--fsdp (the iteration needs whole matrices; FSDP2 shards them).

Shape legend: R rows, C columns of a weight matrix."""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz iteration's coefficients: they push every singular value of the normalized update into
roughly [0.7, 1.2] within five iterations (a steep slope near 0), rather than converging to exactly 1."""


def newton_schulz(G_RC: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with the singular vectors of G (U V^T up to singular values near 1),
    computed in bf16 on CUDA and in fp32 elsewhere, returned in G's dtype."""
    a, b, c = NS_COEFFICIENTS
    X = G_RC.to(torch.bfloat16 if G_RC.is_cuda else torch.float32)
    tall = X.shape[0] > X.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return (X.mT if tall else X).to(G_RC.dtype)


def muon_scale(shape: torch.Size) -> float:
    """The factor on the learning rate of a Muon-updated matrix: its orthogonalized update's RMS is about
    1 / sqrt(max(R, C)); this brings it to AdamW's typical 0.2."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the parameter groups with `muon=True` (matrices only), AdamW (decoupled weight decay, bias
    correction, as torch.optim.AdamW) for the others. Muon: B <- momentum * B + g; update = NS(g + momentum * B)
    (Nesterov); p <- p * (1 - lr * weight_decay) - lr * muon_scale * update."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = BETAS,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, muon=False
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("MuonAdamW: a muon group holds matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group)
        return loss

    def _muon(self, group) -> None:
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.mul_(mom).add_(p.grad)
            update = newton_schulz(p.grad.add(buf, alpha=mom), steps=group["ns_steps"])
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * muon_scale(p.shape))

    def _adamw(self, group) -> None:
        """torch's own AdamW update (its functional form, foreach where torch picks it) on the group's parameters,
        with torch.optim.AdamW's state (step, exp_avg, exp_avg_sq)."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def make_optimizer(
    module: torch.nn.Module, kind: str, *, lr: float, weight_decay: float, fused: bool
) -> torch.optim.Optimizer:
    """The optimizer of the module's trainable parameters: torch's AdamW (fused where asked) for `adamw`; for
    `muon`, MuonAdamW with Muon on every trainable matrix but lm_head's (fc, the decoder layer's projections)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=BETAS, weight_decay=weight_decay, fused=fused)
    if kind != "muon":
        raise ValueError(f"optimizer {kind!r}: expected one of {', '.join(OPTIMIZERS)}")
    hidden = [p for n, p in named if p.ndim == 2 and "lm_head" not in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "lm_head" not in n)]
    return MuonAdamW([{"params": hidden, "muon": True}, {"params": rest}], lr=lr, weight_decay=weight_decay)


SMALL_DRAFTER_LR, SMALL_DRAFTER_MUON_LR, LARGE_DRAFTER_LR, LARGE_DRAFTER_HIDDEN = 1e-3, 2e-3, 1e-4, 2048


def default_optimizer(hidden_size: int, *, fsdp: bool) -> str:
    """--optimizer's default for a drafter of this hidden size (TrainConfig.optimizer): Muon for small drafters, whose
    Newton-Schulz iterations cost little beside a step; AdamW for large ones and under --fsdp."""
    return "muon" if hidden_size < LARGE_DRAFTER_HIDDEN and not fsdp else "adamw"


def default_lr(hidden_size: int, optimizer: str) -> float:
    """--lr's default for a drafter of this hidden size trained with this optimizer (TrainConfig.lr)."""
    if hidden_size >= LARGE_DRAFTER_HIDDEN:
        return LARGE_DRAFTER_LR
    return SMALL_DRAFTER_MUON_LR if optimizer == "muon" else SMALL_DRAFTER_LR


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
