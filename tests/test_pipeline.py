"""`eyas pipeline`: the CPU smoke recipe end to end on a tiny random target, skip/rerun by fingerprint,
errors in the file before any model loads, and the selection of a shared regeneration's chats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SMOKE = RECIPES / "smollm2-cpu-smoke.toml"


def _run(*args: str):
    res = CliRunner().invoke(app, ["pipeline", *args])
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if res.exit_code == 0 else None)


def _statuses(summary) -> dict[str, str]:
    return {k: v["status"] for k, v in summary["stages"].items()}


def test_smoke_recipe_runs_then_skips_then_reruns_only_what_changed(tmp_path, tiny_target_dir, one_torch_thread):
    work = tmp_path / "work"
    base = [
        str(SMOKE),
        "--workdir",
        str(work),
        "--set",
        f"target={json.dumps(str(tiny_target_dir))}",
        "--set",
        "regenerate.limit=6",
        "--set",
        "regenerate.max_new_tokens=12",
        "--set",
        "train.steps=2",
        "--set",
        "train.draft_vocab=256",
    ]
    res, s = _run(*base)
    assert res.exit_code == 0, res.output
    assert _statuses(s) == dict.fromkeys(("regenerate", "prepare", "train", "eval", "export"), "ran")
    assert s["stages"]["regenerate"]["selected"] == 6
    assert s["stages"]["train"]["steps"] == 2
    assert s["tau_chain"] >= 1.0 and s["tau_tree"] >= 1.0
    for fmt in ("sglang", "vllm"):
        assert (work / "export" / fmt / "config.json").is_file()
    rec = json.loads((work / "train" / "stage.json").read_text())
    assert rec["status"] == "complete" and rec["summary"]["steps"] == 2

    # the same file again: every stage skipped, the figures carried over from the records
    res, s2 = _run(*base)
    assert res.exit_code == 0, res.output
    assert set(_statuses(s2).values()) == {"skipped"}
    assert s2["tau_tree"] == s["tau_tree"]

    # one training option changed: train, eval and export rerun; regenerate and prepare are kept
    mtime = (work / "prepared" / "meta.json").stat().st_mtime_ns
    notes = [work / "train" / "NOTES.txt", work / "eval" / "NOTES.txt", work / "export" / "sglang" / "NOTES.txt"]
    for n in notes:  # files of the user's inside the stage folders survive the rerun
        n.write_text("mine")
    res, s3 = _run(*base, "--set", "train.lr=2e-3")
    assert res.exit_code == 0, res.output
    assert [n.read_text() for n in notes] == ["mine"] * 3
    from eyas.common import marker_kind

    assert [marker_kind(work / d) for d in ("prepared", "train", "eval", "export")] == [
        "prepare",
        "train",
        "eval",
        "exports",
    ]
    assert _statuses(s3) == {
        "regenerate": "skipped",
        "prepare": "skipped",
        "train": "rerun",
        "eval": "rerun",
        "export": "rerun",
    }
    assert (work / "prepared" / "meta.json").stat().st_mtime_ns == mtime
    assert json.loads((work / "train" / "stage.json").read_text())["options"]["lr"] == 2e-3
    # the old run's checkpoints were cleared, not resumed from (a resume would have skipped every step)
    assert len(list((work / "train" / "checkpoints").glob("*.safetensors"))) == 1


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--set", "train.lrr=1e-3"], "[train] unknown key `lrr`"),
        (["--set", "evaluate.limit=1"], "unknown section [evaluate]"),
        (["--set", "train.out=x"], "[train] `out` is filled in by the pipeline"),
        (["--set", "eval.target=x"], "[eval] `target` is filled in by the pipeline"),
        (["--set", 'train.steps="ten"'], "[train] `steps` = 'ten': expected"),
        (["--set", "train.batch_size=0"], "[train] --batch-size must be >= 1"),
        (["--set", "colour=1"], "unknown top-level key `colour`"),
        (
            ["--set", 'export.formats=["sglang"]', "--set", "export.speculative_tokens=3"],
            "[export] speculative_tokens 3: only applies to the vllm format",
        ),
        (["--set", "export.speculative_tokens=0"], "[export] --speculative-tokens must be >= 1"),  # not after training
    ],
)
def test_bad_keys_exit_2_naming_key_and_file_before_any_work(tmp_path, extra, needle):
    work = tmp_path / "work"
    res, _ = _run(str(SMOKE), "--workdir", str(work), *extra)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and str(SMOKE) in res.stderr
    assert not work.exists()  # nothing written, no model loaded


def test_a_stage_without_its_predecessor_and_a_missing_file_are_errors(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('workdir = "w"\n[prepare]\n[eval]\n')
    res, _ = _run(str(cfg))
    assert res.exit_code == 2 and "[train] is missing" in res.stderr
    res, _ = _run(str(tmp_path / "nope.toml"))
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_a_directory_or_binary_file_is_not_a_pipeline_file(tmp_path):
    res, _ = _run(str(tmp_path))
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == f"error: pipeline file {tmp_path} is a directory, expected a file"
    binary = tmp_path / "p.toml"
    binary.write_bytes(b"workdir = \xff\xfe\n")
    res, _ = _run(str(binary))
    assert res.exit_code == 2 and f"pipeline file {binary} is not UTF-8 text" in res.stderr
    assert "convert it to UTF-8 TOML" in res.stderr


def test_help_shows_the_section_brackets():
    res = CliRunner().invoke(app, ["pipeline", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert res.exit_code == 0 and "and one [section] per stage" in " ".join(res.output.split())  # (wrapped)


def test_a_directory_eyas_did_not_write_is_never_replaced(tmp_path):
    work = tmp_path / "work"
    (work / "prepared").mkdir(parents=True)
    mine = work / "prepared" / "notes.txt"
    mine.write_text("mine")
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'workdir = "{work}"\n[prepare]\nlimit = 2\n')
    res, _ = _run(str(cfg))
    assert res.exit_code == 2 and "was not written by `eyas pipeline`" in res.stderr
    assert mine.read_text() == "mine"


def test_shared_regeneration_selects_only_its_own_source_records(tmp_path):
    """A regenerate output grown to 5 source records, decided out of order, read by a pipeline whose
    limit is 3: only records 0..2 that were written, in file order; fewer decided than asked is an error."""
    from eyas.errors import EyasError
    from eyas.pipeline import _select_chats
    from eyas.regen.output import ChatsWriter

    run = tmp_path / "regen"
    w = ChatsWriter(run, settings={"s": 1}, extra_meta={"source_info": {"records": 5}})
    for index in (3, 0, 4, 2, 1):
        rec = {"id": f"c{index}", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        if index == 2:
            w.add(index, f"c{index}", None, reason="context_overflow")
        else:
            w.add(index, f"c{index}", rec, tokens=10 + index, turns=1)
    w.commit(elapsed_s=1.0, complete=True)
    sel = _select_chats(run, 3, tmp_path / "chats.jsonl")
    ids = [json.loads(line)["id"] for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    assert ids == ["c0", "c1"] and sel["conversations"] == 2 and sel["answer_tokens"] == 10 + 11
    assert len(_select_chats(run, None, tmp_path / "all.jsonl")["sha256"]) == 64
    assert (tmp_path / "all.jsonl").read_text().count("\n") == 4

    w2 = ChatsWriter(tmp_path / "partial", settings={"s": 1}, extra_meta={"source_info": {"records": 5}})
    w2.add(0, "c0", None, reason="x")
    w2.commit(elapsed_s=1.0)
    with pytest.raises(EyasError, match="only 1 of the first 3"):
        _select_chats(tmp_path / "partial", 3, tmp_path / "p.jsonl")


def test_shipped_recipes_name_only_real_options(tmp_path):
    """Every key of both recipes is a field of its stage's config (a renamed option breaks here, not on a GPU)."""
    from eyas.pipeline import load_config

    # device=cpu: CI has no GPU, and `cuda` is refused where CUDA is missing (checked elsewhere)
    gpu = load_config(RECIPES / "smollm2-gpu.toml", workdir=tmp_path / "g", overrides=['device="cpu"'])
    st = gpu["stages"]
    assert list(st) == ["regenerate", "prepare", "train", "eval", "export"]
    assert (st["regenerate"].max_turns, st["regenerate"].max_new_tokens) == (2, 512)
    assert (st["train"].ttt_steps, st["train"].draft_vocab, str(st["train"].data)) == (
        7,
        32000,
        str(tmp_path / "g" / "prepared"),
    )
    assert st["train"].tokens_per_batch == 65536 and st["train"].draft_intermediate_size == 6144
    assert st["regenerate"].limit == 17671 and st["train"].steps == 2400
    assert st["prepare"].source == str(tmp_path / "g" / "regenerate" / "chats.jsonl")
    assert (st["eval"].prompts, st["eval"].chain_k, st["eval"].tree_tokens) == ("mtbench", 7, 60)
    assert st["export"].formats == ["sglang", "vllm"]
    assert load_config(SMOKE)["stages"]["train"].device == "cpu"
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize(
    "until, needle",
    [
        ("trian", "--until 'trian': not a stage; expected one of regenerate, prepare, train, eval, export"),
        ("regenerate", "has no [regenerate] stage; its stages are prepare"),
    ],
)
def test_until_a_bad_stage_exits_2_before_any_work(tmp_path, until, needle):
    cfg = tmp_path / "p.toml"
    work = tmp_path / "work"
    cfg.write_text(f'workdir = "{work}"\n[prepare]\nlimit = 2\n')
    res, _ = _run(str(cfg), "--until", until)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not work.exists()


