"""The slow path: a straightforward speculative decoding loop at temperature 0, one sequence at a time.

Every round recomputes everything from scratch, as plainly as possible, sharing no state or code with
the replay (specdec/replay.py) beyond the draft layer's arithmetic:
- target features of the committed prefix from `eyas.target.reference_hidden_states`
  (`output_hidden_states`, not the capture hooks);
- the drafter's output for a tree node from one causal pass over [step-0 entries of the prefix, the
  node's ancestors, the node], no KV cache, no tree mask;
- the EAGLE-2 tree built node by node with Python lists;
- verification with the real target: walk the tree, asking the target for its greedy next token
  after the committed tokens plus the path so far, until no submitted child matches.
It is the reference the replay's accepted counts must equal (tests/test_specdec_replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.replay import TreeConfig


@dataclass
class _Node:
    index: int
    parent: int  # -1 = the root (the last committed token)
    draft_id: int
    token: int  # target id
    score: float  # cumulative log-prob
    feature: torch.Tensor  # the parent's pre-norm output: this node's feature input
    path: list[_Node]  # ancestors from depth 1, then this node


def _node_output(
    drafter: FunctionalDrafter, base_ids: list[int], base_feat: torch.Tensor, path: list[_Node]
) -> torch.Tensor:
    """Pre-norm output of the last entry of [step-0 entries, path] under plain causal attention."""
    ids = base_ids + [n.token for n in path]
    feats = torch.cat([base_feat] + [n.feature[None] for n in path], dim=0)
    pos = torch.arange(len(ids), device=base_feat.device)
    out, _, _ = drafter.causal_forward(torch.tensor([ids], device=base_feat.device), feats[None], pos[None])
    return out[0, -1]


@torch.no_grad()
def reference_tree(drafter: FunctionalDrafter, seq: list[int], aux_TF: torch.Tensor, tree: TreeConfig) -> list[_Node]:
    """The submitted nodes of one round; aux_TF are target features of seq[:-1] (the last token has none)."""
    base_ids = seq[1:]
    base_feat = drafter.fuse(aux_TF)
    root_out = _node_output(drafter, base_ids, base_feat, [])
    nodes: list[_Node] = []

    def children(parent: _Node | None, out: torch.Tensor) -> list[_Node]:
        logp = drafter.log_probs(out)
        lp, ids = logp.topk(tree.topk)
        kids = []
        for score, draft_id in zip(lp.tolist(), ids.tolist()):
            node = _Node(
                index=len(nodes) + len(kids),
                parent=-1 if parent is None else parent.index,
                draft_id=draft_id,
                token=int(drafter.to_target(torch.tensor(draft_id, device=out.device))),
                score=score + (0.0 if parent is None else parent.score),
                feature=out,
                path=[],
            )
            node.path = ([] if parent is None else parent.path) + [node]
            kids.append(node)
        return kids

    frontier = children(None, root_out)
    nodes += frontier
    for _depth in range(2, tree.depth + 1):
        new: list[_Node] = []
        for node in frontier:
            kids = children(node, _node_output(drafter, base_ids, base_feat, node.path))
            for kid in kids:
                kid.index = len(nodes) + len(new)
                new.append(kid)
        nodes += new
        frontier = sorted(new, key=lambda n: -n.score)[: tree.topk]
    return sorted(nodes, key=lambda n: (-n.score, n.index))[: tree.tokens]


@torch.no_grad()
def reference_decode(
    target,
    drafter: FunctionalDrafter,
    prompt: list[int],
    *,
    layer_ids: list[int],
    max_new_tokens: int,
    tree: TreeConfig,
    eos_ids: set[int],
) -> tuple[list[int], list[int]]:
    """Speculative decoding with real verification. Returns (generated tokens, accepted per round)."""
    from eyas.target import reference_hidden_states

    device = next(target.parameters()).device

    def greedy_next(tokens: list[int]) -> int:
        return int(target(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0, -1].argmax())

    seq = list(prompt)
    seq.append(greedy_next(seq))  # the prefill's token
    new, rounds = 1, []
    while new < max_new_tokens and seq[-1] not in eos_ids:
        aux_TAD, _ = reference_hidden_states(target, torch.tensor(seq, device=device), layer_ids=layer_ids)
        submitted = reference_tree(drafter, seq, aux_TAD[:-1].flatten(1), tree)
        budget = max_new_tokens - new
        path: list[int] = []
        node = -1
        while True:
            nxt = greedy_next(seq + path)
            match = [n for n in submitted if n.parent == node and n.token == nxt]
            if not match or len(path) == budget:
                break
            path.append(nxt)
            node = match[0].index
            if nxt in eos_ids:
                break
        rounds.append(len(path))
        seq += path
        new += len(path)
        if new < max_new_tokens and not (path and path[-1] in eos_ids):
            seq.append(nxt)  # the bonus token the verification produced
            new += 1
    return seq[len(prompt) :], rounds
