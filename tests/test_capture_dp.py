"""Data-parallel capture into one store (`torchrun --nproc_per_node 2 -m eyas capture`, gloo on CPU).

Two processes must write a store whose every sample equals a one-process capture's, that `eyas verify`
passes with every sample exactly once; a process killed after committing shards must leave a state
that the same command resumes to a complete store without duplicates. Folding a rank's store into
the shared one (StoreWriter.absorb) must be idempotent across a crash in the middle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eyas.store.writer as writer_mod
from eyas.capture.run import CaptureSettings, fold_rank_stores, rank_store_dir, run_capture, split_by_tokens
from eyas.store import StoreReader
from eyas.store.verify import verify_store
from eyas.store.writer import StoreSpec, StoreWriter
from eyas.target import load_tokenizer, tokenizer_hash
from tests.test_capture_run import make_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 16
# Each sample alone in its forward (budget 1): the same shapes as the one-process run, so the same
# kernels and bit-identical fp32 rows; small shards so every process commits several.
COMMON = [
    "--store-dtype",
    "fp32",
    "--token-budget",
    "1",
    "--shard-bytes",
    "30000",
    "--device",
    "cpu",
    "--aux-layers",
    "1,3,4",
]

# A launcher that runs `eyas capture` but SIGKILLs rank 1 right after its second committed shard:
# a crash in the middle of the data-parallel run, with committed work in a rank store.
KILLER = """
import os, signal, sys
import eyas.store.writer as w
orig = w.StoreWriter.commit
def commit(self):
    orig(self)
    if os.environ.get("RANK") == "1" and self.path.name.startswith("rank-") and len(self.manifest["shards"]) >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
