"""`eyas prepare` end to end: summary, split, skip counting, policies and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eyas.data.prepare import PrepareConfig, is_eval, prepare
from eyas.data.prepared import PreparedDataset
from eyas.errors import EyasError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conv(i, answer="hello there", n_turns=1):
    msgs = []
    for k in range(n_turns):
        msgs += [
            {"role": "user", "content": f"question {i}.{k}"},
            {"role": "assistant", "content": f"{answer} {i}.{k}"},
        ]
    return {"id": f"c{i}", "messages": msgs}


def test_prepare_writes_dataset_with_masks_and_counts(tmp_path, tiny_target_dir):
    rows = [conv(i) for i in range(40)] + [
        {"id": "empty", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"id": "noans", "messages": [{"role": "user", "content": "q"}]},
        {"id": "odd", "messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "a"}]},
    ]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    s = prepare(PrepareConfig(source=str(src), target=str(tiny_target_dir), out=tmp_path / "p", eval_fraction=0.25))
    assert s["samples_kept"] == 40 and s["skipped"] == {"empty_turn": 1, "no_assistant_turn": 1, "unknown_role": 1}
    ds = PreparedDataset(tmp_path / "p")
    train, ev = ds.split("train"), ds.split("eval")
    assert len(train) + len(ev) == 40 and len(ev) == s["eval_samples"] and 0 < len(ev) < 40
    assert {x.id for x in ev} == {f"c{i}" for i in range(40) if is_eval(f"c{i}", 0.25, 0)}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    sample = train[0]
    i = int(sample.id[1:])
    assert tok.decode(sample.input_ids[sample.loss_mask]) == f"hello there {i}.0<|im_end|>"
    assert s["tokens"] == int(sum(ds.split(n).lengths.sum() for n in ("train", "eval")))
    assert s["assistant_tokens"] == int(sum(x.loss_mask.sum() for n in ("train", "eval") for x in ds.split(n)))
    est = s["capture_disk_estimate"]
    assert est["bf16_bytes"] == s["tokens"] * 4 * 64 * 2 and est["fp8_bytes"] * 2 == est["bf16_bytes"]
    assert ds.tokenizer_hash and ds.meta["target"]["config_sha256"]


def test_length_policies(tmp_path, tiny_target_dir):
    rows = [conv(0, answer="word " * 200), conv(1)]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    s = prepare(
        PrepareConfig(
            source=str(src),
            target=str(tiny_target_dir),
            out=tmp_path / "d",
            max_length=64,
            length_policy="drop",
            eval_fraction=0,
        )
    )
    assert s["samples_kept"] == 1 and s["skipped"] == {"too_long": 1}
    s = prepare(
        PrepareConfig(source=str(src), target=str(tiny_target_dir), out=tmp_path / "t", max_length=64, eval_fraction=0)
    )
    assert s["samples_kept"] == 2 and s["samples_truncated_to_max_length"] == 1
    assert int(PreparedDataset(tmp_path / "t").split("train").lengths.max()) == 64


def test_truncated_answer_drop_policy(tmp_path, tiny_target_dir):
    row = conv(0)
    row["messages"][1]["truncated"] = True
    src = write_jsonl(tmp_path / "c.jsonl", [row, conv(1)])
    s = prepare(
        PrepareConfig(
            source=str(src), target=str(tiny_target_dir), out=tmp_path / "p", truncated_answers="drop", eval_fraction=0
        )
    )
    assert s["skipped"] == {"truncated_answer": 1}


def test_split_is_deterministic_and_stable():
    ids = [f"s{i}" for i in range(2000)]
    a = [i for i in ids if is_eval(i, 0.1, 0)]
    assert a == [i for i in ids if is_eval(i, 0.1, 0)]
    assert 120 < len(a) < 280
    assert a != [i for i in ids if is_eval(i, 0.1, 1)]


def test_bad_options_and_inputs(tmp_path, tiny_target_dir):
    with pytest.raises(EyasError, match="--length-policy"):
        PrepareConfig(out=tmp_path / "x", length_policy="cut")
    with pytest.raises(EyasError, match="--max-length"):
        PrepareConfig(out=tmp_path / "x", max_length=1)
    no_tpl = tmp_path / "notpl"
    import shutil

    shutil.copytree(tiny_target_dir, no_tpl)
    for f in no_tpl.glob("chat_template*"):
        f.unlink()
    cfg_path = no_tpl / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    src = write_jsonl(tmp_path / "c.jsonl", [conv(0)])
    with pytest.raises(EyasError, match="chat template"):
        prepare(PrepareConfig(source=str(src), target=str(no_tpl), out=tmp_path / "p"))
    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    with pytest.raises(EyasError, match="tokenizer"):
        prepare(PrepareConfig(source=str(src), target=str(notok), out=tmp_path / "p"))
    with pytest.raises(EyasError, match="not a directory"):
        prepare(PrepareConfig(source=str(src), target=str(tmp_path / "nomodel"), out=tmp_path / "p"))


def test_existing_output_is_not_overwritten_and_failed_run_leaves_nothing(tmp_path, tiny_target_dir):
    src = write_jsonl(tmp_path / "c.jsonl", [conv(0)])
    out = tmp_path / "p"
    prepare(PrepareConfig(source=str(src), target=str(tiny_target_dir), out=out))
    with pytest.raises(EyasError, match="already exists"):
        prepare(PrepareConfig(source=str(src), target=str(tiny_target_dir), out=out))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(conv(0)) + "\n{broken\n")
    with pytest.raises(EyasError, match="line 2"):
        prepare(PrepareConfig(source=str(bad), target=str(tiny_target_dir), out=tmp_path / "q"))
    assert not (tmp_path / "q").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".q")] == []


def test_cli_prints_json_summary_last_and_errors_cleanly(tmp_path, tiny_target_dir):
    src = write_jsonl(tmp_path / "c.jsonl", [conv(i) for i in range(3)])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "eyas",
            "prepare",
            "--source",
            str(src),
            "--target",
            str(tiny_target_dir),
            "--out",
            str(tmp_path / "p"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["samples_kept"] == 3
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "eyas",
            "prepare",
            "--source",
            str(tmp_path / "missing.jsonl"),
            "--target",
            str(tiny_target_dir),
            "--out",
            str(tmp_path / "q"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "missing.jsonl" in r.stderr and "does not exist" in r.stderr
    h = subprocess.run([sys.executable, "-m", "eyas", "prepare", "--help"], capture_output=True, text=True)
    for opt in (
        "--out",
        "--source",
        "--target",
        "--max-length",
        "--length-policy",
        "--eval-fraction",
        "--seed",
        "--limit",
        "--truncated-answers",
        "--hf-split",
        "--aux-layer-count",
        "--overwrite",
    ):
        assert opt in h.stdout


def test_repeated_ids_and_the_limit(tmp_path, tiny_target_dir, capfd):
    """Ids `a`, `a`, `a#1`: every sample gets an id of its own (a repeat takes the first free `#k`); --limit 5 reads 5
    records and says so."""
    rows = [conv(0), conv(1), conv(2)]
    rows[0]["id"], rows[1]["id"], rows[2]["id"] = "a", "a", "a#1"
    src = write_jsonl(tmp_path / "dup.jsonl", rows + [conv(i) for i in range(3, 10)])
    s = prepare(PrepareConfig(source=str(src), target=str(tiny_target_dir), out=tmp_path / "p", eval_fraction=0))
    ids = PreparedDataset(tmp_path / "p").split("train").ids
    assert ids[:3] == ["a", "a#1", "a#1#1"] and len(set(ids)) == 10
    s = prepare(
        PrepareConfig(source=str(src), target=str(tiny_target_dir), out=tmp_path / "l", eval_fraction=0, limit=5)
    )
    assert s["source_records"] == 5 and s["samples_kept"] == 5
    assert "kept 5 of 5 records" in capfd.readouterr().err


def test_write_prepared_names_repeated_ids(tmp_path):
    from eyas.data.prepared import write_prepared

    with pytest.raises(EyasError, match=r"^2 sample id\(s\) appear more than once \(split eval; first: a, b\)"):
        write_prepared(
            tmp_path / "p",
            {"train": [("a", [1, 2], [0, 1])], "eval": [("a", [1], [1]), ("b", [1], [1]), ("b", [2], [1])]},
            {},
        )
    assert not (tmp_path / "p").exists()


def test_a_long_chat_is_rendered_only_up_to_max_length(tiny_target_dir):
    """A chat of 2,000 turns cut to 64 tokens: the histories of the turns past the cut are never rendered (each render
    is as long as the history: rendering them all is quadratic in the turns)."""
    from transformers import AutoTokenizer

    from eyas.data.template import render

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    calls = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or real(*a, **k)
    msgs = conv(0, n_turns=1000)["messages"]
    r = render(tok, msgs, max_tokens=64)
    assert len(r.input_ids) >= 64 and any(r.loss_mask[:64])
    assert len(calls) < 50  # (the turns inside the tokenised prefix only, not 1,000)
    full = render(tok, msgs[:6])  # the first turns' mask is the same as without the cut
    assert r.loss_mask[:64] == full.loss_mask[:64]


def test_a_prepared_split_changed_after_prepare_is_refused(tmp_path, tiny_target_dir):
    """Arrays replaced by another dataset's, or the train and eval files swapped (meta.json as it was): refused on
    open, naming the split."""
    import shutil

    from eyas.data.prepared import write_prepared

    a = write_prepared(tmp_path / "a", {"train": [("x", [1, 2, 3], [0, 1, 1])], "eval": [("y", [4, 5], [0, 1])]}, {})
    b = write_prepared(tmp_path / "b", {"train": [("x", [1, 2, 9], [0, 1, 1])], "eval": [("y", [4, 5], [0, 1])]}, {})
    PreparedDataset(a).split("train")
    shutil.copy(b / "train.safetensors", a / "train.safetensors")
    with pytest.raises(
        EyasError,
        match=r"split `train` \(train.safetensors, train.ids.json\) does not match its "
        r"fingerprint in meta.json .*run `eyas prepare` again",
    ):
        PreparedDataset(a).split("train")
    for name in ("train", "eval"):
        for ext in (".safetensors", ".ids.json"):
            shutil.copy(
                tmp_path / "b" / f"{'eval' if name == 'train' else 'train'}{ext}", tmp_path / "b" / f"x{name}{ext}"
            )
    for name in ("train", "eval"):
        for ext in (".safetensors", ".ids.json"):
            (tmp_path / "b" / f"x{name}{ext}").replace(tmp_path / "b" / f"{name}{ext}")
    with pytest.raises(EyasError, match=r"split `train` .*does not match its fingerprint"):
        PreparedDataset(b).split("train")


def test_worker_processes_write_what_this_process_writes(tmp_path, tiny_target_dir):
    """The chats rendered by two spawned processes, three a task (a partial last task, skipped records and length
    drops in between), give the same dataset, byte for byte, and the same summary as rendered here."""
    rows = [conv(i, n_turns=1 + i % 3) for i in range(10)] + [conv(10, answer="word " * 200)]
    rows.insert(4, {"id": "noans", "messages": [{"role": "user", "content": "q"}]})
    rows[7]["messages"][1]["truncated"] = True
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    out = {}
    for workers in (1, 2):
        cfg = PrepareConfig(
            source=str(src),
            target=str(tiny_target_dir),
            out=tmp_path / f"p{workers}",
            eval_fraction=0.25,
            max_length=150,
            length_policy="drop",
        )
        out[workers] = prepare(cfg, workers=workers, chunk=3)
    assert out[1].pop("out") != out[2].pop("out") and out[1] == out[2]
    assert out[1]["skipped"] == {"no_assistant_turn": 1, "too_long": 1} and out[1]["samples_kept"] == 10
    for name in ("train.safetensors", "eval.safetensors", "train.ids.json", "eval.ids.json"):
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes(), name


def test_worker_processes_only_for_a_large_source_outside_a_daemon(monkeypatch):
    import multiprocessing
    import os

    from eyas.data.prepare import POOL_MIN_CHATS, pool_workers

    cores = min(16, os.cpu_count() or 1)
    assert pool_workers(POOL_MIN_CHATS - 1) == 1 and pool_workers(POOL_MIN_CHATS) == cores
    monkeypatch.setitem(multiprocessing.current_process()._config, "daemon", True)  # a daemon may not start children
    assert pool_workers(10 * POOL_MIN_CHATS) == 1