def test_until_stops_after_the_stage_and_a_covering_shared_regeneration_is_only_read(
    tmp_path, tiny_target_dir, one_torch_thread
):
    """--until regenerate runs that stage alone; a second pipeline whose limit the shared regeneration
    already covers reads it without rewriting a byte (concurrent readers are safe); a larger limit
    or other settings are not covered (that pipeline regenerates, as before)."""
    from eyas.pipeline import load_config, shared_coverage

    shared = tmp_path / "regen"
    base = [
        str(SMOKE),
        "--set",
        f"target={json.dumps(str(tiny_target_dir))}",
        "--set",
        "regenerate.max_new_tokens=8",
        "--set",
        f"regenerate.out={json.dumps(str(shared))}",
        "--until",
        "regenerate",
    ]
    res, s = _run(*base, "--workdir", str(tmp_path / "a"), "--set", "regenerate.limit=5")
    assert res.exit_code == 0, res.output
    assert _statuses(s) == {"regenerate": "ran"}
    assert s["until"] == "regenerate" and s["not_run"] == ["prepare", "train", "eval", "export"]
    assert s["stages"]["regenerate"]["selected"] == 5 and "shared" not in s["stages"]["regenerate"]
    assert not (tmp_path / "a" / "prepared").exists() and not (tmp_path / "a" / "train").exists()

    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in shared.iterdir() if p.is_file()}
    res, s2 = _run(*base, "--workdir", str(tmp_path / "b"), "--set", "regenerate.limit=3")
    assert res.exit_code == 0, res.output
    r = s2["stages"]["regenerate"]
    assert r["status"] == "ran" and r["shared"] == "read" and r["selected"] == 3 and r["tokens_this_run"] == 0
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in shared.iterdir() if p.is_file()} == before
    assert (tmp_path / "b" / "regenerate" / "chats.jsonl").read_text().count("\n") == 3

    def cov(*extra):
        over = [
            f"target={json.dumps(str(tiny_target_dir))}",
            "regenerate.max_new_tokens=8",
            f"regenerate.out={json.dumps(str(shared))}",
            *extra,
        ]
        return shared_coverage(load_config(SMOKE, overrides=over, workdir=tmp_path / "c")["stages"]["regenerate"])

    assert cov("regenerate.limit=5") is not None
    assert cov("regenerate.limit=6") is None  # record 5 not decided yet
    assert cov("regenerate.limit=5", "regenerate.max_new_tokens=9") is None  # other settings: not this run


