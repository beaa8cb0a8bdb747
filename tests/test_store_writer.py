"""Store writer/reader: round trips per dtype, atomic commits, resume after a crash, full disk."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import eyas.store.writer as writer_mod
from eyas.errors import EyasError
from eyas.store import StoreReader, StoreSpec, StoreWriter, bytes_per_token, quantize_fp8
from eyas.store.format import HEADER_BYTES

D, A = 32, 3


def spec(dtype="bf16", **kw):
    return StoreSpec(
        aux_layer_ids=[1, 2, 4],
        hidden_size=D,
        dtype=dtype,
        target={"path": "/x", "config_sha256": "c"},
        tokenizer_hash="t",
        prepared={"path": "/p", "split": "train", "fingerprint": "f"},
        model_dtype="fp32",
        **kw,
    )


def samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(1, 40, (1,), generator=g))
        out.append((f"s{i}", torch.randn(t, A, D, generator=g) * (i + 1), torch.randn(t, D, generator=g)))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
def test_round_trip_and_safetensors_compat(tmp_path, dtype):
    data = samples(9)
    with StoreWriter(tmp_path / "s", spec(dtype), shard_bytes=4000) as w:
        for sid, aux, fin in data:
            w.add(sid, aux, fin)
    r = StoreReader(tmp_path / "s")
    assert r.sample_ids == [s[0] for s in data] and len(r) == 9
    assert len(r.manifest["shards"]) >= 3  # small shard_bytes: several commits
    for sid, aux, fin in data:
        got_aux, got_fin = r.get(sid, torch.float32)
        if dtype == "fp32":
            assert torch.equal(got_aux, aux) and torch.equal(got_fin, fin)
        elif dtype == "bf16":
            assert torch.equal(got_aux, aux.bfloat16().float()) and torch.equal(got_fin, fin.bfloat16().float())
        else:  # e4m3: 3 mantissa bits -> rounding error at most 2^-4 of each value (normal range)
            err = (got_aux - aux).abs() / aux.abs().clamp_min(aux.abs().amax(-1, keepdim=True) / 64)
            assert err.max() <= 2**-4 + 1e-6
    # The shards are standard safetensors files whose rows are the samples back to back.
    rec = r.manifest["samples"][0]
    tensors = load_file(str(tmp_path / "s" / r.manifest["shards"][rec["shard"]]["name"]))
    hidden, scale = r.raw(rec["id"])
    assert torch.equal(
        tensors["hidden"][rec["start"] : rec["start"] + rec["tokens"]].view(torch.uint8), hidden.view(torch.uint8)
    )
    assert ("scale" in tensors) == (dtype == "fp8")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
def test_add_stacked_stores_what_add_stores(tmp_path, dtype):
    # the SGLang client stacks [T, A+1, D] on its request threads and hands that over: the store must be
    # byte for byte what add(aux, final) writes, and rows already in the stored dtype are not copied
    data = samples(5, seed=3)
    with StoreWriter(tmp_path / "a", spec(dtype)) as w:
        for sid, aux, fin in data:
            w.add(sid, aux, fin)
    with StoreWriter(tmp_path / "b", spec(dtype)) as w:
        for k, (sid, aux, fin) in enumerate(data):
            stacked = torch.cat([aux, fin[:, None]], dim=1)
            stacked = stacked.bfloat16() if dtype == "bf16" else stacked
            if k % 2:  # encoded on other threads (the client's request threads), added by this one
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    enc = pool.submit(w.encode, sid, stacked).result()
                assert (enc.rows.data_ptr() == stacked.data_ptr()) == (dtype != "fp8")  # fp8 is quantised
                w.add_encoded(enc)
            else:
                w.add_stacked(sid, stacked)
        with pytest.raises(ValueError, match=r"hidden has shape \(4, 3, 32\), expected \[T, 4, 32\]"):
            w.add_stacked("bad", torch.zeros(4, A, D))
    a, b = StoreReader(tmp_path / "a"), StoreReader(tmp_path / "b")
    assert a.sample_ids == b.sample_ids
    for sid, *_ in data:
        ha, sa = a.raw(sid)
        hb, sb = b.raw(sid)
        assert torch.equal(ha.view(torch.uint8), hb.view(torch.uint8))
        assert (sa is None and sb is None) or torch.equal(sa, sb)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
def test_a_spooled_sample_loads_back_whole_and_a_short_file_is_refused(tmp_path, dtype):
    # a check process hands an encoded sample over in a file: what comes back is the same rows, scales and
    # checksum, and what crosses between the processes is a few names and numbers, no tensor
    w = StoreWriter(tmp_path / "s", spec(dtype))
    sid, aux, fin = samples(1, seed=5)[0]
    enc = w.encode(sid, torch.cat([aux, fin[:, None]], dim=1))
    spooled = enc.spool(tmp_path / "rows.bin")
    assert not any(isinstance(v, torch.Tensor) for v in vars(spooled).values())
    back = spooled.load()
    assert back.id == sid and back.digest == enc.digest and back.rows.dtype == enc.rows.dtype
    assert torch.equal(back.rows.view(torch.uint8), enc.rows.view(torch.uint8))
    assert (back.scale is None) == (dtype != "fp8") and (back.scale is None or torch.equal(back.scale, enc.scale))
    size = (tmp_path / "rows.bin").stat().st_size
    os.truncate(tmp_path / "rows.bin", size - 1)
    with pytest.raises(EOFError, match=f"rows.bin: .* bytes of sample {sid}"):
        spooled.load()
    w.close()


def test_bytes_per_token_fp8_halves_bf16(tmp_path):
    assert bytes_per_token("bf16", slots=4, hidden_size=4096) == 4 * 4096 * 2
    assert bytes_per_token("fp8", slots=4, hidden_size=4096) == 4 * 4096 + 16
    sizes = {}
    for dtype in ("bf16", "fp8"):
        with StoreWriter(tmp_path / dtype, spec(dtype), shard_bytes=1 << 30) as w:
            for sid, aux, fin in samples(5):
                w.add(sid, aux, fin)
        m = StoreReader(tmp_path / dtype).manifest
        sizes[dtype] = m["totals"]["bytes"] - HEADER_BYTES
        assert sizes[dtype] == m["totals"]["tokens"] * bytes_per_token(dtype, slots=A + 1, hidden_size=D)
    assert sizes["fp8"] < 0.6 * sizes["bf16"]


def test_quantize_fp8_rows():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 10, 1e3, 1e5, 0])[:, None]
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6,)
    assert scale[-1] == 1 and torch.equal(q[-1].float(), torch.zeros(64))
    back = q.float() * scale[:, None]
    rel = (back - x).norm(dim=-1)[:5] / x.norm(dim=-1)[:5]
    assert rel.max() < 0.05  # per-row scales: every magnitude keeps its precision
    assert torch.allclose(q.float().abs().amax(-1)[:5], torch.full((5,), 448.0))


def test_resume_removes_uncommitted_leftovers(tmp_path):
    path = tmp_path / "s"
    data = samples(8)
    w = StoreWriter(path, spec(), shard_bytes=3000)
    for sid, aux, fin in data[:5]:
        w.add(sid, aux, fin)
    committed = w.committed_ids
    assert 0 < len(committed) < 5  # some samples sit in the open shard
    w._file.flush()
    # A kill now: the open temporary shard stays, and (worse) a renamed shard the manifest never listed.
    n_shards = len(w.manifest["shards"])
    orphan = path / f"shard-{n_shards:05d}.safetensors"
    orphan.write_bytes(b"garbage")
    os.close(os.dup(w._file.fileno()))
    w._lock.close()  # the process died: its lock is gone
    w._file = None
    assert any(p.name.endswith(".tmp") for p in path.iterdir())
    w2 = StoreWriter(path, spec(), shard_bytes=3000)
    assert w2.committed_ids == committed
    assert not any(p.name.endswith(".tmp") for p in path.iterdir()) and not orphan.exists()
    for sid, aux, fin in data:
        if sid not in w2.committed_ids:
            w2.add(sid, aux, fin)
    w2.close(complete=True)
    r = StoreReader(path)
    assert sorted(r.sample_ids) == sorted(s[0] for s in data) and r.complete
    for sid, _aux, fin in data:
        assert torch.equal(r.get(sid, torch.float32)[1], fin.bfloat16().float())


def test_resume_refuses_other_settings_and_duplicates(tmp_path):
    path = tmp_path / "s"
    with StoreWriter(path, spec()) as w:
        sid, aux, fin = samples(1)[0]
        w.add(sid, aux, fin)
    other = spec()
    other.target = {"path": "/x", "config_sha256": "other"}
    with pytest.raises(EyasError, match="different target"):
        StoreWriter(path, other)
    with pytest.raises(EyasError, match="different dtype"):
        StoreWriter(path, spec("fp8"))
    moved = spec()
    moved.prepared = {"path": "/moved", "split": "train", "fingerprint": "f"}
    with (
        StoreWriter(path, moved) as w,
        pytest.raises(ValueError, match="already added"),
    ):  # same data, new path: resumable
        w.add(sid, aux, fin)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.bin").write_bytes(b"1")
    with pytest.raises(EyasError, match="not an eyas store"):
        StoreWriter(tmp_path / "junk", spec())


def test_a_refused_directory_is_left_as_it_was(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "x.bin").write_bytes(b"1")
    with pytest.raises(EyasError, match="not an eyas store"):
        StoreWriter(junk, spec())
    assert [p.name for p in junk.iterdir()] == ["x.bin"]  # no .lock left behind


def test_held_commits_keep_the_rows_going_and_commit_once_the_check_passes(tmp_path):
    data = samples(8)
    check = concurrent.futures.Future()
    w = StoreWriter(tmp_path / "s", spec(), shard_bytes=3000, hold_commits=check)
    for sid, aux, fin in data[:5]:
        w.add(sid, aux, fin)
    # past shard_bytes several times over, nothing committed: the rows are in the open shard on disk
    assert w.committed_samples == 0 and w._file.tell() > 3 * 3000
    check.set_result(None)
    w.add(*data[5])
    assert w.committed_samples == 6  # the next full shard is committed, with every sample written so far
    for sid, aux, fin in data[6:]:
        w.add(sid, aux, fin)
    w.close(complete=True)
    r = StoreReader(tmp_path / "s")
    assert r.complete and sorted(r.sample_ids) == sorted(s[0] for s in data)
    for sid, _aux, fin in data:
        assert torch.equal(r.get(sid, torch.float32)[1], fin.bfloat16().float())


def test_a_failed_check_drops_the_open_shard_and_discard_removes_only_a_new_store(tmp_path):
    data = samples(6)
    check = concurrent.futures.Future()
    w = StoreWriter(tmp_path / "a" / "s", spec(), shard_bytes=3000, hold_commits=check)
    for sid, aux, fin in data[:3]:
        w.add(sid, aux, fin)
    check.set_exception(EyasError("the data was tokenised by another tokenizer"))
    with pytest.raises(EyasError, match="another tokenizer"):  # at the next full shard
        for sid, aux, fin in data[3:]:
            w.add(sid, aux, fin)
    assert w.committed_samples == 0 and not any(p.name.endswith(".tmp") for p in (tmp_path / "a" / "s").iterdir())
    with pytest.raises(EyasError, match="another tokenizer"):  # and at close: nothing is committed
        w.close(complete=True)
    w.discard()  # closed already: the store this writer made is still removed, its parent too
    assert list(tmp_path.iterdir()) == []
    # a store that already held samples keeps them: the refused run's rows go, the store stays resumable
    with StoreWriter(tmp_path / "s", spec()) as w:
        w.add(*data[0])
    check = concurrent.futures.Future()
    w = StoreWriter(tmp_path / "s", spec(), hold_commits=check)
    w.add(*data[1])
    check.set_exception(EyasError("refused"))
    w.discard()
    r = StoreReader(tmp_path / "s")
    assert r.sample_ids == [data[0][0]]
    w = StoreWriter(tmp_path / "s", spec())  # reopens: the lock was released
    w.close()


def test_second_writer_is_locked_out(tmp_path):
    w = StoreWriter(tmp_path / "s", spec())
    with pytest.raises(EyasError, match="another process"):
        StoreWriter(tmp_path / "s", spec())
    w.close()


def test_full_disk_keeps_store_valid_up_to_last_commit(tmp_path, monkeypatch):
    path = tmp_path / "s"
    data = samples(10)
    real, calls = writer_mod._write_all, {"n": 0}

    def failing_write(f, buf):
        calls["n"] += 1
        if calls["n"] > 9:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, buf)

    monkeypatch.setattr(writer_mod, "_write_all", failing_write)
    w = StoreWriter(path, spec(), shard_bytes=3000)
    with pytest.raises(EyasError, match="disk is full.*valid up to its last committed shard"):
        for sid, aux, fin in data:
            w.add(sid, aux, fin)
    w.abort()
    committed = StoreReader(path).sample_ids
    assert 0 < len(committed) < 10
    assert not any(p.name.endswith(".tmp") for p in path.iterdir())
    for sid in committed:  # every committed sample reads back whole
        assert StoreReader(path).get(sid)[0].shape[0] == dict((s[0], s[1].shape[0]) for s in data)[sid]
    monkeypatch.setattr(writer_mod, "_write_all", real)
    with StoreWriter(path, spec(), shard_bytes=3000) as w:
        for sid, aux, fin in data:
            if sid not in w.committed_ids:
                w.add(sid, aux, fin)
    assert sorted(StoreReader(path).sample_ids) == sorted(s[0] for s in data)


def test_free_space_check_refuses_with_figures(tmp_path, monkeypatch):
    class Usage:
        free = 10 << 20

    monkeypatch.setattr(writer_mod.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(EyasError, match=r"needs about 1\.0 GB.*10\.5 MB is free.*--store-dtype fp8"):
        writer_mod.check_free_space(tmp_path / "new" / "store", 10**9, what="x")
    monkeypatch.undo()
    assert writer_mod.check_free_space(tmp_path, 1000, what="x")["need_bytes"] == 1000


def test_reader_random_access_and_truncated_shard(tmp_path):
    data = samples(6)
    with StoreWriter(tmp_path / "s", spec(), shard_bytes=2000) as w:
        for sid, aux, fin in data:
            w.add(sid, aux, fin)
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    last = m["shards"][-1]["name"]
    with open(tmp_path / "s" / last, "r+b") as f:
        f.truncate(m["shards"][-1]["bytes"] - 10)
    r = StoreReader(tmp_path / "s")
    in_last = [s["id"] for s in m["samples"] if s["shard"] == len(m["shards"]) - 1]
    ok = [s["id"] for s in m["samples"] if s["id"] not in in_last]
    assert ok and in_last
    for sid in ok:  # shards other than the damaged one stay readable
        assert r.get(sid)[0].shape[1:] == (A, D)
    with pytest.raises(EyasError, match="truncated"):
        r.get(in_last[0])


def test_chunked_writes_land_at_the_right_offsets(tmp_path):
    data = samples(4)
    with StoreWriter(tmp_path / "s", spec("fp8")) as w:
        w.write_chunk = 100  # many chunks per sample, none aligned to rows
        for sid, aux, fin in data:
            w.add(sid, aux, fin)
    r = StoreReader(tmp_path / "s")
    for sid, aux, fin in data:
        q, scale = quantize_fp8(torch.cat([aux, fin[:, None]], 1))
        hidden, got_scale = r.raw(sid)
        assert torch.equal(hidden.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_scale, scale)
