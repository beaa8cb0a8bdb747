"""Replay speculative decoding against a recorded greedy continuation: exact acceptance, no verification.

At temperature 0 a speculative decoder's output is the target's greedy continuation, so the accepted
tokens of every round are known in advance: they are the greedy tokens. One target forward over the
whole greedy sequence gives the target features of every accepted prefix, and one causal step-0 drafter
pass over them gives the drafter's KV cache at every round start (step 0 is causal, so the cache of a
prefix is the prefix of the cache). What remains per round is the drafting itself, which this module
runs for all sequences of a batch in lock step. tests/test_specdec_replay.py checks the accepted counts
against a real decoding loop (specdec/reference.py).

Shape legend: B sequences in the batch, R rows active this round, L positions, K draft candidates,
F frontier width (= top-k), E tree KV slots, H draft hidden, Vd draft vocabulary.

Round bookkeeping, with c = number of tokens already committed (prompt + generated):
    the last committed token s_{c-1} has no target features yet, so the round starts from step-0
    position t = c - 2 (input token s_{c-1}, feature aux_{c-2}), whose output proposes s_c.
    prompt [p0 p1 p2], first generated g0 from the prefill -> c = 4, t = 2, first draft guesses g1.
A round accepts the longest drafted path that equals s_c, s_{c+1}, ..., then the target adds one bonus
token: c += accepted + 1. Positions at or past the end of the recorded continuation never match, so the
last round of a sequence accepts at most what was left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eyas.specdec.functional import FunctionalDrafter


@dataclass(kw_only=True, frozen=True)
class TreeConfig:
    """An EAGLE-2 dynamic draft tree; a chain of k tokens is topk=1, depth=k, tokens=k."""

    topk: int
    """Children kept per expanded node, and nodes expanded per depth (the frontier width)."""
    depth: int
    """Draft steps per round: the longest path a round can accept."""
    tokens: int
    """Draft tokens submitted for verification (the best by cumulative log-prob), root excluded."""

    def __post_init__(self):
        if self.topk < 1:
            raise ValueError(f"--tree-topk must be >= 1, got {self.topk}")
        if self.depth < 1:
            raise ValueError(f"--tree-depth / --chain-k must be >= 1, got {self.depth}")
        if not 1 <= self.tokens <= self.candidates:
            raise ValueError(
                f"--tree-tokens must be between 1 and {self.candidates} (top-k {self.topk}, depth {self.depth}), got {self.tokens}"
            )

    @classmethod
    def chain(cls, k: int) -> TreeConfig:
        return cls(topk=1, depth=k, tokens=k)

    @property
    def candidates(self) -> int:
        """Nodes the expansion creates: top-k at depth 1, then top-k of each of top-k nodes per depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def candidate_depths(self) -> list[int]:
        """The depth of every candidate in build_tree's creation order: top-k at depth 1, then
        top-k x top-k per depth."""
        return [1] * self.topk + [d for d in range(2, self.depth + 1) for _ in range(self.topk * self.topk)]

    @property
    def tree_slots(self) -> int:
        """Nodes that get expanded, hence need a KV slot: the frontier at depths 1..depth-1."""
        return self.topk * (self.depth - 1)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


class Proposer(Protocol):
    """What the replay needs from a drafter. Rows index the sequences of the batch passed to begin()."""

    def begin(self, ids_BL: torch.Tensor, aux_BLF: torch.Tensor, *, tree_slots: int) -> None: ...

    def root(self, rows_R: torch.Tensor, t_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [R, Vd], pre-norm output [R, H]) of step-0 position t."""

    def expand(
        self, rows_R, t_R, depth: int, tokens_RF, feats_RFH, slot: int, tree_mask_RFE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run draft step `depth` on F nodes per row: their own keys go to tree slots slot..slot+F-1.

        tokens are draft ids, feats the parents' pre-norm outputs; tree_mask_RFE marks each node's
        ancestors and itself among the E tree slots. Returns (log-probs [R, F, Vd], outputs [R, F, H]).
        """

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


