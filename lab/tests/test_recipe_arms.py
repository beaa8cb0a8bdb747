"""lab/scripts/recipe_arms.py: the arms' command lines, the seeding of each run's workdir, the table, and one
detached session on the CPU smoke recipe (start -> wait --collect) with the default and eagle31 arms."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

from lab.tests.conftest import REPO, load_script

ra = load_script("recipe_arms")
SMOKE = REPO / "recipes" / "smollm2-cpu-smoke.toml"


def test_runs_are_seed_major_and_each_arm_changes_only_training():
    assert ra.plan(["default", "eagle31"], [1, 2]) == [("default", 1), ("eagle31", 1), ("default", 2), ("eagle31", 2)]
    assert ra.arm_sets("default") == [] and ra.arm_sets("eagle31") == []
    assert ra.arm_sets("muon") == ['train.optimizer="muon"', "train.lr=2e-3"]
    assert ra.arm_sets("steps", more_steps=3000) == ["train.steps=3000"]
    with pytest.raises(SystemExit, match="arm 'fast'"):
        ra.arm_sets("fast")
    eyas = ra.pipeline_command((), SMOKE, Path("w"), ["train.seed=2"], until="prepare")
    assert eyas == [
        sys.executable,
        "-m",
        "eyas",
        "pipeline",
        str(SMOKE),
        "--workdir",
        "w",
        "--until",
        "prepare",
        "--set",
        "train.seed=2",
    ]
    variant = ra.pipeline_command(("eagle31",), SMOKE, Path("w"), [])
    assert variant[:3] == [sys.executable, str(REPO / "lab" / "variants" / "eagle31.py"), "pipeline"]
    a = ra.main.__globals__["argparse"].Namespace(target="/t", source="", prompts="/p.jsonl", set=["train.steps=5"])
    assert ra.common_sets(a) == ['target="/t"', 'eval.prompts="/p.jsonl"', "train.steps=5"]


def test_the_variant_arms_run_their_variants_and_the_old_arms_are_unchanged():
    """lk runs lk.py, muon31 eagle31.py with muon's values, lk31 run.py with eagle31 then lk; the arms that were there
    before keep their command lines (their variants, their --set values)."""
    variants = REPO / "lab" / "variants"
    cmds = {arm: ra.pipeline_command(names, SMOKE, Path("w"), ra.arm_sets(arm)) for arm, (names, _) in ra.ARMS.items()}
    tail = ["pipeline", str(SMOKE), "--workdir", "w"]
    muon = ["--set", 'train.optimizer="muon"', "--set", "train.lr=2e-3"]
    assert cmds == {
        "default": [sys.executable, "-m", "eyas", *tail],
        "muon": [sys.executable, "-m", "eyas", *tail, *muon],
        "eagle31": [sys.executable, str(variants / "eagle31.py"), *tail],
        "steps": [sys.executable, "-m", "eyas", *tail, "--set", f"train.steps={ra.MORE_STEPS}"],
        "lk": [sys.executable, str(variants / "lk.py"), *tail],
        "muon31": [sys.executable, str(variants / "eagle31.py"), *tail, *muon],
        "lk31": [
            sys.executable,
            str(variants / "run.py"),
            *("--variant", "eagle31", "--variant", "lk", "--"),
            *tail,
        ],
        "sampled": [sys.executable, "-m", "eyas", *tail],  # the default arm's command, on its own base
    }
    # the lk31 command's variants are what run.py reads back
    from lab.variants import eagle31, lk, run

    got, rest = run.parse_args(cmds["lk31"][2:])
    assert got == [eagle31.Variant(), lk.Variant()] and rest == tail
    assert ra._arms("lk,muon31,lk31") == ["lk", "muon31", "lk31"]


def test_runs_spread_over_gpus_one_per_gpu_at_a_time(tmp_path, monkeypatch):
    """--gpus 2: every run gets a GPU of its own while it runs (CUDA_VISIBLE_DEVICES in its environment), two at once;
    --gpus 1,3: only those, the base on the first; --gpus 1 leaves the environment's device alone."""
    import threading
    import time

    assert ra.parse_gpus("1") is None and ra.parse_gpus("3") == [0, 1, 2] and ra.parse_gpus("1,") == [1]
    assert ra.parse_gpus("1,3") == [1, 3]
    for bad in ("0", "x", "1,1", "-1,"):
        with pytest.raises(ra.argparse.ArgumentTypeError):
            ra.parse_gpus(bad)
    q = ra.gpu_slots([0, 1], 2)
    assert [q.get() for _ in range(4)] == [0, 1, 0, 1]
    q = ra.gpu_slots(None, 2)
    assert [q.get() for _ in range(2)] == [None, None]
    assert ra.env(3)["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in ra.env(None)

    lock, busy, seen, base_gpu = threading.Lock(), set(), [], []

    def fake_run(a, arm, seed, base, w, *, gpu=None, trained=None):
        with lock:
            assert gpu not in busy, f"GPU {gpu} given to two runs at once"
            busy.add(gpu)
            seen.append(gpu)
        time.sleep(0.05)
        with lock:
            busy.discard(gpu)
        return {"rc": 0}

    monkeypatch.setattr(ra, "one_run", fake_run)
    monkeypatch.setattr(ra, "run_logged", lambda cmd, log, gpu=None: base_gpu.append(gpu) or 0)  # the base
    monkeypatch.setattr(ra, "gather", lambda w: [])
    a = ra.main.__globals__["argparse"].Namespace(
        root=str(tmp_path),
        recipe=str(SMOKE),
        arms=["default", "lk"],
        seeds=[1, 2, 3],
        gpus=[1, 3],
        parallel=1,
        target="",
        source="",
        prompts="",
        set=[],
    )
    assert ra.drive(a) == 0
    assert base_gpu == [1] and len(seen) == 6 and sorted(set(seen)) == [1, 3]
    with pytest.raises(SystemExit):
        ra.main(["start", "--arms", "default", "--gpus", "0", "--root", str(tmp_path)])


def test_overlap_trains_the_next_run_while_this_one_evaluates(tmp_path, monkeypatch):
    """--overlap on one GPU: a run's slot goes back once it has trained, so the next run trains while it evaluates;
    two runs never train at once, and the runs take the slot in plan order."""
    import threading
    import time

    lock, training, events = threading.Lock(), [], []

    def fake_run(a, arm, seed, base, w, *, gpu=None, trained=lambda: None):
        name = f"{arm}-s{seed}"
        with lock:
            assert not training, f"{name} trains beside {training}"
            training.append(name)
            events.append(("train", name))
        time.sleep(0.05)
        with lock:
            training.clear()
        trained()
        with lock:
            events.append(("eval", name))
        time.sleep(0.2)  # the evaluation, longer than a training here
        with lock:
            events.append(("done", name))
        return {"rc": 0}

    monkeypatch.setattr(ra, "one_run", fake_run)
    monkeypatch.setattr(ra, "run_logged", lambda cmd, log, gpu=None: 0)
    monkeypatch.setattr(ra, "gather", lambda w: [])
    a = ra.argparse.Namespace(
        root=str(tmp_path), recipe=str(SMOKE), arms=["default", "eagle31"], seeds=[1, 2], gpus=None, parallel=1
    )
    a.__dict__.update(target="", source="", prompts="", set=[], overlap=True)
    assert ra.drive(a) == 0
    names = ["default-s1", "eagle31-s1", "default-s2", "eagle31-s2"]
    assert [n for e, n in events if e == "train"] == names
    for this, after in zip(names, names[1:]):  # each evaluation but the last beside the next run's training
        assert events.index(("eval", this)) < events.index(("train", after)) < events.index(("done", this))


def test_an_overlapped_run_trains_first_then_evaluates_and_reports_both_parts(tmp_path, monkeypatch):
    """one_run --overlap: `--until train`, then the slot given back, then the whole pipeline (which skips the
    training) appending to the same log; gather reads the training from the first part's pipeline-train.json."""
    calls = []

    def fake_logged(cmd, log_file, *, gpu=None, append=False):
        run = Path(cmd[cmd.index("--workdir") + 1])
        first = "--until" in cmd
        calls.append(("until train" if first else "rest", append, len(events)))
        train = {"status": "ran", "seconds": 600.0, "steps": 2400, "tokens_per_s": 250000.0}
        stages = {"regenerate": {"status": "skipped"}, "prepare": {"status": "skipped"}}
        if first:
            stages["train"] = train
        else:
            stages.update(
                train={**train, "status": "skipped", "seconds": 0.0},
                eval={"status": "ran", "seconds": 80.0},
                export={"status": "ran"},
            )
        doc = {"tau_chain": 2.5 if not first else None, "tau_tree": 3.5 if not first else None, "stages": stages}
        (run / "pipeline.json").write_text(json.dumps(doc))
        log_file.write_text(log_file.read_text() + cmd[-1] if append and log_file.exists() else cmd[-1])
        return 0

    events = []
    monkeypatch.setattr(ra, "run_logged", fake_logged)
    w, base = tmp_path / "arms", tmp_path / "arms" / "base"
    for stage in ra.SHARED_STAGES:
        (base / stage).mkdir(parents=True)
        (base / stage / "stage.json").write_text("{}")
    a = ra.argparse.Namespace(target="", source="", prompts="", set=[], more_steps=10, recipe=str(SMOKE), overlap=True)
    rec = ra.one_run(a, "default", 3, base, w, trained=lambda: events.append("trained"))
    assert rec["rc"] == 0 and events == ["trained"]
    assert calls == [("until train", False, 0), ("rest", True, 1)]  # the slot went back between the two
    run = w / "default-s3"
    assert (run / ra.TRAIN_PART).is_file()
    (row,) = ra.gather(w)
    assert row["train_s"] == 600.0 and row["eval_s"] == 80.0 and row["tau_chain"] == 2.5
    assert sorted(row["skipped"]) == ["prepare", "regenerate"]


def test_the_base_regeneration_and_caches_go_to_a_later_session_in_parts(tmp_path, monkeypatch):
    """wait --with-base packs base/regenerate (not its run/), the session's answers and the compile caches into parts
    small enough to come back from a device call; start --base-archive puts each back once, and refuses an archive
    holding anything else."""
    import os

    root = tmp_path / "root"
    base = root / "arms" / "base"
    (base / "regenerate" / "run").mkdir(parents=True)
    (base / "regenerate" / "stage.json").write_text('{"status": "complete"}')
    chats = os.urandom(3000).hex()  # incompressible: several parts
    (base / "regenerate" / "chats.jsonl").write_text(chats)
    (base / "regenerate" / "run" / "done.jsonl").write_text("the whole regeneration")
    (root / "arms" / "answers").mkdir(parents=True)
    for name in ("report.json", "sequences.jsonl"):
        (root / "arms" / "answers" / name).write_text(name)
    (root / "cache" / "triton" / "k1").mkdir(parents=True)
    (root / "cache" / "triton" / "k1" / "kernel.cubin").write_bytes(b"\x7fELF")
    monkeypatch.setattr(ra, "PART_BYTES", 2048)
    out = tmp_path / "out"
    parts = [x for name in ra.CARRIED for x in ra.pack(root, name, out)]
    assert len(parts) >= 3 and all(p.stat().st_size <= 2048 for p in parts)
    assert sorted(x.name for x in out.iterdir()) == sorted(p.name for p in parts)
    assert {p.name.rsplit(".", 1)[0] for p in parts} == set(ra.CARRIED)

    later = tmp_path / "later"
    assert all(ra.unpack(out, later, name) for name in ra.CARRIED)
    got = later / "arms" / "base" / "regenerate"
    assert (got / "chats.jsonl").read_text() == chats and (got / "stage.json").is_file()
    assert not (got / "run").exists()
    assert (later / "cache" / "triton" / "k1" / "kernel.cubin").read_bytes() == b"\x7fELF"
    assert (later / "arms" / "answers" / "sequences.jsonl").read_text() == "sequences.jsonl"
    assert not any(ra.unpack(out, later, name) for name in ra.CARRIED)  # there already: left alone
    assert not list(later.rglob(".*.tar.xz"))
    env = ra.cache_env(later)
    assert env["TRITON_CACHE_DIR"] in (str(later / "cache" / "triton"), os.environ.get("TRITON_CACHE_DIR"))

    bad = tmp_path / "bad"
    bad.mkdir()
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "meta.json").write_text("{}")
    name = "base-regenerate.tar.xz"
    with tarfile.open(bad / name, "w:xz") as tar:
        tar.add(tmp_path / "prepared", arcname="prepared")
    (bad / name).rename(bad / f"{name}.00")
    with pytest.raises(SystemExit, match="holds more than regenerate/"):
        ra.unpack(bad, tmp_path / "other", name)
    assert not ra.unpack(tmp_path / "prepared", tmp_path / "third", name)  # no parts: nothing put back
    assert ra.pack(tmp_path / "nothing", name, out) == []
    monkeypatch.setattr(ra, "OUT_BYTES", 4096)  # more than a call brings back: left out, nothing half-written
    before = sorted(x.name for x in out.iterdir())
    assert ra.pack(root, name, out) == [] and sorted(x.name for x in out.iterdir()) == before


