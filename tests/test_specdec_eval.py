"""`eyas eval` end to end: report contents, the three drafter layouts, bad input, MT-bench on SmolLM2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app

LAYERS = [1, 3, 4]


def _make_drafter(target_dir, out, *, seed=0, **overrides):
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target

    target = load_target(target_dir)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=500, aux_layer_ids=LAYERS, **overrides)
    model = Eagle3Drafter(cfg)
    model.reset_parameters(seed=seed)
    if cfg.vocab_size == target.config.vocab_size and cfg.hidden_size == target.config.hidden_size:
        model.init_from_target(
            target.get_input_embeddings().weight.detach(),
            target.get_output_embeddings().weight.detach(),
            target.model.norm.weight.detach(),
        )
    model.save(out)
    return out


def _run(*args):
    res = CliRunner().invoke(app, ["eval", *map(str, args)])
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if res.exit_code == 0 else None)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eval_report_and_all_three_layouts(tiny_target_dir, tmp_path, prompts_file):
    src = _make_drafter(tiny_target_dir, tmp_path / "eyas")
    common = [
        "--target",
        tiny_target_dir,
        "--prompts",
        prompts_file,
        "--max-new-tokens",
        10,
        "--chain-k",
        3,
        "--tree-topk",
        3,
        "--tree-depth",
        3,
        "--tree-tokens",
        8,
    ]
    res, summary = _run("--drafter", src, "--out", tmp_path / "r_eyas", *common)
    assert res.exit_code == 0, res.output
    out = tmp_path / "r_eyas"
    report = json.loads((out / "report.json").read_text())
    assert {"report.json", "report.md", "acceptance.png", "sequences.jsonl"} <= {p.name for p in out.iterdir()}
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert report["drafter"]["format"] == "eyas" and report["drafter"]["aux_layer_ids"] == LAYERS
    assert set(report["definitions"]) >= {"acceptance_length", "per_position_acceptance", "accepted_per_drafted"}
    records = [json.loads(line) for line in (out / "sequences.jsonl").read_text().splitlines()]
    assert [(r["id"], r["turn"]) for r in records] == [("a", 1), ("2", 1), ("a", 2)]
    for mode, depth, per_round in (("chain", 3, 3), ("tree", 3, 8)):
        rounds = [a for r in records for a in r[f"accepted_{mode}"]]
        m = report["modes"][mode]
        assert m["rounds"] == len(rounds) and m["accepted"] == sum(rounds)
        assert m["acceptance_length"] == pytest.approx(1 + sum(rounds) / len(rounds))
        assert m["drafted"] == len(rounds) * per_round and len(m["per_position_acceptance"]) == depth
        assert summary[f"tau_{mode}"] == pytest.approx(m["acceptance_length"], abs=1e-4)
        for r in records:  # each round yields accepted + 1 tokens; the prefill one more; the last may lack a bonus
            gen, acc = len(r["generated_ids"]), r[f"accepted_{mode}"]
            assert sum(acc) + len(acc) in (gen - 1, gen)
    assert report["generation"]["generated_tokens"] == sum(len(r["generated_ids"]) for r in records)
    assert "tau (acceptance length)" in (out / "report.md").read_text()

    # the same drafter in SGLang and vLLM/speculators layout: same layers, same replay
    for fmt, layout in (("sglang", "sglang"), ("vllm", "speculators")):
        assert (
            CliRunner()
            .invoke(app, ["export", "--drafter", str(src), "--format", fmt, "--out", str(tmp_path / fmt)])
            .exit_code
            == 0
        )
        res, _ = _run("--drafter", tmp_path / fmt, "--out", tmp_path / f"r_{fmt}", *common)
        assert res.exit_code == 0, res.output
        other = json.loads((tmp_path / f"r_{fmt}" / "report.json").read_text())
        assert other["drafter"]["format"] == layout and other["drafter"]["aux_layer_ids"] == LAYERS
        theirs = [json.loads(line) for line in (tmp_path / f"r_{fmt}" / "sequences.jsonl").read_text().splitlines()]
        assert theirs == records

    # an existing report directory is not overwritten silently
    res, _ = _run("--drafter", src, "--out", out, *common)
    assert res.exit_code == 2 and "--overwrite" in res.output


def test_eval_rejects_a_drafter_for_another_target(tiny_target_dir, tmp_path, prompts_file):
    wrong_vocab = _make_drafter(tiny_target_dir, tmp_path / "v", vocab_size=32000)
    res, _ = _run(
        "--drafter", wrong_vocab, "--target", tiny_target_dir, "--prompts", prompts_file, "--out", tmp_path / "o1"
    )
    assert res.exit_code == 2 and "vocabulary of 32000" in res.output and "49152" in res.output
    wrong_hidden = _make_drafter(tiny_target_dir, tmp_path / "h", target_hidden_size=48)
    res, _ = _run(
        "--drafter", wrong_hidden, "--target", tiny_target_dir, "--prompts", prompts_file, "--out", tmp_path / "o2"
    )
    assert res.exit_code == 2 and "width 48" in res.output and "hidden size is 64" in res.output


def test_a_drafter_is_used_only_with_the_target_it_was_trained_for(
    tiny_target_dir, tmp_path, prompts_file, smol_tokenizer, monkeypatch
):
    """A drafter recording its target (as `eyas train` writes it) against another target of the same shape (same
    config, other weights): eval, generate and export (a local --verifier) exit 2 before any model loads;
    --allow-other-target goes on."""
    from conftest import make_tiny_target

    from eyas.drafter.model import Eagle3Drafter
    from eyas.target import model_identity, tokenizer_hash

    other = make_tiny_target(tmp_path / "other", smol_tokenizer, seed=1)
    assert (other / "config.json").read_bytes() == (tiny_target_dir / "config.json").read_bytes()
    src = _make_drafter(tiny_target_dir, tmp_path / "d")
    Eagle3Drafter.load(src).save(
        src, target={**model_identity(tiny_target_dir), "tokenizer_hash": tokenizer_hash(smol_tokenizer)}
    )
    common = ["--drafter", src, "--target", other, "--prompts", prompts_file, "--max-new-tokens", 4, "--limit", 1]
    said = f"--drafter {src} was trained for target {tiny_target_dir.resolve()}, not --target {other} (their weights differ)"
    res, _ = _run(*common, "--out", tmp_path / "e1")
    assert res.exit_code == 2 and said in res.stderr and "--allow-other-target" in res.stderr, res.stderr
    gen = CliRunner().invoke(app, ["generate", *map(str, common), "--device", "cpu", "--no-baseline", "--warmup", "0"])
    assert gen.exit_code == 2 and said in gen.stderr, gen.stderr
    exp = CliRunner().invoke(
        app,
        ["export", "--drafter", str(src), "--format", "vllm", "--verifier", str(other), "--out", str(tmp_path / "x1")],
    )
    assert exp.exit_code == 2 and "not --verifier" in exp.stderr and "(their weights differ)" in exp.stderr, exp.stderr
    res, summary = _run(*common, "--out", tmp_path / "e2", "--allow-other-target")
    assert res.exit_code == 0 and "going on (--allow-other-target)" in res.stderr, res.stderr
    exp = CliRunner().invoke(
        app,
        [
            "export",
            "--drafter",
            str(src),
            "--format",
            "vllm",
            "--verifier",
            str(other),
            "--out",
            str(tmp_path / "x2"),
            "--allow-other-target",
        ],
    )
    assert exp.exit_code == 0, exp.stderr
    res, _ = _run(
        "--drafter",
        src,
        "--target",
        tiny_target_dir,
        "--prompts",
        prompts_file,
        "--max-new-tokens",
        4,
        "--limit",
        1,
        "--out",
        tmp_path / "e3",
    )
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr


def test_eval_rejects_prompts_longer_than_the_context(tiny_target_dir, tmp_path):
    src = _make_drafter(tiny_target_dir, tmp_path / "d")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "big", "prompt": "word " * 2100}) + "\n")
    res, _ = _run(
        "--drafter", src, "--target", tiny_target_dir, "--prompts", long, "--out", tmp_path / "o", "--max-new-tokens", 8
    )
    assert res.exit_code == 2 and "prompt big turn 1" in res.output and "context of 2048" in res.output


def test_eval_rejects_bad_tree_options(tiny_target_dir, tmp_path, prompts_file):
    src = _make_drafter(tiny_target_dir, tmp_path / "d")
    res, _ = _run(
        "--drafter",
        src,
        "--target",
        tiny_target_dir,
        "--prompts",
        prompts_file,
        "--out",
        tmp_path / "o",
        "--tree-topk",
        2,
        "--tree-depth",
        2,
        "--tree-tokens",
        100,
    )
    assert res.exit_code == 2 and "--tree-tokens" in res.output


def test_eval_mtbench_two_turns_on_smollm2(smol_dir, smol_tokenizer, tmp_path):
    """The real default target: MT-bench's first question, turn 2 rendered after the target's own answer."""
    src = _make_drafter(smol_dir, tmp_path / "d")
    res, summary = _run(
        "--drafter",
        src,
        "--limit",
        1,
        "--max-new-tokens",
        6,
        "--out",
        tmp_path / "o",
        "--tree-topk",
        4,
        "--tree-depth",
        3,
        "--tree-tokens",
        10,
    )
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in (tmp_path / "o" / "sequences.jsonl").read_text().splitlines()]
    assert [r["turn"] for r in records] == [1, 2] and records[0]["id"] == records[1]["id"] == "81"
    from eyas.defaults import mtbench_path

    question = json.loads(mtbench_path().read_text().splitlines()[0])
    from eyas.specdec.generate import render

    answer = smol_tokenizer.decode(records[0]["generated_ids"], skip_special_tokens=True)
    turn2 = render(
        smol_tokenizer,
        [
            {"role": "user", "content": question["turns"][0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": question["turns"][1]},
        ],
    )
    assert records[1]["prompt_tokens"] == len(turn2)
    assert summary["sequences"] == 2 and summary["generated_tokens"] == 12
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert set(report["modes"]["tree"]["per_category"]) == {"writing"}  # MT-bench question 81


def test_greedy_generation_moves_its_progress_every_decode_step(tiny_target_dir, monkeypatch):
    """Eval's batched generation advances its progress per decode step (rows x steps), not once a batch,
    and ends at prompts x max-new-tokens whatever the rows' early ends."""
    from eyas.specdec import generate
    from eyas.target import load_target

    updates = []

    class Bar:
        def update(self, n=1):
            updates.append(n)

        def close(self):
            pass

    totals = []
    monkeypatch.setattr(generate, "progress", lambda total, *a, **kw: totals.append(total) or Bar())
    model = load_target(tiny_target_dir)
    prompts = [[1, 5, 9], [1, 7], [1, 2, 3, 4]]
    out = generate.hf_greedy_generate(model, prompts, max_new_tokens=6, eos_ids={0}, pad_id=0, batch_size=2)
    assert len(out) == 3 and totals == [3 * 6]
    assert sum(updates) == 3 * 6 and len(updates) >= 2 * 3  # every step of each of the two batches
    updates.clear()
    out = generate.greedy_generate(model, prompts, max_new_tokens=6, eos_ids={0}, pad_id=0, batch_size=2)
    assert len(out) == 3 and totals == [3 * 6] * 2
    assert sum(updates) == 3 * 6 and len(updates) == 3  # the static engine: once per answer