w.StoreWriter.commit = commit
from eyas.cli import main
sys.argv = ["eyas", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("dp")
    data = make_prepared(root / "p", tokenizer_hash(load_tokenizer(tiny_target_dir)), n=N)
    ref = root / "ref"
    run_capture(
        CaptureSettings(
            target=str(tiny_target_dir),
            data=data,
            out=ref,
            store_dtype="fp32",
            token_budget=1,
            shard_bytes=30000,
            aux_layers=[1, 3, 4],
        )
    )
    return {"target": tiny_target_dir, "data": data, "ref": ref, "root": root}


def _torchrun(args, *, script=None, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    entry = [str(script)] if script else ["-m", "eyas"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *entry, *args]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        assert lines, f"no summary on stdout: {res.stdout[-1000:]!r}; stderr: {res.stderr[-2000:]}"
        return json.loads(lines[-1])
    return res


def _args(world, out):
    return ["capture", "--target", str(world["target"]), "--data", str(world["data"]), "--out", str(out), *COMMON]


def _assert_same_as_reference(store, ref):
    r, q = StoreReader(store), StoreReader(ref)
    ids = [s["id"] for s in r.manifest["samples"]]
    assert len(ids) == len(set(ids)) == N, "a sample is stored twice or missing"
    assert sorted(ids) == sorted(q.sample_ids)
    assert [s["name"] for s in r.manifest["shards"]] == [
        f"shard-{i:05d}.safetensors" for i in range(len(r.manifest["shards"]))
    ]
    for sid in ids:
        a, b = r.raw(sid)[0], q.raw(sid)[0]
        assert a.shape == b.shape and torch.equal(a, b), f"sample {sid} differs from the one-process capture"
    assert not (Path(store) / ".ranks").exists(), "rank stores were left behind"
    out = verify_store(store, numbers=4)
    assert out["ok"], out
    assert out["coverage"]["expected_samples"] == N


def test_split_by_tokens_is_disjoint_balanced_and_deterministic():
    lengths = [37, 5, 5, 20, 19, 1, 8, 30, 2, 2, 11]
    todo = [0, 1, 3, 4, 6, 7, 8, 10]
    bins = split_by_tokens(todo, lengths, 3)
    assert sorted(i for b in bins for i in b) == todo
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths[i] for i in todo)
    assert bins == split_by_tokens(list(reversed(todo)), lengths, 3) and all(b == sorted(b) for b in bins)
    assert split_by_tokens([0], lengths, 2) == [[0], []]


def test_two_processes_write_the_one_process_store(world):
    out = world["root"] / "two"
    summary = _torchrun(_args(world, out))
    assert summary["status"] == "complete" and summary["samples"] == N and summary["processes"] == 2
    per_rank = summary["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1] and all(r["samples"] > 0 for r in per_rank)
    assert sum(r["samples"] for r in per_rank) == N
    _assert_same_as_reference(out, world["ref"])
    again = _torchrun(_args(world, out))  # a complete store: nothing left to capture
    assert again["resumed_samples"] == N and again["captured_samples"] == 0 and again["samples"] == N


@pytest.mark.parametrize("resume_with", [2, 1])
def test_killed_rank_resumes_without_duplicates(world, tmp_path, resume_with):
    """Resumed by the same torchrun command, or by one plain process (the rank stores are folded in)."""
    out = tmp_path / "killed"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    res = _torchrun(_args(world, out), script=script, check=False)
    assert res.returncode != 0, "the injected SIGKILL did not happen"
    rank1 = json.loads((rank_store_dir(out, 1) / "manifest.json").read_text())
    assert len(rank1["shards"]) >= 2  # committed work of the killed process, still outside the store
    assert json.loads((out / "manifest.json").read_text())["status"] == "in_progress"
    if resume_with == 2:
        summary = _torchrun(_args(world, out))
    else:
        summary = run_capture(
            CaptureSettings(
                target=str(world["target"]),
                data=world["data"],
                out=out,
                store_dtype="fp32",
                token_budget=1,
                shard_bytes=30000,
                aux_layers=[1, 3, 4],
            )
        )
    assert summary["resumed_samples"] >= rank1["totals"]["samples"] > 0
    assert summary["resumed_samples"] + summary["captured_samples"] == N
    _assert_same_as_reference(out, world["ref"])


def _spec():
    return StoreSpec(aux_layer_ids=[0], hidden_size=4, dtype="fp32")


def _add(w, sid, t, seed):
    g = torch.Generator().manual_seed(seed)
    w.add(sid, torch.randn(t, 1, 4, generator=g), torch.randn(t, 4, generator=g))


def test_absorb_is_idempotent_across_a_crash(tmp_path, monkeypatch):
    """A crash after the first absorbed shard is listed: the next fold adds the rest, none twice; a
    crash after linking but before listing: the unlisted link is removed and absorbed again."""
    main = tmp_path / "store"
    StoreWriter(main, _spec()).close()
    sub = StoreWriter(rank_store_dir(main, 0), _spec(), shard_bytes=1)  # one sample per shard
    for k in range(3):
        _add(sub, f"x{k}", 2 + k, k)
    sub.close()

    calls = {"n": 0}
    real = writer_mod.StoreWriter._write_manifest

    def crash_after_first(self):
        real(self)
        if self.path == main:
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt  # the process dies right after listing the first shard

    monkeypatch.setattr(writer_mod.StoreWriter, "_write_manifest", crash_after_first)
    w = StoreWriter(main, _spec())
    with pytest.raises(KeyboardInterrupt):
        fold_rank_stores(w)
    w.abort()
    monkeypatch.setattr(writer_mod.StoreWriter, "_write_manifest", real)
    assert [s["id"] for s in StoreReader(main).manifest["samples"]] == ["x0"]
    (main / "shard-00001.safetensors").write_bytes(b"half-linked leftover")  # a link never listed

    w = StoreWriter(main, _spec())  # removes the unlisted leftover
    assert fold_rank_stores(w) == 2
    w.close(complete=True)
    r = StoreReader(main)
    assert [s["id"] for s in r.manifest["samples"]] == ["x0", "x1", "x2"]
    assert not (main / ".ranks").exists()
    for sid in r.sample_ids:
        r.check_sample(sid)  # the checksum of every absorbed sample still matches its bytes
    ref = tmp_path / "ref"
    w = StoreWriter(ref, _spec(), shard_bytes=1)
    for k in range(3):
        _add(w, f"x{k}", 2 + k, k)
    w.close(complete=True)
    for sid in ("x0", "x1", "x2"):
        assert torch.equal(r.raw(sid)[0], StoreReader(ref).raw(sid)[0])