def test_export_speculative_tokens_is_recorded_as_5_only_with_the_vllm_format(tmp_path):
    """Left unset, [export] speculative_tokens is the vllm default 5 in the stage's options (so its fingerprint is
    what it was when 5 was always written); without vllm it stays unset: the sglang format has no such setting."""
    from eyas.pipeline import check_config

    def export(**section):
        return check_config({"workdir": str(tmp_path), "export": section}, where="p.toml")["stages"]["export"]

    assert export().speculative_tokens == 5 and export(speculative_tokens=2).speculative_tokens == 2
    assert export(formats=["sglang"]).speculative_tokens is None


def test_a_stage_folder_without_a_record_is_eyas_by_its_marker_or_files(tmp_path):
    """No stage.json: a stage folder is eyas's when it is that stage's eyas output (common.output_kind: its marker) or
    its files show one (a training run's metrics); a prepared dataset copied without its marker is refused up front,
    not after the stages before it ran (prepare would refuse it: eyas never replaces what has no marker)."""
    from eyas.common import write_marker
    from eyas.errors import EyasError
    from eyas.pipeline import claim

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text(json.dumps({"schema": "eyas.prepared/1"}))
    with pytest.raises(EyasError, match="was not written by `eyas pipeline`"):
        claim("prepare", prepared)
    write_marker(prepared, kind="prepare")
    claim("prepare", prepared)  # no error
    with pytest.raises(EyasError, match="was not written by `eyas pipeline`"):
        claim("eval", prepared)  # another stage's output
    train = tmp_path / "train"
    train.mkdir()
    (train / "metrics.jsonl").write_text('{"step": 1}\n')
    claim("train", train)  # no error