def test_eval_answers_from_the_static_engine_are_generates_greedy_answers(tiny_target_dir):
    """The static-cache engine (the default where it supports the target) gives Hugging Face generate's greedy
    continuations in float32, EOS kept and nothing after it, in input order, at a batch smaller than the prompts."""
    import torch

    from eyas.regen.static_lm import unsupported_reason
    from eyas.specdec import generate
    from eyas.target import load_target

    model = load_target(tiny_target_dir)
    assert unsupported_reason(model, 64) is None  # so greedy_generate takes the engine
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 2, 9, 30)]
    ref = generate.hf_greedy_generate(model, prompts, max_new_tokens=12, eos_ids=set(), pad_id=2, batch_size=8)
    stop = {ref[1][4], ref[3][0]}  # ids the target does produce: some answers end early, on different ids
    ref = generate.hf_greedy_generate(model, prompts, max_new_tokens=12, eos_ids=stop, pad_id=2, batch_size=8)
    out = generate.greedy_generate(model, prompts, max_new_tokens=12, eos_ids=stop, pad_id=2, batch_size=2)
    assert out == ref
    assert any(len(x) < 12 and x[-1] in stop for x in out) and any(len(x) == 12 for x in out)


def test_cpu_sizes_name_limit_only_where_the_prompts_hold_more():
    from eyas.specdec.run import cpu_sized

    assert cpu_sized(80) == {"limit": 4, "max_new_tokens": 48}  # MT-bench's 80 questions
    assert cpu_sized(3) == {"max_new_tokens": 48}  # a short prompts file: --limit would change nothing


