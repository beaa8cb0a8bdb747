"""Acceptance accounting with fake drafters that always / never / sometimes guess the greedy token."""

from __future__ import annotations

import pytest
import torch

from eyas.specdec.metrics import summarize
from eyas.specdec.replay import TreeConfig, replay_batch

V = 50


class OracleProposer:
    """Guesses the recorded token at position p when agree(row, p), else a token that is never there."""

    def __init__(self, agree):
        self.agree = agree

    def begin(self, ids_BL, aux_BLF, *, tree_slots):
        self.ids = ids_BL

    def _guess(self, rows, pos):  # rows [R], pos [R] -> log-probs [R, V] with one clear favourite
        L = self.ids.shape[1]
        true = self.ids[rows, pos.clamp(max=L - 1)]
        ok = torch.tensor([bool(self.agree(int(r), int(p))) for r, p in zip(rows, pos)])
        tok = torch.where(ok, true, (true + 1) % V)
        logp = torch.full((len(rows), V), -1e4)
        logp[torch.arange(len(rows)), tok] = 0.0
        return logp

    def root(self, rows, t):
        return self._guess(rows, t + 2), torch.zeros(len(rows), 4)

    def expand(self, rows, t, depth, tokens, feats, slot, mask):
        R, Fw = tokens.shape
        logp = self._guess(rows, t + 2 + depth)[:, None].expand(R, Fw, V)
        return logp, torch.zeros(R, Fw, 4)

    def to_target(self, ids):
        return ids


def _run(agree, *, prompt_len, generated, tree, rows=1):
    g = torch.Generator().manual_seed(0)
    L = prompt_len + generated
    ids = torch.randint(0, V, (rows, L), generator=g)
    return replay_batch(
        OracleProposer(agree),
        ids,
        torch.zeros(rows, L, 3),
        lengths_B=torch.full((rows,), L),
        prompt_lengths_B=torch.full((rows,), prompt_len),
        tree=tree,
    )


def test_always_agree_chain_accepts_k_until_the_end():
    # 17 generated: the prefill gives 1, then 2 rounds of 7 accepted + 1 bonus
    assert _run(lambda r, p: True, prompt_len=3, generated=17, tree=TreeConfig.chain(7)) == [[7, 7]]
    # 18 generated: the third round has 1 token left and accepts it (no bonus needed)
    rounds = _run(lambda r, p: True, prompt_len=3, generated=18, tree=TreeConfig.chain(7))
    assert rounds == [[7, 7, 1]]
    s = summarize(rounds, depth=7, drafted_per_round=7)
    assert s["acceptance_length"] == pytest.approx(1 + 15 / 3)
    assert s["per_position_acceptance"] == pytest.approx([1, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3])
    assert s["accepted_per_drafted"] == pytest.approx(15 / 21)


def test_always_agree_tree_matches_chain_depth():
    rounds = _run(lambda r, p: True, prompt_len=3, generated=17, tree=TreeConfig(topk=3, depth=7, tokens=20))
    assert rounds == [[7, 7]]


def test_never_agree_every_round_is_one_token():
    rounds = _run(lambda r, p: False, prompt_len=5, generated=12, tree=TreeConfig.chain(7), rows=2)
    assert rounds == [[0] * 11, [0] * 11]
    s = summarize(rounds, depth=7, drafted_per_round=7)
    assert s["acceptance_length"] == 1.0 and s["accepted"] == 0 and s["rounds"] == 22
    assert s["per_position_acceptance"] == [0.0] * 7


def test_sometimes_agree_by_position():
    # wrong exactly at positions divisible by 3; prompt 2 + 10 generated (positions 2..11)
    # round starts c = 3 (pos 3 wrong: 0), c = 4 (4, 5 ok, 6 wrong: 2), c = 7 (7, 8: 2), c = 10 (10, 11, then the end: 2)
    rounds = _run(lambda r, p: p % 3 != 0, prompt_len=2, generated=10, tree=TreeConfig.chain(7))
    assert rounds == [[0, 2, 2, 2]]
    s = summarize(rounds, depth=7, drafted_per_round=7)
    assert s["acceptance_length"] == pytest.approx(2.5)
    assert s["per_position_acceptance"][:3] == pytest.approx([0.75, 0.75, 0.0])
    assert s["conditional_acceptance"][:3] == pytest.approx([0.75, 1.0, 0.0])
    assert s["accepted_length_histogram"] == [1, 0, 3, 0, 0, 0, 0, 0]


def test_rows_finish_independently():
    # row 0 always right, row 1 never: lock-step batching must not mix their rounds
    rounds = _run(lambda r, p: r == 0, prompt_len=2, generated=9, tree=TreeConfig.chain(3), rows=2)
    assert rounds == [[3, 3], [0] * 8]


def test_summary_rejects_impossible_counts():
    with pytest.raises(ValueError):
        summarize([[8]], depth=7, drafted_per_round=7)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(topk=0, depth=3, tokens=3), "--tree-topk"),
        (dict(topk=2, depth=0, tokens=1), "--tree-depth"),
        (dict(topk=2, depth=2, tokens=7), "--tree-tokens"),
    ],
)
def test_tree_config_names_the_bad_option(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        TreeConfig(**kwargs)


def test_replay_batches_respect_the_token_budget():
    from eyas.capture.batching import plan_batches  # what the replay batches with

    lengths = [5, 100, 40, 40, 7, 99, 1]
    groups = plan_batches(lengths, 200)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 200 or len(g) == 1
    assert groups[0] == [1, 5]  # longest first: 2 x 100 fits, a third does not
