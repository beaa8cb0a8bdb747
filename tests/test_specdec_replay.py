"""The replay (fast path) against a real speculative decoding loop (slow path), on a tiny target.

The tiny random target's greedy continuations repeat a few tokens; the random drafter gets a draft
vocabulary of the 8 most frequent of them, and its lm_head is tilted towards the two most repeated
(conftest's `tilted_drafter`), so rounds accept 0, 1 and up to the full depth, and trees accept where the
chain does not. Replay and the real loop must agree on every round of every sequence.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tilted_drafter

from eyas.drafter.reader import read_drafter as load_draft_checkpoint
from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.generate import greedy_generate
from eyas.specdec.reference import reference_decode
from eyas.specdec.replay import DrafterProposer, TreeConfig, replay_batch
from eyas.target import forward_capture, load_target

MAX_NEW = 20
LAYERS = [1, 3, 4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    target = load_target(tiny_target_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 9)]
    prompts.append([1, 5, 9])  # a short prompt with special-ish ids
    # ids 2 is SmolLM2's EOS; keep it in play so some continuations may stop early
    gen = greedy_generate(target, prompts, max_new_tokens=MAX_NEW, eos_ids={2}, pad_id=2, batch_size=4)
    out = tmp_path_factory.mktemp("drafter")
    model = tilted_drafter(target, prompts[0] + gen[0], gen, out, layers=LAYERS)
    ckpt = load_draft_checkpoint(out)
    drafter = FunctionalDrafter(ckpt.config, ckpt.weights)
    return target, drafter, prompts, gen, model


def _replay(target, drafter, prompts, gen, tree):
    seqs = [p + g for p, g in zip(prompts, gen)]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), 2, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    aux, _ = forward_capture(target, ids, None, layer_ids=LAYERS)
    return replay_batch(
        DrafterProposer(drafter),
        ids,
        aux.flatten(2),
        lengths_B=torch.tensor([len(s) for s in seqs]),
        prompt_lengths_B=torch.tensor([len(p) for p in prompts]),
        tree=tree,
    )


@pytest.mark.parametrize(
    "tree",
    [TreeConfig.chain(4), TreeConfig(topk=3, depth=4, tokens=12), TreeConfig(topk=4, depth=3, tokens=6)],
    ids=["chain4", "tree3x4x12", "tree4x3x6"],
)
def test_replay_equals_real_decoding_loop(setup, tree):
    target, drafter, prompts, gen, _ = setup
    replayed = _replay(target, drafter, prompts, gen, tree)
    all_rounds = []
    for prompt, greedy, rounds in zip(prompts, gen, replayed):
        out, real_rounds = reference_decode(
            target, drafter, prompt, layer_ids=LAYERS, max_new_tokens=MAX_NEW, tree=tree, eos_ids={2}
        )
        assert out == greedy, "speculative decoding at temperature 0 must reproduce the greedy continuation"
        assert rounds == real_rounds
        # every generated token is either accepted, a bonus, or the prefill's
        assert sum(rounds) + len(rounds) + 1 >= len(greedy) >= sum(rounds) + len(rounds)
        all_rounds += rounds
    # the comparison is only worth something if drafts were accepted, deeply, and also rejected
    assert 0 in all_rounds and max(all_rounds) >= (1 if tree.is_chain else 2), all_rounds


def test_functional_drafter_matches_eagle3_drafter(setup):
    """The decoding-side draft layer computes the training model's logits (random inputs, causal)."""
    _, drafter, _, _, model = setup
    g = torch.Generator().manual_seed(5)
    B, T = 2, 7
    ids = torch.randint(0, 49152, (B, T), generator=g)
    aux = torch.randn(B, T, len(LAYERS) * 64, generator=g)
    pos = torch.arange(T).expand(B, T) + 3
    feat = model.project_aux(aux)
    hidden, logits = model.forward_step(ids, feat, pos)
    out, _, _ = drafter.causal_forward(ids, drafter.fuse(aux), pos)
    torch.testing.assert_close(out, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.logits(out), logits, rtol=1e-4, atol=1e-4)


def test_tree_step_equals_causal_recompute(setup):
    """A depth-2 tree node attending through the KV buffer + ancestor mask equals a causal recompute."""
    target, drafter, prompts, gen, _ = setup
    seq = torch.tensor([prompts[1] + gen[1]])
    aux, _ = forward_capture(target, seq, None, layer_ids=LAYERS)
    aux = aux.flatten(2)
    p = DrafterProposer(drafter)
    tree = TreeConfig(topk=2, depth=3, tokens=4)
    p.begin(seq, aux, tree_slots=tree.tree_slots)
    t = 10
    rows, tt = torch.tensor([0]), torch.tensor([t])
    _, root_out = p.root(rows, tt)
    tok1 = torch.tensor([[0, 1]])  # two depth-1 nodes (draft ids)
    anc = torch.zeros(1, 2, tree.tree_slots, dtype=torch.bool)
    anc[0, 0, 0] = anc[0, 1, 1] = True
    _, out1 = p.expand(rows, tt, 1, tok1, root_out[:, None].expand(1, 2, -1), 0, anc)
    # depth 2: one child of node 1 (and a copy under node 0 to check the mask separates them)
    anc2 = torch.zeros(1, 2, tree.tree_slots, dtype=torch.bool)
    anc2[0, 0, [0, 2]] = True
    anc2[0, 1, [1, 3]] = True
    tok2 = torch.tensor([[2, 2]])
    _, out2 = p.expand(rows, tt, 2, tok2, out1, 2, anc2)
    # recompute node (1 -> 2) plainly: step-0 entries 0..t, then the path
    ids = torch.cat([seq[0, 1 : t + 2], drafter.to_target(torch.tensor([1, 2]))])
    feats = torch.cat([drafter.fuse(aux[0, : t + 1]), root_out, out1[0, 1:2]])
    ref, _, _ = drafter.causal_forward(ids[None], feats[None], torch.arange(len(ids))[None])
    torch.testing.assert_close(out2[0, 1], ref[0, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out2[0, 0], out2[0, 1], atol=1e-3)  # different ancestors, different outputs