ANSWER_OPTS = ["--max-new-tokens", 6, "--chain-k", 3, "--tree-topk", 3, "--tree-depth", 3, "--tree-tokens", 8]


def test_eval_on_recorded_answers_replays_them_without_generating(tiny_target_dir, tmp_path, prompts_file, monkeypatch):
    """--answers: the same drafter on an earlier eval's answers gives that eval's records and tau; another drafter is
    replayed on the same answers; a lower --limit takes the first conversations'; the target generates nothing."""
    first = _make_drafter(tiny_target_dir, tmp_path / "d0")
    common = ["--target", tiny_target_dir, "--prompts", prompts_file, *ANSWER_OPTS]
    res, made = _run("--drafter", first, "--out", tmp_path / "a", *common)
    assert res.exit_code == 0, res.output
    from eyas.specdec import generate

    def no_generation(*args, **kwargs):
        raise AssertionError("the target generated answers although --answers was given")

    monkeypatch.setattr(generate, "greedy_generate", no_generation)
    res, again = _run("--drafter", first, "--out", tmp_path / "b", "--answers", tmp_path / "a", *common)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "b" / "sequences.jsonl").read_text() == (tmp_path / "a" / "sequences.jsonl").read_text()
    assert (again["tau_chain"], again["tau_tree"]) == (made["tau_chain"], made["tau_tree"])
    assert "generation_s" in made["timings"] and "generation_s" not in again["timings"]
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["generation"]["answers"]["source"] == str((tmp_path / "a").resolve())
    generated = json.loads((tmp_path / "a" / "report.json").read_text())["generation"]
    assert generated["answers"] is None and generated["answers_digest"] == report["generation"]["answers_digest"]
    assert report["generation"]["answers"]["device"] == "cpu"

    other = _make_drafter(tiny_target_dir, tmp_path / "d1", seed=1)
    res, _ = _run("--drafter", other, "--out", tmp_path / "c", "--answers", tmp_path / "a", *common, "--limit", 1)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "c" / "sequences.jsonl").read_text().splitlines()]
    first_rows = [json.loads(line) for line in (tmp_path / "a" / "sequences.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "a"]  # the first conversation's two turns
    assert [r["generated_ids"] for r in rows] == [r["generated_ids"] for r in first_rows if r["id"] == "a"]


def test_eval_refuses_recorded_answers_that_do_not_belong(
    tiny_target_dir, tmp_path, prompts_file, smol_tokenizer, monkeypatch
):
    """Each mismatch is a one-line error (exit 2) before the target loads: another --max-new-tokens, prompts the
    answers do not hold, a prompt that renders otherwise, a cut sequences.jsonl, another target's answers."""
    import shutil

    from conftest import make_tiny_target

    src = _make_drafter(tiny_target_dir, tmp_path / "d")
    res, _ = _run(
        "--drafter", src, "--target", tiny_target_dir, "--prompts", prompts_file, "--out", tmp_path / "a", *ANSWER_OPTS
    )
    assert res.exit_code == 0, res.output
    import eyas.target

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the answers were checked")

    monkeypatch.setattr(eyas.target, "load_target", no_load)
    more = tmp_path / "more.jsonl"
    more.write_text(prompts_file.read_text() + json.dumps({"id": "z", "prompt": "And 3+3?"}) + "\n")
    reworded = tmp_path / "reworded.jsonl"
    reworded.write_text(prompts_file.read_text().replace("Shorter, please.", "Longer, please."))
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "a", cut)
    (cut / "sequences.jsonl").write_text("".join((cut / "sequences.jsonl").read_text().splitlines(True)[:-1]))
    other = make_tiny_target(tmp_path / "other", smol_tokenizer, seed=1)
    cases = [
        (tiny_target_dir, prompts_file, tmp_path / "a", ["--max-new-tokens", 5], "generated with --max-new-tokens 6"),
        (tiny_target_dir, more, tmp_path / "a", [], "no answer to prompt z turn 1"),
        (tiny_target_dir, reworded, tmp_path / "a", [], "prompt a turn 2 renders to other ids"),
        (tiny_target_dir, prompts_file, cut, [], "holds 2 distinct answers, its report.json 3"),
        (other, prompts_file, tmp_path / "a", [], "(their weights differ)"),
    ]
    for n, (target, prompts, answers, extra, said) in enumerate(cases):
        args = ["--drafter", src, "--target", target, "--prompts", prompts, "--answers", answers, *ANSWER_OPTS, *extra]
        res, _ = _run(*args, "--allow-other-target", "--out", tmp_path / f"o{n}")
        assert res.exit_code == 2 and said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not (tmp_path / f"o{n}").exists()
