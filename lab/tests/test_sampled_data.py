"""lab/scripts/sampled_data.py and recipe_arms.py's sampled arm: the merge keeps every greedy chat and adds the
sampled copies of training prompts under unique, deterministic ids; one detached session on the CPU smoke recipe
(default and sampled) where the sampled runs skip their base's stages and train on the merged data."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from lab.tests.conftest import REPO, load_script

sd = load_script("sampled_data")
ra = load_script("recipe_arms")
SMOKE = REPO / "recipes" / "smollm2-cpu-smoke.toml"
OPTIONS = {"source": "sharegpt", "target": "t", "limit": 40, "max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0}


def _stage(d: Path, ids: list[str], *, tag: str, **options) -> Path:
    """A regenerate stage folder as the pipeline writes it: stage.json and the selected chats."""
    from eyas.pipeline import write_record

    opts = {**OPTIONS, "seed": 0, "out": str(d / "run"), "concurrency": 64, **options}
    write_record(d, stage="regenerate", status="complete", fingerprint="fp-greedy", options=opts, summary={})
    chats = [
        {"id": i, "messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"{tag} {i}"}]}
        for i in ids
    ]
    (d / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return d


@pytest.fixture
def folders(tmp_path):
    ids = [f"sharegpt:{n}" for n in range(40)]
    greedy = _stage(tmp_path / "greedy", ids, tag="greedy")
    s1 = _stage(tmp_path / "s1", ids[:-1], tag="t0.7s1", temperature=0.7, top_p=0.95, seed=1, concurrency=8)
    s2 = _stage(tmp_path / "s2", ids, tag="t0.7s2", temperature=0.7, top_p=0.95, seed=2)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "stage.json").write_text(json.dumps({"options": {"eval_fraction": 0.25, "seed": 3}}))
    return greedy, s1, s2, prepared


def test_merge_keeps_the_greedy_chats_and_adds_copies_of_training_prompts(tmp_path, folders):
    from eyas.data.prepare import is_eval

    greedy, s1, s2, prepared = folders
    out = tmp_path / "merged" / "regenerate"
    summary = sd.merge(greedy, [s1, s2], out, split_from=prepared)
    blob = (out / "chats.jsonl").read_bytes()
    g = (greedy / "chats.jsonl").read_bytes()
    assert blob.startswith(g)  # every greedy chat, byte for byte, first
    copies = [json.loads(line) for line in blob[len(g) :].decode().splitlines()]
    ids = [json.loads(line)["id"] for line in blob.decode().splitlines()]
    assert len(ids) == len(set(ids)) == summary["chats"] == 40 + len(copies)

    held = {f"sharegpt:{n}" for n in range(40) if is_eval(f"sharegpt:{n}", 0.25, 3)}
    assert 0 < len(held) < 40  # the split seed 3 holds some prompts out: the rule below is exercised
    for c in copies:
        prompt, _, suffix = c["id"].partition("~s")
        assert prompt not in held and not is_eval(c["id"], 0.25, 3)  # a copy stays on its prompt's (train) side
        assert c["messages"][1]["content"] == f"t0.7s{suffix.split('.')[0]} {prompt}"
    assert any("." in c["id"].partition("~s")[2] for c in copies)  # some ids needed the next candidate
    by_seed = {s["seed"]: s for s in summary["sets"]}
    assert by_seed[1]["chats"] == 39 and by_seed[2]["chats"] == 40
    assert by_seed[2]["held_out_prompts_left_out"] == len(held) and by_seed[2]["added"] == 40 - len(held)
    assert by_seed[1]["added"] + by_seed[2]["added"] == len(copies)

    rec = json.loads((out / "stage.json").read_text())
    assert rec["fingerprint"] == "fp-greedy" and rec["options"]["temperature"] == 0.0  # what the runs' pipelines hash
    assert rec["output_fingerprint"] == hashlib.sha256(blob).hexdigest()  # what their prepare's fingerprint hashes
    assert rec["summary"]["selected"] == summary["chats"]
    assert json.loads((out / ".eyas-output").read_text())["created_by"] == "eyas"  # the pipeline may clear it

    again = sd.merge(greedy, [s1, s2], tmp_path / "again", split_from=prepared)
    assert (tmp_path / "again" / "chats.jsonl").read_bytes() == blob and again == summary


def test_merge_refuses_sets_that_differ_from_greedy_in_more_than_sampling(tmp_path, folders):
    greedy, s1, _, prepared = folders
    other = _stage(tmp_path / "o", ["sharegpt:0"], tag="x", temperature=0.7, seed=5, max_new_tokens=24)
    with pytest.raises(ValueError, match=r"\['max_new_tokens'\] differ"):
        sd.merge(greedy, [other], tmp_path / "m1", split_from=prepared)
    with pytest.raises(ValueError, match="expected a sampled set"):
        sd.merge(greedy, [greedy], tmp_path / "m2", split_from=prepared)
    with pytest.raises(ValueError, match="whose seed no other set has"):
        sd.merge(greedy, [s1, s1], tmp_path / "m3", split_from=prepared)
    with pytest.raises(ValueError, match="no complete regenerate stage"):
        sd.merge(greedy, [tmp_path / "nothing"], tmp_path / "m4", split_from=prepared)


def test_the_sampled_arm_changes_no_training_option_and_needs_a_sample():
    assert ra.arm_sets("sampled") == [] and ra.ARMS["sampled"][0] == ()
    with pytest.raises(SystemExit, match="at least one"):
        ra.main(["drive", "--arms", "sampled", "--samples", "0", "--root", "/nonexistent"])
    with pytest.raises(SystemExit, match="temperature above 0"):
        ra.main(["drive", "--arms", "default,sampled", "--sample-temperature", "0", "--root", "/nonexistent"])
    with pytest.raises(SystemExit, match="--parallel 2"):
        ra.main(["start", "--arms", "default,sampled", "--parallel", "2", "--root", "/nonexistent"])


def _options(run: Path, stage: str) -> dict:
    rec = json.loads((run / stage / "stage.json").read_text())
    return json.loads(json.dumps(rec["options"]).replace(str(run), "RUN"))


def test_a_session_trains_the_sampled_arm_on_the_merged_data(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """start (detached) -> wait: base regenerates greedily and prepares; the sampled arm's base adds one sampled
    set, merged and prepared; both runs skip regenerate and prepare and train, evaluate and export alike."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    root = tmp_path / "root"
    ra.main(
        ["start", "--arms", "default,sampled", "--seeds", "4", "--root", str(root), "--recipe", str(SMOKE)]
        + ["--target", str(tiny_target_dir), "--source", "", "--prompts", "", "--sample-temperature", "0.9"]
        + ["--set", "regenerate.limit=6", "--set", "regenerate.max_new_tokens=12", "--set", "train.steps=2"]
        + ["--set", "train.draft_vocab=256"]
    )
    ra.main(["wait", "--root", str(root), "--timeout", "500"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["done"] and last["rc"] == "0" and last["finished"] == 2, last

    w = root / "arms"
    gen = json.loads((w / "sampled-gen-s1" / "regenerate" / "stage.json").read_text())["options"]
    assert (gen["temperature"], gen["top_p"], gen["seed"]) == (0.9, ra.SAMPLE_TOP_P, 1)
    merged = json.loads((w / "base-sampled" / "regenerate" / "stage.json").read_text())["summary"]["lab_sampled"]
    added = merged["sets"][0]["added"]
    assert merged["greedy"] == 6 and added >= 1

    runs = {r["name"]: r for r in ra.gather(w)}
    d, s = runs["default-s4"], runs["sampled-s4"]
    for r in (d, s):
        assert r["rc"] == 0 and r["steps"] == 2 and sorted(r["skipped"]) == ["prepare", "regenerate"]
    assert s["train_samples"] == d["train_samples"] + added  # the merged data, prepared once, in the run
    epochs = {n: int(re.search(r"(\d+) steps per epoch", (w / f"{n}.log").read_text())[1]) for n in runs}
    assert epochs["sampled-s4"] > epochs["default-s4"]  # its training read the merged split
    ids = {n: json.loads((w / n / "prepared" / "eval.ids.json").read_text()) for n in runs}
    assert ids["sampled-s4"] == ids["default-s4"]  # the held-out split is the default arm's
    replayed = _options(w / "sampled-s4", "eval").pop("answers")  # the first run's answers, the session's
    assert replayed == str(w / "answers") and _options(w / "default-s4", "eval").get("answers") is None
    for stage in ("train", "eval", "export"):
        ours, theirs = ({k: v for k, v in _options(w / n, stage).items() if k != "answers"} for n in runs)
        assert ours == theirs, stage
