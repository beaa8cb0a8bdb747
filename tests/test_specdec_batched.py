"""Batched speculative decoding (specdec/speculative_batched.py) on a tiny random float32 target and the
tilted tiny drafter (conftest.py).

Every row of a batch must give that prompt's target-only greedy tokens (Hugging Face greedy, cut at the
EOS and max_new_tokens) and the batch-1 engine's accepted counts round for round, in chain and tree
mode, with prompts of different lengths, rows that stop on an EOS, on the length cut and after
different numbers of rounds, and idle rows (fewer prompts than the batch). Target-only decoding through
the same loop (no drafter) must give the same tokens.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import tilted_drafter

from eyas.drafter.reader import read_drafter
from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.generate import greedy_generate
from eyas.specdec.replay import TreeConfig
from eyas.specdec.speculative import SpeculativeDecoder
from eyas.specdec.speculative_batched import BatchedSpeculativeDecoder
from eyas.target import load_target

MAX_NEW = 24
LAYERS = [1, 3, 4]
TREES = [TreeConfig.chain(4), TreeConfig(topk=3, depth=4, tokens=12)]
TREE_IDS = ["chain4", "tree3x4x12"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    target = load_target(tiny_target_dir)
    g = torch.Generator().manual_seed(1)
    # lengths 4, 9, 6, 3, 12: a batch pads to its longest; the first four are test_specdec_speculative's
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 9, 6)]
    prompts.append([1, 5, 9])
    prompts.append(torch.randint(3, 49152, (12,), generator=g).tolist())
    gen = greedy_generate(target, prompts, max_new_tokens=MAX_NEW, eos_ids=set(), pad_id=2, batch_size=5)
    counts = Counter(t for g_ in gen for t in g_)
    out = tmp_path_factory.mktemp("drafter")
    tilted_drafter(target, prompts[0] + gen[0], gen, out, layers=LAYERS)
    d = read_drafter(out)
    drafter = FunctionalDrafter(d.config, d.weights)
    # an EOS id the last-but-one prompt's continuation reaches mid-way (and no other row before its
    # end): that row stops rounds before the others
    eos = next(t for t in gen[3][MAX_NEW // 2 :] if counts[t] == 1)
    return target, drafter, prompts, gen, eos, out


def _cut(toks, eos):
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def _batched(target, drafter, tree, eos, batch, **kw):
    return BatchedSpeculativeDecoder(
        target, drafter, tree=tree, layer_ids=LAYERS, max_len=128, eos_ids={eos}, batch=batch, **kw
    )


@pytest.mark.parametrize("tree", TREES, ids=TREE_IDS)
def test_batched_greedy_equals_target_greedy_and_batch_1(setup, tree):
    target, drafter, prompts, gen, eos, _ = setup
    dec = _batched(target, drafter, tree, eos, batch=4)
    one = SpeculativeDecoder(target, drafter, tree=tree, layer_ids=LAYERS, max_len=128, eos_ids={eos})
    singles = {}
    for max_new in (MAX_NEW, 7):
        for i, p in enumerate(prompts):
            singles[i, max_new] = one.generate(p, max_new_tokens=max_new)
    # a full batch, then (the same engine, reused) a partial one with an idle row, in another order
    for rows, max_new in (([0, 1, 2, 3], MAX_NEW), ([4, 3, 1], MAX_NEW), ([2, 4, 0, 3], 7)):
        outs, st, acc = dec.generate([prompts[i] for i in rows], max_new_tokens=max_new)
        for r, i in enumerate(rows):
            want = _cut(gen[i][:max_new], eos)
            assert outs[r] == want, f"row {r} (prompt {i}) differs from the target's greedy tokens"
            o1, s1 = singles[i, max_new]
            assert o1 == want and acc[r] == s1.accepted_per_round, (i, acc[r], s1.accepted_per_round)
        assert st.tokens == sum(map(len, outs)) and st.accepted_per_round == [a for a in acc for a in a]
        assert st.prompt_tokens == sum(len(prompts[i]) for i in rows)
        if max_new == MAX_NEW:
            # rows end on the EOS and on the length cut, after different numbers of rounds
            assert any(eos in o for o in outs) and any(len(o) == MAX_NEW for o in outs)
            assert len({len(a) for a in acc}) > 1, acc
    flat = [a for i in range(len(prompts)) for a in singles[i, MAX_NEW][1].accepted_per_round]
    assert 0 in flat and max(flat) >= (2 if tree.is_chain else 3), flat


def test_batched_target_only_equals_plain_greedy(setup):
    target, _, prompts, gen, eos, _ = setup
    dec = _batched(target, None, None, eos, batch=3)
    for rows, max_new in (([0, 3, 4], MAX_NEW), ([1, 2], 5), ([3], 1)):
        outs, st, acc = dec.generate([prompts[i] for i in rows], max_new_tokens=max_new)
        assert outs == [_cut(gen[i][:max_new], eos) for i in rows]
        assert acc == [[] for _ in rows] and st.accepted_per_round == []
        assert st.tokens == sum(map(len, outs)) and (st.verify_s > 0) == (max_new > 1)


def test_batched_rows_are_independent_of_their_batch(setup):
    """Tree mode, batch 5 (every prompt; a 12-token and a 3-token prompt in one padded prefill): the
    tokens and accepted counts of each row are those of the same prompt decoded alone at batch 1 by
    the batched engine, and a row is not disturbed when its neighbour stops on an EOS."""
    target, drafter, prompts, gen, eos, _ = setup
    tree = TREES[1]
    five = _batched(target, drafter, tree, eos, batch=5)
    alone = _batched(target, drafter, tree, eos, batch=1)
    outs, _, acc = five.generate(prompts, max_new_tokens=MAX_NEW)
    for i, p in enumerate(prompts):
        o1, _, a1 = alone.generate([p], max_new_tokens=MAX_NEW)
        assert (outs[i], acc[i]) == (o1[0], a1[0]) and outs[i] == _cut(gen[i], eos)
    assert eos in outs[3] and len(outs[3]) < MAX_NEW


@pytest.mark.parametrize("tree", TREES, ids=TREE_IDS)
def test_batched_caches_hold_each_rows_committed_tokens(setup, tree):
    """After a batch, every row's target KV cache (all layers) and drafter step-0 cache below its
    committed length equal a fresh causal pass over that row's committed tokens: the accepted path's
    keys were moved into place, rejected nodes dropped, and rows that stopped stayed frozen."""
    from eyas.specdec.speculative import LiveProposer, TreeTarget

    target, drafter, prompts, _, eos, _ = setup
    dec = _batched(target, drafter, tree, eos, batch=4)
    rows = [1, 3, 4, 0]
    outs, _, acc = dec.generate([prompts[i] for i in rows], max_new_tokens=MAX_NEW)
    assert any(a >= 2 for r in acc for a in r)  # paths that had to be moved into place
    ref_t = TreeTarget(target, max_len=128, layer_ids=LAYERS)
    ref_d = LiveProposer(drafter, max_len=128, tree_slots=0)
    for r, i in enumerate(rows):
        seq = prompts[i] + outs[r]
        n = int(dec.start[r])  # the cache holds s_0..s_{n-1}
        assert len(prompts[i]) <= n < len(seq)
        ref_t.reset()
        ref_d.reset()
        with torch.no_grad():
            _, aux = ref_t.forward(torch.tensor(seq[:n]), torch.arange(n), None)
            ref_d.extend(torch.tensor(seq[1 : n + 1]), aux)
        for layer in range(len(ref_t.lm.cache_k)):
            torch.testing.assert_close(
                dec.cache_k[layer, r, :, :n], ref_t.lm.cache_k[layer][0, :, :n], rtol=1e-4, atol=1e-4
            )
            torch.testing.assert_close(
                dec.cache_v[layer, r, :, :n], ref_t.lm.cache_v[layer][0, :, :n], rtol=1e-4, atol=1e-4
            )
        torch.testing.assert_close(dec.proposer.k[r, :, :n], ref_d.k[0, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dec.proposer.v[r, :, :n], ref_d.v[0, :, :n], rtol=1e-4, atol=1e-4)
    # target-only: one token a round, so a row that stopped after k tokens committed exactly k - 1 of
    # them past its prompt (its last round's token is not fed back): frozen rows do not advance
    plain = _batched(target, None, None, eos, batch=4)
    outs, _, _ = plain.generate([prompts[i] for i in rows], max_new_tokens=MAX_NEW)
    assert [int(x) for x in plain.start] == [len(prompts[i]) + max(len(o) - 2, 0) for i, o in zip(rows, outs)]
    assert len({len(o) for o in outs}) > 1


def test_batched_prefill_attends_over_the_longest_prompt_only(setup, attention_calls):
    """The batched prefill spans the longest prompt's slots, not max_len, with cuDNN attention off (see
    test_specdec_speculative.py's test_prefill_attends_over_the_prompt_only); the rounds span the cache."""
    target, drafter, prompts, _, eos, _ = setup
    rows = [prompts[i] for i in (0, 4, 3)]  # lengths 4, 12, 3 and an idle row
    for d, tree in ((drafter, TREES[1]), (None, None)):
        dec = _batched(target, d, tree, eos, batch=4)
        n = target.config.num_hidden_layers + (d is not None)
        attention_calls.clear()
        dec.generate(rows, max_new_tokens=2)  # the prefill, then one round
        prefill, rounds = attention_calls[:n], attention_calls[n:]
        assert prefill == [(12, 12, False)] * n
        assert rounds and all(k >= 128 and cudnn for _, k, cudnn in rounds), rounds


