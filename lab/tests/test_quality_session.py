"""lab/scripts/quality_session.sh, the script of a GPU session, run on the CPU with stubs for `python` and
`nvidia-smi`: each call returns while its detached chains run on (a call piping it into `tail` must not
wait for them), and every job gets the arguments the session means to give it, on the intended GPU. Two
bugs of that kind cost most of one session's device time: a backgrounded `cd && ...` list kept the call's
stdout open, and a line break in a string run through `bash -c` cut the recipe's arguments in half."""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lab" / "scripts" / "quality_session.sh"

STUB_PYTHON = r"""#!{python}
import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "cwd": os.getcwd(), "args": args}}) + "\n")
root = pathlib.Path(os.environ["SESSION_ROOT"])
if args[:1] == ["-c"] and "convert_gguf" in args[1]:  # the target, converted from the joined GGUF halves
    (root / "smol.part").mkdir(parents=True, exist_ok=True)
    (root / "smol.part" / "config.json").write_text("{{}}")
elif args[:1] == ["-c"]:  # decompressing the staged chats: the real interpreter
    os.execv(sys.executable, [sys.executable] + args)
elif args and args[0].endswith("scaling_study.py"):  # a recipe point: its prepared data and drafter
    steps = args[args.index("--steps") + 1]
    for n in args[args.index("--conversations") + 1].split(","):
        point = root / "scaling" / f"n{{n}}-s{{steps}}"
        (point / "prepared").mkdir(parents=True, exist_ok=True)
        (point / "prepared" / "meta.json").write_text("{{}}")
        (point / "train" / "drafter").mkdir(parents=True, exist_ok=True)
elif args[:3] == ["-m", "eyas", "pipeline"] and "--until" in args:  # stages up to prepare, in the given workdir
    work = pathlib.Path(args[args.index("--workdir") + 1])
    (work / "prepared").mkdir(parents=True, exist_ok=True)
    (work / "prepared" / "meta.json").write_text("{{}}")
"""


@pytest.fixture(params=[2, 1], ids=["2gpu", "1gpu"])
def session(tmp_path, request):
    """(run(part) -> (seconds, output), the stub's log reader, root, GPUs) for a session under tmp_path."""
    return _session(tmp_path, request.param)