def test_an_export_killed_mid_way_is_redone_not_refused(tmp_path):
    """A SIGTERM during export leaves one finished format and the next one's eyas-marked temporary
    directory, without stage.json: the rerun may replace it; a directory of the user's is still refused."""
    from eyas.common import MARKER
    from eyas.errors import EyasError
    from eyas.pipeline import claim

    export = tmp_path / "export"
    (export / "sglang").mkdir(parents=True)
    (export / "sglang" / "eyas_export.json").write_text("{}")
    (export / ".vllm.x1.tmp").mkdir()
    (export / ".vllm.x1.tmp" / MARKER).write_text("{}")
    claim("export", export)  # no error
    (export / "notes").mkdir()
    with pytest.raises(EyasError, match="was not written by `eyas pipeline`"):
        claim("export", export)


def test_the_eval_fingerprint_follows_the_recorded_answers_not_their_path(tmp_path):
    """[eval] answers: the prompts and answers enter eval's fingerprint, so a copy elsewhere or other acceptance
    counts beside them rerun nothing and another answer reruns eval; left unset, eval's fingerprint is the one
    computed before the option existed (older workdirs still skip)."""
    import dataclasses
    import hashlib

    from eyas.config_checks import inputs_made_later
    from eyas.pipeline import NOT_IN_FINGERPRINT, _jsonable, fingerprint
    from eyas.specdec.run import EvalConfig

    def answers(name: str, *, generated=(3, 4), accepted=(1,)) -> Path:
        row = {"id": "a", "turn": 1, "prompt_ids": [1, 2], "generated_ids": list(generated), "accepted_chain": accepted}
        (tmp_path / name).mkdir()
        (tmp_path / name / "sequences.jsonl").write_text(json.dumps(row) + "\n")
        return tmp_path / name

    def fp(where: Path | None) -> str:
        with inputs_made_later():
            cfg = EvalConfig(drafter=tmp_path / "d", answers=where)
        return fingerprint("eval", cfg, "input", auto={"drafter"})

    first = fp(answers("a"))
    assert fp(answers("copy")) == first and fp(answers("counts", accepted=[2])) == first
    assert fp(answers("other", generated=[3, 5])) != first
    with inputs_made_later():
        cfg = EvalConfig(drafter=tmp_path / "d")
    opts = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_FINGERPRINT["eval"] | {"drafter", "answers"}
    }
    before = {"stage": "eval", "options": _jsonable(opts), "input": "input"}
    assert fp(None) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
