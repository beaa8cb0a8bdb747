"""The deterministic order of the training samples: which samples each rank reads at each optimizer step.

Order (`Plan`, by sample count): optimizer step s of a run with global batch G over n samples reads
`perm_e[i*G : (i+1)*G]` where e = s // ceil(n/G), i = s % ceil(n/G) and perm_e is a permutation
seeded by (seed, e). The last batch of an epoch may be smaller: no sample is silently dropped.
The G ids are laid out [accum][world][micro] so one process with micro-batch 2 and two processes
with micro-batch 1 see the same samples. The step number is therefore the whole data position.
`TokenPlan` cuts the same permutations into micro-batches of at most `tokens_per_batch` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eyas.errors import EyasError


@dataclass(kw_only=True)
class Plan:
    """Which samples each rank reads at each optimizer step."""

    n: int
    """Samples in the training source."""
    micro_batch: int
    """Samples per micro-batch per rank."""
    accum: int
    """Micro-batches per optimizer step."""
    world: int
    """Data-parallel ranks."""
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.world

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n / self.global_batch)

    def step_indices(self, step: int) -> list[int]:
        """The global batch of optimizer step `step` (0-based)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.n, generator=g)
        G = self.global_batch
        return perm[i * G : (i + 1) * G].tolist()

    def micro_indices(self, step: int, rank: int) -> list[list[int]]:
        """[accum] lists of indices for `rank` (a list may be empty at the end of an epoch)."""
        idx = self.step_indices(step)
        B, W = self.micro_batch, self.world
        return [idx[(m * W + rank) * B : (m * W + rank + 1) * B] for m in range(self.accum)]


def cut_by_tokens(order: list[int], lengths, budget: int) -> list[list[int]]:
    """Consecutive runs of `order` holding at most `budget` tokens each (a longer sample alone)."""
    out, cur, used = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


@dataclass(kw_only=True)
class TokenPlan:
    """Like `Plan`, but a micro-batch is as many samples as fit in `tokens_per_batch` tokens.

    Epoch e's permutation (seeded by (seed, e)) is cut greedily into micro-batches; micro-batch j of
    the epoch goes to optimizer step j // (accum * world), accumulation slot and rank as in `Plan`.
    No sample is dropped; the last step of an epoch may hold fewer micro-batches (empty lists).
    """

    lengths: list[int]
    """Tokens of each sample of the training source (after truncation)."""
    tokens_per_batch: int
    accum: int
    world: int
    seed: int

    def __post_init__(self):
        self._epochs: dict[int, list[list[int]]] = {}
        self._starts = [0]  # first step of each epoch computed so far
        if self.lengths and max(self.lengths) > self.tokens_per_batch:
            raise EyasError(
                f"--tokens-per-batch {self.tokens_per_batch} is smaller than a sample of "
                f"{max(self.lengths)} tokens; raise it to at least --max-length"
            )

    @property
    def n(self) -> int:
        return len(self.lengths)

    @property
    def global_batch(self) -> str:
        return f"{self.tokens_per_batch}tok x{self.accum * self.world}"

    def micro_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
            self._epochs[epoch] = cut_by_tokens(perm, self.lengths, self.tokens_per_batch)
        return self._epochs[epoch]

    def _epoch_steps(self, epoch: int) -> int:
        return math.ceil(len(self.micro_batches(epoch)) / (self.accum * self.world))

    @property
    def steps_per_epoch(self) -> int:
        return self._epoch_steps(0)

    def _locate(self, step: int) -> tuple[int, int]:
        while len(self._starts) <= 1 or self._starts[-1] <= step:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + self._epoch_steps(e))
        for e in range(len(self._starts) - 1):
            if self._starts[e] <= step < self._starts[e + 1]:
                return e, step - self._starts[e]
        raise AssertionError(step)

    def _slots(self, step: int) -> list[list[int]]:
        e, i = self._locate(step)
        S = self.accum * self.world
        mbs = self.micro_batches(e)[i * S : (i + 1) * S]
        return mbs + [[] for _ in range(S - len(mbs))]

    def step_indices(self, step: int) -> list[int]:
        return [i for mb in self._slots(step) for i in mb]

    def micro_indices(self, step: int, rank: int) -> list[list[int]]:
        slots = self._slots(step)
        return [slots[m * self.world + rank] for m in range(self.accum)]