def _session(tmp_path, ngpus, **extra_env):
    if shutil.which("setsid") is None or shutil.which("timeout") is None:
        pytest.skip("needs setsid and timeout (util-linux, coreutils)")
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(STUB_PYTHON.format(python=sys.executable))
    gpus = "".join(f"GPU {i}: H200\\n" for i in range(ngpus))
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
    for stub in bin_.iterdir():
        stub.chmod(0o755)
    stage = tmp_path / "staged"
    (stage / "a2").mkdir(parents=True)
    (stage / "b").mkdir()
    (stage / "a2" / "smol.gguf.aa").write_bytes(b"half one")
    (stage / "b" / "smol.gguf.ab").write_bytes(b"half two")
    (stage / "a2" / "question.jsonl").write_text('{"question_id": 81, "turns": ["hi"]}\n')
    with lzma.open(stage / "a2" / "chats_all.jsonl.xz", "wt") as f:
        f.write('{"conversations": []}\n' * 3)
    root, log = tmp_path / "root", tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "SESSION_ROOT": str(root),
        "STAGE_DIR": str(stage),
        "OUT": str(tmp_path / "out"),
        "STUB_LOG": str(log),
        "POLL_S": "0.2",
        "SETTLE_S": "0",
        "CALL_S": "60",
        "WAIT_S": "60",
        **extra_env,
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def run(part: int) -> tuple[float, str]:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        t0 = time.monotonic()
        # piped into tail, as a device call runs it: the call ends only when every writer of the pipe has
        out = subprocess.run(
            ["bash", "-c", f"bash {SCRIPT} {part} 2>&1 | tail -n 200"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return time.monotonic() - t0, out

    def calls() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return run, calls, root, ngpus


def _one(calls: list[dict], script: str, *must: str) -> dict:
    hits = [c for c in calls if c["args"] and c["args"][0].endswith(script) and all(m in c["args"] for m in must)]
    assert len(hits) == 1, (script, must, [c["args"] for c in calls if c["args"] and c["args"][0].endswith(script)])
    return hits[0]


def test_session_runs_every_job_with_its_arguments(session):
    """Two GPUs: the side chain (8B rate, SmolLM2 rate, side by side) on GPU 1 from call 1, the recipe and
    speculative decoding on GPU 0 from call 2. One GPU: a check of the step's kernels in call 1, one chain for
    the rest."""
    run, calls, root, ngpus = session
    side = str(ngpus - 1)
    took, out = run(1)
    if ngpus > 1:
        assert "chain side started on GPU 1" in out, out
        # the side chain now waits for the target (call 2): the call must not wait for it
        assert took < 30, (took, out)
    took, out = run(2)
    assert "chain main started on GPU 0" in out, out
    took, out = run(3)
    assert "chains still running: 0" in out, out

    c = calls()
    bench = [
        x
        for x in c
        if x["args"][0].endswith("train_bench.py") and "--no-reference" in x["args"] and "--small" not in x["args"]
    ]
    assert len(bench) == 1 and bench[0]["gpu"] == side and "--no-specforge" not in bench[0]["args"]
    rates = [x for x in c if x["args"][0].endswith("train_bench.py") and "smol" in x["args"]]
    runs = [(x["args"][x["args"].index("--cache") + 1], "--cast-once" in x["args"]) for x in rates]
    # one GPU: the state cache's default run only (the device time goes to the recipe and the side by side)
    assert runs == ([("off", False), ("on", False), ("on", True)] if ngpus > 1 else [("on", False)]), runs
    assert all(x["gpu"] == side and "131072" in x["args"] for x in rates)
    recipe = _one(c, "scaling_study.py")
    a = recipe["args"]
    assert recipe["gpu"] == "0" and a[a.index("--conversations") + 1] == "17293" and a[a.index("--gpus") + 1] == "0"
    assert a[a.index("--steps") + 1] == "2400" and a[a.index("--max-minutes") + 1] == "28"
    sets = [a[i + 1] for i, x in enumerate(a) if x == "--set"]
    assert {s.split("=")[0] for s in sets} == {"target", "regenerate.source", "eval.prompts"}, sets
    assert recipe["cwd"] == str(root / "run")  # the chains run from a copy of the repository
    spec = _one(c, "specdec_bench.py")
    assert spec["gpu"] == "0" and spec["args"][spec["args"].index("--drafter") + 1] == str(
        root / "scaling" / "n17293-s2400" / "train" / "drafter"
    )
    a = spec["args"]
    assert a[a.index("--batch-sizes") + 1] == "1,4,16" and a[a.index("--limit") + 1] == "16"  # 16 rows at batch 16
    sbs = _one(c, "specforge_side_by_side.py")
    assert sbs["gpu"] == side and sbs["args"][sbs["args"].index("--prepared") + 1] == str(
        root / "scaling" / "n17293-s2400" / "prepared"
    )
    profiles = [x for x in c if "--profile" in x["args"]]
    assert len(profiles) == 2 and {x["gpu"] for x in profiles} == {side} and "--small" in profiles[1]["args"]
    assert (root / "smol" / "config.json").exists()
    if ngpus == 1:  # call 1 checks the step's kernels; then one job at a time, the open figures first
        check = [
            x
            for x in c
            if x["args"][0].endswith("train_bench.py") and "--small" in x["args"] and "--profile" not in x["args"]
        ]
        assert len(check) == 1 and check[0]["gpu"] is None and "--no-specforge" in check[0]["args"]
        order = [c.index(x) for x in (check[0], recipe, spec, sbs, rates[0], bench[0], profiles[0])]
        assert order == sorted(order), order


@pytest.mark.parametrize("ngpus", [1, 2])
def test_chains_run_the_jobs_named_in_JOBS(tmp_path, ngpus):
    """JOBS picks GPU 0's chain, SIDE_JOBS the last GPU's: here the recipe's stages up to prepare (its workdir and
    settings, no training), then the side by side on that data (two GPUs: on GPU 1, beside the study's smaller
    points on GPU 0); a name that is no job stops the call before its chain starts."""
    side = str(ngpus - 1)
    jobs = (
        {"JOBS": "prepare_only side_by_side"}
        if ngpus == 1
        else {"JOBS": "points", "SIDE_JOBS": "train_8b wait_target prepare_only side_by_side"}
    )
    run, calls, root, _ = _session(tmp_path, ngpus, **jobs)
    run(1)
    took, out = run(2)
    assert "chain main started on GPU 0" in out, out
    assert "chains still running: 0" in run(3)[1]
    c = calls()
    studies = [x for x in c if x["args"][0].endswith("scaling_study.py")]
    if ngpus == 1:
        assert not studies
    else:
        assert len(studies) == 1 and studies[0]["gpu"] == "0", studies
        a = studies[0]["args"]
        assert a[a.index("--conversations") + 1] == "2000,6000" and a[a.index("--steps") + 1] == "2400"
        # the study's 17,293-record point joins them, and its settings (no reachability mask) hold for them
        assert a[a.index("--add-points") + 1] == "lab/scripts/scaling_points.jsonl"
        assert (Path(studies[0]["cwd"]) / "lab" / "scripts" / "scaling_points.jsonl").is_file()
        assert "train.align_topk=0" in [a[i + 1] for i, y in enumerate(a) if y == "--set"]
        assert _one(c, "train_bench.py", "--no-compile")["gpu"] == side
    prep = [x for x in c if x["args"][:3] == ["-m", "eyas", "pipeline"]]
    assert len(prep) == 1 and prep[0]["gpu"] == side, prep
    a = prep[0]["args"]
    work = root / "scaling" / "n17293-s2400"
    assert a[a.index("--workdir") + 1] == str(work) and a[a.index("--until") + 1] == "prepare"
    sets = dict(x.split("=", 1) for x in (a[i + 1] for i, y in enumerate(a) if y == "--set"))
    assert (
        sets["regenerate.limit"] == "17293" and sets["train.steps"] == "2400" and sets["target"] == str(root / "smol")
    )
    sbs = _one(c, "specforge_side_by_side.py")
    assert sbs["gpu"] == side and sbs["args"][sbs["args"].index("--prepared") + 1] == str(work / "prepared")
    assert c.index(prep[0]) < c.index(sbs)

    bad = {"JOBS": "prepare_only side_by_sid"} if ngpus == 1 else {"SIDE_JOBS": "train_8b side_by_sid"}
    run, calls, root, _ = _session(tmp_path / "bad", ngpus, **bad)
    took, out = run(1) if ngpus > 1 else (run(1), run(2))[1]
    var = "JOBS" if ngpus == 1 else "SIDE_JOBS"
    assert f"{var}: no job named side_by_sid" in out and "started" not in out, out


def test_one_gpu_chain_from_call_1_and_a_call_2_that_only_stages(tmp_path):
    """One GPU, SIDE_JOBS set: call 1 starts that chain (the 8B rate needs no target) instead of the kernel check,
    its target-waiting job runs once call 2 (JOBS=none: no second chain on the same GPU) has staged the target."""
    run, calls, root, _ = _session(
        tmp_path,
        1,
        SIDE_JOBS="train_8b wait_target prepare_only side_by_side side_by_side_lr sbs_ablations",
        JOBS="none",
    )
    took, out = run(1)
    assert "chain side started on GPU 0" in out and took < 30, (took, out)
    took, out = run(2)
    assert "JOBS=none: no chain started" in out and "chain main" not in out, out
    assert "chains still running: 0" in run(3)[1]
    c = calls()
    assert not [x for x in c if "--small" in x["args"]]  # no kernel check
    bench, prep = _one(c, "train_bench.py", "--no-compile"), _one(c, "-m", "pipeline")
    ablations = _one(c, "specforge_side_by_side.py", "--eyas-variant")
    variants = [a for i, a in enumerate(ablations["args"]) if ablations["args"][i - 1] == "--eyas-variant"]
    assert variants == ["inithead:init_head=true", "lr3e-4:lr=3e-4", "decay1:ttt_decay=1.0"]
    assert ablations["args"][ablations["args"].index("--root") + 1] == str(root / "sbs")  # the first one's, resumed
    c.remove(ablations)
    sbs = _one(c, "specforge_side_by_side.py", "--root", str(root / "sbs"))
    again = _one(c, "specforge_side_by_side.py", "--lr", "3e-4")  # the second one: lr 3e-4 for both trainers
    assert again["args"][again["args"].index("--root") + 1] == str(root / "sbs-lr3e-4")
    assert {bench["gpu"], prep["gpu"], sbs["gpu"], again["gpu"]} == {"0"}
    assert c.index(bench) < c.index(prep) < c.index(sbs) < c.index(again)


def test_smol_next_and_sbs_variants_from_the_environment(tmp_path):
    """smol_next runs the SmolLM2 rate with and without SMOL_FLAGS's module settings, the target on every batch
    and the state cache; SBS_VARIANTS replaces sbs_ablations' default variants."""
    flags = ["ttt.GROUPED_DIAGONALS", "packing.COMPILED_LAYERS=0"]
    run, calls, root, _ = _session(
        tmp_path,
        1,
        SIDE_JOBS="wait_target prepare_only smol_next sbs_ablations",
        JOBS="none",
        SBS_VARIANTS="a:lr=1e-3 b:init_head=true,lr=3e-4",
        SMOL_FLAGS=" ".join(flags),
    )
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    c = calls()
    rates = [x["args"] for x in c if x["args"][0].endswith("train_bench.py") and "smol" in x["args"]]
    runs = [(a[a.index("--cache") + 1], [a[i + 1] for i, y in enumerate(a) if y == "--flag"]) for a in rates]
    assert runs == [("off", []), ("on", []), ("off", flags), ("on", flags)], runs
    ablations = _one(c, "specforge_side_by_side.py", "--eyas-variant")["args"]
    assert [a for i, a in enumerate(ablations) if ablations[i - 1] == "--eyas-variant"] == [
        "a:lr=1e-3",
        "b:init_head=true,lr=3e-4",
    ]
    assert ablations[ablations.index("--lr") + 1] == "1e-4" and ablations[ablations.index("--root") + 1] == str(
        root / "sbs"
    )


def test_sbs_ablations_at_lr_3e_4_for_both_trainers(tmp_path):
    """sbs_ablations_lr: both trainers at lr 3e-4 in side_by_side_lr's root, its default variants."""
    run, calls, root, _ = _session(tmp_path, 1, SIDE_JOBS="wait_target prepare_only sbs_ablations_lr", JOBS="none")
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    a = _one(calls(), "specforge_side_by_side.py", "--eyas-variant")["args"]
    assert a[a.index("--lr") + 1] == "3e-4" and a[a.index("--root") + 1] == str(root / "sbs-lr3e-4")
    assert [x for i, x in enumerate(a) if a[i - 1] == "--eyas-variant"] == [
        "noalign:align_topk=0",
        "a4:align_topk=4",
        "a4prune:align_topk=4,ttt.PRUNE_UNREACHED=true",
    ]


def test_sbs_at_lr_runs_both_trainers_at_its_lr_with_its_own_variants(tmp_path):
    """sbs_at_lr: both trainers at SBS_LR (default 1e-3) in a root named by it, with SBS_LR_VARIANTS (default lr 2e-3
    for eyas, and Muon), not SBS_VARIANTS, which a job before it in the same chain reads."""
    run, calls, root, _ = _session(
        tmp_path,
        1,
        SIDE_JOBS="wait_target prepare_only sbs_ablations_lr sbs_at_lr",
        JOBS="none",
        SBS_VARIANTS="f1:feature_loss=1.0",
    )
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    sides = [x["args"] for x in calls() if x["args"][0].endswith("specforge_side_by_side.py")]
    got = [
        (a[a.index("--lr") + 1], a[a.index("--root") + 1], [x for i, x in enumerate(a) if a[i - 1] == "--eyas-variant"])
        for a in sides
    ]
    assert got == [
        ("3e-4", str(root / "sbs-lr3e-4"), ["f1:feature_loss=1.0"]),
        ("1e-3", str(root / "sbs-lr1e-3"), ["lr2e-3:lr=2e-3", "muon:optimizer=muon"]),
    ], got
    run, calls, root, _ = _session(
        tmp_path / "again",
        1,
        SIDE_JOBS="wait_target prepare_only sbs_at_lr",
        JOBS="none",
        SBS_LR="2e-3",
        SBS_LR_VARIANTS="a:lr=3e-3 b:lr=1e-3",
    )
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    a = _one(calls(), "specforge_side_by_side.py", "--eyas-variant")["args"]
    assert a[a.index("--lr") + 1] == "2e-3" and a[a.index("--root") + 1] == str(root / "sbs-lr2e-3")
    assert [x for i, x in enumerate(a) if a[i - 1] == "--eyas-variant"] == ["a:lr=3e-3", "b:lr=1e-3"]


def test_smol_runs_with_one_setting_each(tmp_path):
    """SMOL_RUNS "flag:MODULE.NAME" and "opt:NAME": the run with the target on every batch and that one setting (or
    optimizer), one run per setting after the default's, each in its own log; a run named again (a second pair in the
    same chain) writes a log of its own instead of replacing the first one's."""
    run, calls, root, _ = _session(
        tmp_path,
        1,
        SIDE_JOBS="wait_target smol_next",
        JOBS="none",
        SMOL_RUNS="off flag:ttt.FUSED_TOP_RANK=0 flag:ttt.SPLIT_TEACHER_HEAD=0 opt:adamw flag:ttt.FUSED_TOP_RANK=0 off",
    )
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    rates = [x["args"] for x in calls() if x["args"][0].endswith("train_bench.py") and "smol" in x["args"]]
    runs = [
        (a[a.index("--cache") + 1], [a[i + 1] for i, y in enumerate(a) if y in ("--flag", "--optimizer")])
        for a in rates
    ]
    assert runs == [
        ("off", []),
        ("off", ["ttt.FUSED_TOP_RANK=0"]),
        ("off", ["ttt.SPLIT_TEACHER_HEAD=0"]),
        ("off", ["adamw"]),
        ("off", ["ttt.FUSED_TOP_RANK=0"]),
        ("off", []),
    ], runs
    logs = sorted(p.name for p in (root / "q").glob("train_smol_*.log"))
    assert logs == [
        "train_smol_cache_off.2.log",
        "train_smol_cache_off.log",
        "train_smol_opt_adamw.log",
        "train_smol_ttt.FUSED_TOP_RANK=0.2.log",
        "train_smol_ttt.FUSED_TOP_RANK=0.log",
        "train_smol_ttt.SPLIT_TEACHER_HEAD=0.log",
    ], logs


def test_profile_smol_online_profiles_past_the_skipped_steps(tmp_path):
    """profile_smol_online: the SmolLM2 run with the target on every batch, profiled, with enough steps for the
    profiler's schedule (--skip, one warm step, two recorded: the last --steps wins in argparse)."""
    run, calls, root, _ = _session(tmp_path, 1, SIDE_JOBS="wait_target profile_smol_online", JOBS="none")
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    a = _one(calls(), "train_bench.py", "--profile")["args"]
    steps = [int(a[i + 1]) for i, x in enumerate(a) if x == "--steps"][-1]
    skip = int(a[a.index("--skip") + 1])
    assert a[a.index("--profile") + 1] == "40" and a[a.index("--cache") + 1] == "off" and steps >= skip + 3


def test_smol_rate_on_the_regenerated_chats_made_before_it(tmp_path):
    """SMOL_RUNS="off regen-off": the target-on-every-batch run on the 500 staged chats, then the same on the recipe's
    regenerated chats that prepare_only made before it; without them the run is skipped with a line saying why (a
    wait would hang the chain: its jobs run one after another)."""
    run, calls, root, _ = _session(
        tmp_path / "none", 1, SIDE_JOBS="wait_target smol_next", JOBS="none", SMOL_RUNS="regen-off"
    )
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    assert not [x for x in calls() if x["args"][0].endswith("train_bench.py")]
    assert "prepare_only" in (root / "q" / "train_smol_regen_cache_off.log").read_text()
    run, calls, root, _ = _session(
        tmp_path, 1, SIDE_JOBS="wait_target prepare_only smol_next", JOBS="none", SMOL_RUNS="off regen-off"
    )
    run(1)
    run(2)
    out = run(3)[1]
    assert "chains still running: 0" in out, out
    c = calls()
    rates = [x["args"] for x in c if x["args"][0].endswith("train_bench.py")]
    assert [a[a.index("--data") + 1] for a in rates] == [
        str(root / "prep500"),
        str(root / "scaling" / "n17293-s2400" / "prepared"),
    ]
    assert all(a.count("--data") == 1 and a[a.index("--cache") + 1] == "off" for a in rates)


def test_gpu_tests_run_the_gpu_only_tests_from_the_copy(tmp_path):
    """gpu_tests runs pytest on the tests marked gpu from the chain's copy of the repository, which holds the tests;
    every test that skips without CUDA carries the marker, so the marker selects them all."""
    run, calls, root, _ = _session(tmp_path, 1, SIDE_JOBS="gpu_tests", JOBS="none")
    run(1)
    run(2)
    assert "chains still running: 0" in run(3)[1]
    hits = [c for c in calls() if c["args"][:2] == ["-m", "pytest"]]
    assert len(hits) == 1, calls()
    (a,) = hits
    assert a["args"][a["args"].index("-m", 2) + 1] == "gpu" and a["args"][-1] == "tests"
    assert (Path(a["cwd"]) / "tests" / "test_train_packed.py").is_file() and a["gpu"] == "0"
    unmarked = [
        (f.name, name)
        for f in sorted((REPO / "tests").glob("test_*.py"))
        for name in re.findall(
            r"(?<!@pytest\.mark\.gpu\n)@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\)[^\n]*\n(?:@[^\n]*\n)*def (\w+)",
            f.read_text(),
        )
    ]
    assert not unmarked, unmarked
