"""`eyas capture` end to end on a tiny target: store contents, resume, bad input, kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import eyas.capture.run as run_mod
from eyas.capture.run import CaptureSettings, parse_bytes, parse_layers, run_capture
from eyas.data.prepared import write_prepared
from eyas.errors import EyasError
from eyas.store import HiddenStateDataset, StoreReader
from eyas.store.verify import verify_store
from eyas.target import load_target, load_tokenizer, reference_hidden_states, tokenizer_hash
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prepared(path, tok_hash, n=12, seed=0, vocab=49152, max_len=40):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = int(torch.randint(1, max_len, (1,), generator=g))
        rows.append((f"s{i:03d}", torch.randint(0, vocab, (t,), generator=g).tolist(), [k % 3 == 0 for k in range(t)]))
    write_prepared(
        path, {"train": rows, "eval": [("e0", [1, 2, 3], [0, 1, 1])]}, {"tokenizer_hash": tok_hash}, overwrite=True
    )
    return path


@pytest.fixture(scope="module")
def tok_hash(tiny_target_dir):
    return tokenizer_hash(load_tokenizer(tiny_target_dir))


def settings(target, data, out, **kw):
    return CaptureSettings(target=str(target), data=data, out=out, **{"token_budget": 64, "shard_bytes": 20_000, **kw})


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_capture_stores_every_sample_once_and_verifies(tmp_path, tiny_target_dir, tok_hash, dtype):
    data = make_prepared(tmp_path / "p", tok_hash)
    summary = run_capture(settings(tiny_target_dir, data, tmp_path / "s", store_dtype=dtype, aux_layers=[1, 3, 4]))
    assert summary["status"] == "complete" and summary["samples"] == 12 and summary["shards"] > 1
    r = StoreReader(tmp_path / "s")
    m = r.manifest
    assert m["aux_layer_ids"] == [1, 3, 4] and m["convention"] == "hf-input" and m["dtype"] == dtype
    assert m["hidden_size"] == 64 and m["tokenizer_hash"] == tok_hash and m["model_dtype"] == "fp32"
    assert m["target"]["weights_index_sha256"] and m["prepared"]["split"] == "train"
    assert sorted(r.sample_ids) == [f"s{i:03d}" for i in range(12)]
    ds = HiddenStateDataset(tmp_path / "s")
    assert ds.lengths == [ds[i]["input_ids"].numel() for i in range(len(ds))]
    model = load_target(tiny_target_dir)
    for item in (ds[0], ds[len(ds) - 1]):
        aux, final = reference_hidden_states(model, item["input_ids"], layer_ids=[1, 3, 4])
        tol = 0.01 if dtype == "bf16" else 0.08
        assert item["aux"].shape == aux.shape and item["final"].shape == final.shape
        assert float(((item["aux"].float() - aux).norm(dim=-1) / aux.norm(dim=-1)).max()) < tol
        assert item["loss_mask"].dtype == torch.bool and item["input_ids"].dtype == torch.int64
    out = verify_store(tmp_path / "s", numbers=12)
    assert out["ok"] and out["numbers"]["checked"] == 12 and out["numbers"]["worst_rel_err"] < 0.08
    payload = (summary["bytes"] - summary["shards"] * 4096) / summary["tokens"]  # minus the shard headers
    assert payload == {"bf16": 4 * 64 * 2, "fp8": 4 * 64 + 4 * 4}[dtype]


def test_resume_after_limit_and_rerun_is_idempotent(tmp_path, tiny_target_dir, tok_hash):
    data = make_prepared(tmp_path / "p", tok_hash)
    first = run_capture(settings(tiny_target_dir, data, tmp_path / "s", limit=5))
    assert first["samples"] == 5
    assert verify_store(tmp_path / "s", numbers=0)["coverage"]["expected_samples"] == 5
    second = run_capture(settings(tiny_target_dir, data, tmp_path / "s"))
    assert second["resumed_samples"] == 5 and second["captured_samples"] == 7 and second["samples"] == 12
    third = run_capture(settings(tiny_target_dir, data, tmp_path / "s"))
    assert third["captured_samples"] == 0 and third["samples"] == 12
    ids = StoreReader(tmp_path / "s").sample_ids
    assert len(ids) == len(set(ids)) == 12
    assert verify_store(tmp_path / "s", numbers=3)["ok"]


def test_bad_input_is_refused_clearly(tmp_path, tiny_target_dir, tok_hash, smol_tokenizer):
    data = make_prepared(tmp_path / "p", tok_hash, n=4)
    with pytest.raises(
        EyasError, match=r"--aux-layers: ids \[1, 6\] include \[6\], expected inputs to decoder layers 1..5"
    ):
        run_capture(settings(tiny_target_dir, data, tmp_path / "s", aux_layers=[1, 6]))
    run_capture(settings(tiny_target_dir, data, tmp_path / "s"))
    # A store written for another model is not resumed. (model_identity hashes the config and the
    # weights' index, not their values: a same-shaped model with other weights is caught by verify.)
    other = make_tiny_target(tmp_path / "other", smol_tokenizer, hidden_act="gelu")
    with pytest.raises(EyasError, match="different target"):
        run_capture(settings(other, data, tmp_path / "s"))
    with pytest.raises(EyasError, match="different aux_layer_ids"):
        run_capture(settings(tiny_target_dir, data, tmp_path / "s", aux_layers=[1, 2, 3]))
    # Data tokenised for another tokenizer.
    alien = make_prepared(tmp_path / "alien", "0" * 64, n=2)
    with pytest.raises(EyasError, match="another tokenizer"):
        run_capture(settings(tiny_target_dir, alien, tmp_path / "s2"))
    # The prepared dataset changed since the capture began.
    make_prepared(tmp_path / "p", tok_hash, n=4, seed=9)
    with pytest.raises(EyasError, match="different prepared"):
        run_capture(settings(tiny_target_dir, data, tmp_path / "s"))
    with pytest.raises(EyasError, match="changed since the store"):
        HiddenStateDataset(tmp_path / "s")
    with pytest.raises(EyasError, match="--store-dtype"):
        settings(tiny_target_dir, data, tmp_path / "s3", store_dtype="int4")
    with pytest.raises(EyasError, match="--shard-bytes"):
        parse_bytes("lots")
    assert (
        parse_bytes("512MiB") == 512 << 20 and parse_bytes("1GB") == 10**9 and parse_layers("2, 15,27") == [2, 15, 27]
    )


def test_prepared_changing_mid_run_leaves_store_incomplete(tmp_path, tiny_target_dir, tok_hash, monkeypatch):
    data = make_prepared(tmp_path / "p", tok_hash, n=10)
    real, calls = run_mod.make_batch, {"n": 0}

    def make_batch_then_rewrite(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            make_prepared(tmp_path / "p", tok_hash, n=10, seed=5)
        return real(*a, **kw)

    monkeypatch.setattr(run_mod, "make_batch", make_batch_then_rewrite)
    with pytest.raises(EyasError, match="changed while it was being captured"):
        run_capture(settings(tiny_target_dir, data, tmp_path / "s", token_budget=40))
    assert not StoreReader(tmp_path / "s").complete


def test_full_disk_mid_run_then_resume(tmp_path, tiny_target_dir, tok_hash, monkeypatch):
    import errno

    import eyas.store.writer as writer_mod

    data = make_prepared(tmp_path / "p", tok_hash, n=12)
    real, calls = writer_mod._write_all, {"n": 0}

    def failing(f, buf):
        calls["n"] += 1
        if calls["n"] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, buf)

    monkeypatch.setattr(writer_mod, "_write_all", failing)
    with pytest.raises(EyasError, match="disk is full"):
        run_capture(settings(tiny_target_dir, data, tmp_path / "s", token_budget=40, shard_bytes=5000))
    kept = StoreReader(tmp_path / "s").sample_ids
    assert 0 < len(kept) < 12
    monkeypatch.setattr(writer_mod, "_write_all", real)
    again = run_capture(settings(tiny_target_dir, data, tmp_path / "s", token_budget=40, shard_bytes=5000))
    assert again["resumed_samples"] == len(kept) and again["samples"] == 12
    assert verify_store(tmp_path / "s", numbers=2)["ok"]


def test_kill_9_mid_run_then_resume(tmp_path, tiny_target_dir, tok_hash):
    """A real SIGKILL while shards are being written: resume finishes with every sample exactly once."""
    data = make_prepared(tmp_path / "p", tok_hash, n=200, max_len=60)
    out = tmp_path / "s"
    cmd = [
        sys.executable,
        "-m",
        "eyas",
        "capture",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--token-budget",
        "64",
        "--shard-bytes",
        "3000",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.time() + 120
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        m = out / "manifest.json"
        if m.exists():
            with open(m) as f:
                n = len(json.load(f)["samples"])
            if n >= 10:
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = n
                break
        time.sleep(0.05)
    proc.wait()
    assert killed_at is not None, "the capture ended before it could be killed"
    stored = StoreReader(out)
    assert not stored.complete and 10 <= len(stored) < 200
    summary = run_capture(settings(tiny_target_dir, data, out))
    assert summary["resumed_samples"] == len(stored)
    ids = StoreReader(out).sample_ids
    assert len(ids) == len(set(ids)) == 200
    cov = verify_store(out, numbers=2)
    assert cov["ok"] and cov["coverage"]["stored_samples"] == 200