class DrafterProposer:
    """The real drafter: a step-0 pass over the whole batch, then tree steps against its KV cache."""

    def __init__(self, drafter: FunctionalDrafter):
        self.d = drafter

    def begin(self, ids_BL, aux_BLF, *, tree_slots: int) -> None:
        out, k, v = self.d.step0(ids_BL, aux_BLF)
        B, kv, L0, hd = k.shape
        self.L0 = L0
        self.out0 = out
        # one buffer per K and V: step-0 keys, then the tree slots (no concatenation per step)
        self.k = k.new_zeros(B, kv, L0 + tree_slots, hd)
        self.v = v.new_zeros(B, kv, L0 + tree_slots, hd)
        self.k[:, :, :L0] = k
        self.v[:, :, :L0] = v
        self.slots = tree_slots

    def root(self, rows_R, t_R):
        out = self.out0[rows_R, t_R]
        return self.d.log_probs(out), out

    def expand(self, rows_R, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE):
        R, Fw = tokens_RF.shape
        pos = (t_R + depth)[:, None].expand(R, Fw)
        # the draft layer embeds TARGET ids: map the draft-vocabulary choices first
        q, k, v, residual = self.d.qkv(self.d.to_target(tokens_RF), feats_RFH, pos)
        lo = self.L0 + slot
        self.k[rows_R, :, lo : lo + Fw] = k  # later depths of this round attend to these keys
        self.v[rows_R, :, lo : lo + Fw] = v
        full = R == self.k.shape[0]  # rows are sorted and unique, so R == B means all rows
        kbuf = self.k if full else self.k[rows_R]
        vbuf = self.v if full else self.v[rows_R]
        prefix = torch.arange(self.L0, device=t_R.device)[None, :] <= t_R[:, None]  # [R, L0]
        mask = torch.cat([prefix[:, None, :].expand(R, Fw, self.L0), tree_mask_RFE], dim=-1)[:, None]
        out = self.d.finish(self.d.attend(q, kbuf, vbuf, mask=mask), residual)
        return self.d.log_probs(out), out

    def to_target(self, draft_ids):
        return self.d.to_target(draft_ids)


@dataclass
class DraftTree:
    """The candidates of one round for R rows, in creation order (a parent precedes its children)."""

    tokens: torch.Tensor  # [R, K] target ids
    parent: torch.Tensor  # [R, K] candidate index of the parent, -1 for the root's children
    score: torch.Tensor  # [R, K] cumulative log-prob
    selected: torch.Tensor  # [R, K] bool: among the `tokens` best


@torch.no_grad()
def build_tree(proposer: Proposer, rows_R: torch.Tensor, t_R: torch.Tensor, tree: TreeConfig) -> DraftTree:
    """EAGLE-2: top-k from the root, then per depth expand the k best nodes by cumulative log-prob,
    keeping each one's top-k children; finally submit the `tokens` best of all candidates."""
    k = tree.topk
    logp0, feat0 = proposer.root(rows_R, t_R)
    R, H = feat0.shape
    score, tok = logp0.topk(k, dim=-1)  # [R, k]
    toks, scores, parents = [tok], [score], [torch.full_like(tok, -1)]
    front_tok, front_score = tok, score
    front_feat = feat0[:, None, :].expand(R, k, H)
    front_cand = torch.arange(k, device=tok.device).expand(R, k)
    anc = torch.zeros(R, k, tree.tree_slots, dtype=torch.bool, device=tok.device)
    n_cand = k
    eye = torch.eye(k, dtype=torch.bool, device=tok.device)
    for depth in range(1, tree.depth):
        slot = (depth - 1) * k
        anc[:, :, slot : slot + k] |= eye
        logp, out = proposer.expand(rows_R, t_R, depth, front_tok, front_feat, slot, anc)
        child_score, child_tok = logp.topk(k, dim=-1)  # [R, k parents, k children]
        cum = (front_score[:, :, None] + child_score).flatten(1)  # [R, k*k]
        child_tok = child_tok.flatten(1)
        toks.append(child_tok)
        scores.append(cum)
        parents.append(front_cand[:, :, None].expand(R, k, k).flatten(1))
        front_score, best = cum.topk(k, dim=-1)
        parent_f = best // k
        front_tok = child_tok.gather(1, best)
        front_feat = out.gather(1, parent_f[:, :, None].expand(R, k, out.shape[-1]))
        anc = anc.gather(1, parent_f[:, :, None].expand(R, k, anc.shape[-1]))
        front_cand = n_cand + best
        n_cand += k * k
    score = torch.cat(scores, dim=1)
    # best `tokens` by score; ties go to the earlier candidate, so a parent always precedes its child
    order = torch.sort(-score, dim=1, stable=True).indices[:, : tree.tokens]
    selected = torch.zeros_like(score, dtype=torch.bool).scatter_(1, order, True)
    return DraftTree(
        tokens=proposer.to_target(torch.cat(toks, dim=1)),
        parent=torch.cat(parents, dim=1),
        score=score,
        selected=selected,
    )