def test_batched_refuses_sampling_and_oversized_input(setup):
    target, drafter, prompts, _, eos, _ = setup
    with pytest.raises(ValueError, match="greedy only"):
        _batched(target, drafter, TREES[0], eos, batch=2, temperature=0.5)
    dec = _batched(target, None, None, eos, batch=2)
    with pytest.raises(ValueError, match="3 prompts for a batch of 2"):
        dec.generate(prompts[:3], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_len"):
        dec.generate(prompts[:1], max_new_tokens=124)


def test_batched_steps_never_read_the_device(setup):
    """What CUDA graph capture needs, checked on the CPU (as for the static engine): no step reads a
    tensor value on the host or builds a tensor from host values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    target, drafter, prompts, _, eos, _ = setup
    banned = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.item.default,
        torch.ops.aten.lift_fresh.default,
    }

    class NoHostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in banned:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for tree, d in ((TREES[1], drafter), (None, None)):
        dec = _batched(target, d, tree, eos, batch=3)
        dec.generate(prompts[:2], max_new_tokens=1)  # prefill only: a valid state, one idle row
        with NoHostReads() as mode:
            for step in dec.steps.values():
                step()
        assert mode.seen == [], mode.seen
    with NoHostReads() as mode:  # the check has power
        dec.start[dec.walk_m[0]]
    assert mode.seen


def _cli(*args):
    from typer.testing import CliRunner

    from eyas.cli import app

    res = CliRunner().invoke(app, ["generate", *map(str, args)])
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if res.exit_code == 0 else None)


@pytest.fixture(scope="module")
def three_prompts(tmp_path_factory):
    """Three conversations (two of two turns): turn 1 decodes 3 prompts (a batch of 2 and one of 1), turn 2 two."""
    p = tmp_path_factory.mktemp("prompts3") / "p.jsonl"
    p.write_text(
        json.dumps({"id": "a", "turns": ["Tell me a story.", "Shorter, please."]})
        + "\n"
        + json.dumps({"prompt": "What is 2+2?"})
        + "\n"
        + json.dumps({"id": "c", "turns": ["Name three colours.", "And three more?"]})
        + "\n"
    )
    return p


def test_generate_command_batch_size(setup, tiny_target_dir, three_prompts, tmp_path):
    """`eyas generate --batch-size 2`: the same tokens and accepted counts as --batch-size 1, the batch
    size in the report, tokens/s over every row's tokens."""
    *_, drafter_dir = setup
    common = [
        "--drafter",
        drafter_dir,
        "--target",
        tiny_target_dir,
        "--prompts",
        three_prompts,
        "--max-new-tokens",
        12,
        "--mode",
        "tree",
        "--tree-topk",
        3,
        "--tree-depth",
        3,
        "--tree-tokens",
        8,
        "--device",
        "cpu",
    ]
    res1, s1 = _cli(*common, "--out", tmp_path / "b1.jsonl")
    res2, s2 = _cli(*common, "--batch-size", 2, "--out", tmp_path / "b2.jsonl")
    assert res1.exit_code == 0 and res2.exit_code == 0, res1.output + res2.output
    r1 = [json.loads(x) for x in (tmp_path / "b1.jsonl").read_text().splitlines()]
    r2 = [json.loads(x) for x in (tmp_path / "b2.jsonl").read_text().splitlines()]
    key = lambda r: (r["id"], r["turn"], r["generated_ids"], r["accepted"])  # noqa: E731
    assert [key(r) for r in r2] == [key(r) for r in r1] and len(r2) == 5
    assert s1["batch_size"] == 1 and s1["engine"] == "plain" and s1["batches"] == 5
    assert s2["batch_size"] == 2 and s2["engine"] == "batched" and s2["batches"] == 3 and s2["cuda_graphs"] == []
    assert s2["greedy_mismatches"] == 0 and s2["acceptance_length"] == s1["acceptance_length"]
    assert s2["generated_tokens"] == s1["generated_tokens"] == sum(len(r["generated_ids"]) for r in r2)
    assert s2["tokens_per_s"] == pytest.approx(s2["generated_tokens"] / s2["time_s"]["total_s"], rel=1e-2)
    assert s2["speedup"] == pytest.approx(s2["tokens_per_s"] / s2["baseline_tokens_per_s"], rel=1e-3)
    # rows of one batch share its time
    assert r2[0]["seconds"] == r2[1]["seconds"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--batch-size", 0], "--batch-size"),
        (["--batch-size", 4, "--temperature", 0.5], "--batch-size 1"),
    ],
    ids=["zero", "sampling"],
)
def test_generate_batch_size_bad_input_exits_2(setup, tiny_target_dir, args, needle):
    *_, drafter_dir = setup
    res, _ = _cli("--drafter", drafter_dir, "--target", tiny_target_dir, *args)
    assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1, res.output