def test_arm_sets_that_touch_shared_stages_are_refused(monkeypatch):
    monkeypatch.setitem(ra.ARMS, "odd", ((), ["prepare.max_length=64"]))
    with pytest.raises(SystemExit, match="shared regeneration or prepare"):
        ra.arm_sets("odd")


def test_seed_workdir_copies_the_stage_folders_once_without_the_regeneration(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    with pytest.raises(SystemExit, match="no stage.json"):
        ra.seed_workdir(base, run)
    for stage in ("regenerate", "prepared"):
        (base / stage).mkdir(parents=True)
        (base / stage / "stage.json").write_text("{}")
    (base / "regenerate" / "chats.jsonl").write_text("x")
    (base / "regenerate" / "run").mkdir()
    (base / "regenerate" / "run" / "chats.jsonl").write_text("everything")
    (base / "prepared" / "train.bin").write_text("t")
    ra.seed_workdir(base, run)
    assert (run / "regenerate" / "chats.jsonl").read_text() == "x" and not (run / "regenerate" / "run").exists()
    assert (run / "prepared" / "train.bin").read_text() == "t"
    (run / "prepared" / "train.bin").write_text("mine")
    ra.seed_workdir(base, run)  # already seeded: left as it is
    assert (run / "prepared" / "train.bin").read_text() == "mine"


def _fake_run(w: Path, arm: str, seed: int, *, rc=0, chain=None, tree=None, variant=True):
    run = w / ra.run_name(arm, seed)
    run.mkdir(parents=True)
    (run / "arm.json").write_text(json.dumps({"name": run.name, "arm": arm, "seed": seed, "rc": rc, "seconds": 9.0}))
    if chain is not None:
        stages = {
            "regenerate": {"status": "skipped"},
            "prepare": {"status": "skipped"},
            "train": {
                "status": "ran",
                "seconds": 600.0,
                "steps": 2400,
                "tokens_per_s": 250000.0,
                "heldout_tau_simulated": 2.4,
            },
            "eval": {"status": "ran", "seconds": 60.0},
            "export": {"status": "ran"},
        }
        (run / "pipeline.json").write_text(json.dumps({"tau_chain": chain, "tau_tree": tree, "stages": stages}))
        names = ra.ARMS[arm][0]
        if names:
            (run / "train" / "drafter").mkdir(parents=True)
            (run / "export" / "sglang").mkdir(parents=True)
            drafter = {"lab_variant": {"name": "eagle31"}} if "eagle31" in names else {}
            if "lk" in names:
                drafter["lab_loss"] = {"name": "lk" if variant else "other"}
            (run / "train" / "drafter" / "config.json").write_text(json.dumps(drafter))
            fc_norm = variant if "eagle31" in names else None
            (run / "export" / "sglang" / "config.json").write_text(
                json.dumps({"fc_norm": fc_norm, "norm_output": True})
            )
    elif rc is None:
        (run / "train").mkdir()
        (run / "train" / "metrics.jsonl").write_text(json.dumps({"step": 120, "loss": 3.0}) + "\n")


def test_table_reports_each_run_and_each_arms_mean_and_spread(tmp_path):
    w = tmp_path / "arms"
    _fake_run(w, "default", 1, chain=2.5, tree=3.5)
    _fake_run(w, "default", 2, chain=2.7, tree=3.7)
    _fake_run(w, "eagle31", 1, chain=2.8, tree=3.9)
    _fake_run(w, "eagle31", 2, chain=2.6, tree=3.5, variant=False)
    _fake_run(w, "muon", 1, rc=None)
    _fake_run(w, "steps", 1, rc=2)
    runs = ra.gather(w)
    by = {r["name"]: r for r in runs}
    assert by["eagle31-s1"]["variant"] == "ok" and by["eagle31-s2"]["variant"] == "MISSING"
    assert by["muon-s1"]["progress"] == "train step 120" and by["steps-s1"]["progress"] == "failed"
    stats = ra.arm_stats(runs)
    assert stats["default"]["n"] == 2 and stats["default"]["tau_chain"]["mean"] == pytest.approx(2.6)
    assert stats["default"]["tau_chain"]["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert stats["eagle31"]["tau_tree"]["mean"] == pytest.approx(3.7)
    assert stats["muon"]["n"] == 0 and stats["muon"]["tau_chain"]["mean"] is None
    text = ra.format_table(runs)
    assert "+0.1000 / +0.1000" in text and "variant MISSING" in text and "train step 120" in text
    for arm, seed, ok in (("lk", 1, True), ("lk", 2, False), ("lk31", 1, True), ("muon31", 1, True)):
        _fake_run(w, arm, seed, chain=2.5, tree=3.5, variant=ok)
    by = {r["name"]: r for r in ra.gather(w)}
    assert [by[n]["variant"] for n in ("lk-s1", "lk-s2", "lk31-s1", "muon31-s1")] == ["ok", "MISSING", "ok", "ok"]
    assert "variant" not in by["default-s1"]
    # lk31 without eagle31's export flags, or without lk's marker, is missing a variant
    lk31 = w / "lk31-s1"
    assert ra.variant_check(lk31, ("eagle31", "lk")) == "ok"
    assert ra.variant_check(lk31, ("lk",)) == "ok"
    (lk31 / "export" / "sglang" / "config.json").write_text(json.dumps({"fc_norm": False, "norm_output": True}))
    assert ra.variant_check(lk31, ("eagle31", "lk")) == "MISSING" and ra.variant_check(lk31, ("lk",)) == "ok"
    (lk31 / "train" / "drafter" / "config.json").write_text(json.dumps({"lab_variant": {"name": "eagle31"}}))
    assert ra.variant_check(lk31, ("lk",)) == "MISSING"

    docs = []
    for i, names in enumerate((["default-s1", "eagle31-s1"], ["default-s2", "eagle31-s2"])):
        f = tmp_path / f"arms{i}.json"
        f.write_text(json.dumps({"runs": [by[n] for n in names]}))
        docs.append(str(f))
    merged = ra.arm_stats([r for d in docs for r in json.loads(Path(d).read_text())["runs"]])
    assert merged["eagle31"]["tau_chain"]["mean"] == pytest.approx(2.7)


def test_a_detached_session_runs_both_arms_on_one_preparation(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """start (detached) -> wait --collect: the base pipeline regenerates and prepares once; the default and eagle31
    runs skip both, train, evaluate and export; the collected table and files are in $OUT."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    common = [
        "--root",
        str(tmp_path / "root"),
        "--recipe",
        str(SMOKE),
        "--target",
        str(tiny_target_dir),
        "--source",
        "",
        "--prompts",
        "",
        "--set",
        "regenerate.limit=6",
        "--set",
        "regenerate.max_new_tokens=12",
        "--set",
        "train.steps=2",
        "--set",
        "train.draft_vocab=256",
    ]
    ra.main(["start", "--arms", "default,eagle31", "--seeds", "4", *common])
    with pytest.raises(SystemExit, match="a driver is running"):
        ra.main(["start", "--arms", "default", *common])
    ra.main(["wait", "--root", str(tmp_path / "root"), "--timeout", "500", "--collect"])
    copy = tmp_path / "root" / "q" / "repo"  # the driver and its pipelines ran from a copy of the tree
    assert (copy / "src" / "eyas" / "pipeline.py").is_file() and (copy / "lab" / "variants" / "eagle31.py").is_file()
    assert (
        f"{copy}/lab/variants/eagle31.py pipeline {copy}/recipes/" in (tmp_path / "root" / "q" / "arms.log").read_text()
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["done"] and last["rc"] == "0" and last["finished"] == 2, last
    doc = json.loads((tmp_path / "out" / "arms.json").read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {"default-s4", "eagle31-s4"}
    for r in runs.values():
        assert (
            r["rc"] == 0
            and r["tau_chain"] >= 1.0
            and r["steps"] == 2
            and sorted(r["skipped"]) == ["prepare", "regenerate"]
        )
    assert runs["eagle31-s4"]["variant"] == "ok" and "variant" not in runs["default-s4"]
    made = runs["default-s4"]["answers"]  # the first run generated the session's answers, the second replayed them
    assert made.endswith(" own") and runs["eagle31-s4"]["answers"] == made.split()[0]
    assert "eagle31-s4" in (tmp_path / "out" / "arms.txt").read_text()
    with tarfile.open(tmp_path / "out" / "arms.tgz") as tar:
        names = tar.getnames()
    assert "eagle31-s4.log" in names and "eagle31-s4/pipeline.json" in names
    assert not [n for n in names if n.endswith(".safetensors")]
    ra.main(["stop", "--root", str(tmp_path / "root")])  # the driver has ended: nothing to stop

    # a later session: the base's regeneration carried over (wait --with-base -> start --base-archive) is skipped
    carried = tmp_path / "carried"
    monkeypatch.setenv("OUT", str(carried))
    ra.main(["wait", "--root", str(tmp_path / "root"), "--timeout", "1", "--with-base"])
    assert (carried / "base-regenerate.tar.xz.00").is_file() and (carried / "eval-answers.tar.xz.00").is_file()
    common[1] = str(tmp_path / "later")
    ra.main(["start", "--arms", "default", "--seeds", "5", "--base-archive", str(carried), *common])
    ra.main(["wait", "--root", str(tmp_path / "later"), "--timeout", "500"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["done"] and last["rc"] == "0" and last["finished"] == 1, last
    base = json.loads((tmp_path / "later" / "arms" / "base" / "pipeline.json").read_text())["stages"]
    assert base["regenerate"]["status"] == "skipped" and base["prepare"]["status"] == "ran"
    (later,) = ra.gather(tmp_path / "later" / "arms")
    assert later["answers"] == made.split()[0]  # the carried answers: no run of that session generated its own


def test_later_runs_wait_for_the_first_runs_answers_and_replay_on_them(tmp_path):
    """--answers: the first planned run's eval makes the session's answers and starts at once; another run's eval
    waits until the first run has ended, then replays on them; where the first run failed it generates its own."""
    import threading

    w = tmp_path / "arms"
    run = w / "default-s1"
    (run / "eval").mkdir(parents=True)
    a = ra.argparse.Namespace(answers=True, answers_made=threading.Event(), answers_maker="default-s1")
    assert ra.shared_answers(a, w, "default-s1") == []  # the maker does not wait
    got = []
    other = threading.Thread(target=lambda: got.append(ra.shared_answers(a, w, "eagle31-s1")))
    other.start()
    other.join(0.3)
    assert other.is_alive() and not got  # waiting for the maker
    for name in ("report.json", "sequences.jsonl"):
        (run / "eval" / name).write_text(name)
    ra.keep_answers(a, w, run)
    a.answers_made.set()
    other.join(5)
    assert got == [[f'eval.answers="{w / "answers"}"']]
    assert (w / "answers" / "sequences.jsonl").read_text() == "sequences.jsonl"

    failed = ra.argparse.Namespace(answers=True, answers_made=threading.Event(), answers_maker="default-s1")
    failed.answers_made.set()
    assert ra.shared_answers(failed, tmp_path / "empty", "eagle31-s1") == []  # the maker ended without answers
    off = ra.argparse.Namespace(answers=False)
    assert ra.shared_answers(off, w, "eagle31-s1") == []