def accepted_length(tree: DraftTree, expected_RD: torch.Tensor, valid_RD: torch.Tensor) -> torch.Tensor:
    """Longest selected root path whose j-th token equals expected_RD[:, j] (where valid): [R] int64."""
    R, D = expected_RD.shape
    cur = torch.full((R,), -1, dtype=torch.long, device=expected_RD.device)
    alive = torch.ones(R, dtype=torch.bool, device=expected_RD.device)
    acc = torch.zeros(R, dtype=torch.long, device=expected_RD.device)
    for j in range(D):
        match = tree.selected & (tree.parent == cur[:, None]) & (tree.tokens == expected_RD[:, j : j + 1])
        match &= (alive & valid_RD[:, j])[:, None]
        hit = match.any(dim=1)
        cur = torch.where(hit, match.long().argmax(dim=1), cur)  # at most one match per row
        acc += hit.long()
        alive &= hit
    return acc


@torch.no_grad()
def replay_batch(
    proposer: Proposer,
    ids_BL: torch.Tensor,
    aux_BLF: torch.Tensor,
    *,
    lengths_B: torch.Tensor,
    prompt_lengths_B: torch.Tensor,
    tree: TreeConfig,
) -> list[list[int]]:
    """Accepted draft tokens of every round of every sequence (list per sequence, in round order).

    ids_BL: prompt + greedy continuation, right-padded; aux_BLF: the target's features over it.
    """
    device = ids_BL.device
    B, L = ids_BL.shape
    if (prompt_lengths_B < 1).any():
        raise ValueError("every prompt needs at least one token")
    proposer.begin(ids_BL, aux_BLF, tree_slots=tree.tree_slots)
    committed = prompt_lengths_B.to(device) + 1  # the prefill already produced the first token
    lengths = lengths_B.to(device)
    per_round: list[tuple[torch.Tensor, torch.Tensor]] = []
    steps = torch.arange(tree.depth, device=device)
    while True:
        rows = torch.nonzero(committed < lengths).flatten()
        if rows.numel() == 0:
            break
        c = committed[rows]
        drafted = build_tree(proposer, rows, c - 2, tree)
        pos = c[:, None] + steps[None, :]  # [R, D]: positions the draft path would fill
        valid = pos < lengths[rows, None]
        expected = ids_BL[rows[:, None], pos.clamp(max=L - 1)]
        acc = accepted_length(drafted, expected, valid)
        per_round.append((rows.cpu(), acc.cpu()))
        committed[rows] = c + acc + 1
    out: list[list[int]] = [[] for _ in range(B)]
    for rows, acc in per_round:
        for r, a in zip(rows.tolist(), acc.tolist()):
            out[r].append(a)
    return out
