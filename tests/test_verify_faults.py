"""`eyas verify` catches each injected fault, and passes the correct store it was derived from.

Faults are injected by rewriting a correct store through StoreWriter (so checksums match what was
written: the numbers or coverage check has to find them), or by damaging the files afterwards.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from eyas.capture.run import CaptureSettings, run_capture
from eyas.errors import CheckFailed
from eyas.store import StoreReader, StoreSpec, StoreWriter
from eyas.store.verify import verify_store
from eyas.target import load_target, load_tokenizer, reference_hidden_states, tokenizer_hash
from tests.test_capture_run import make_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("verify")
    data = make_prepared(root / "p", tokenizer_hash(load_tokenizer(tiny_target_dir)), n=8, max_len=30)
    # Two samples of equal length, batched together: the "swapped within a batch" fault needs them.
    run_capture(
        CaptureSettings(
            target=str(tiny_target_dir),
            data=data,
            out=root / "good",
            aux_layers=LAYERS,
            token_budget=64,
            shard_bytes=10_000,
        )
    )
    return root / "good"


FIELDS = (
    "aux_layer_ids",
    "hidden_size",
    "dtype",
    "convention",
    "target",
    "tokenizer_hash",
    "prepared",
    "model_dtype",
    "producer",
)


def rewrite(src, dst, mutate=lambda sid, h, everything: h, *, shard_bytes=10_000, extra=None, **fields):
    """Copy store `src` to `dst` sample by sample through mutate(id, hidden_TLD, all) -> hidden_TLD or None (None
    drops the sample); `fields` replace spec fields, `extra` sets other manifest fields (the writer recomputes the
    checksum)."""
    r = StoreReader(src)
    spec = StoreSpec(**{**{k: r.manifest[k] for k in FIELDS}, **fields})
    everything = {sid: r.get_hidden(sid, torch.float32) for sid in r.sample_ids}
    with StoreWriter(dst, spec, shard_bytes=shard_bytes) as w:
        for sid in r.sample_ids:
            h = mutate(sid, everything[sid].clone(), everything)
            if h is not None:
                w.add(sid, h[:, :-1], h[:, -1])
        for k, v in (extra or {}).items():
            w.set_field(k, v)
        w.close(complete=True)
    return dst


def expect_failure(store, *, kind=None, samples=None):
    """The fault fails `samples` under the default checks, and under the named check alone: with
    kind="numbers" the recompute by itself (invariants off) must find them too."""
    if samples:
        with pytest.raises(CheckFailed) as info:
            verify_store(store)
        assert set(samples) <= set(info.value.summary["failing_samples"]), str(info.value)
    with pytest.raises(CheckFailed) as info:
        verify_store(store, numbers=100, invariants=kind != "numbers")
    s = info.value.summary
    assert not s["ok"]
    if kind == "numbers":
        assert s["coverage"]["ok"], s["coverage"]
        assert set(samples) <= set(s["numbers"]["failing_samples"])
        assert s["numbers"]["worst_rel_err"] > 5 * s["numbers"]["tolerance"]
    elif kind is not None:
        assert set(samples) <= set(s["coverage"]["problems"][kind]), s["coverage"]
    if samples:
        assert set(samples) <= set(s["failing_samples"])
    return s


def test_good_store_passes(good):
    s = verify_store(good, numbers=100)
    assert (
        s["ok"]
        and s["numbers"]["checked"] == 8
        and s["invariants"]["checked"] == 8
        and s["numbers"]["worst_rel_err"] < 0.01
    )


def test_prefix_missing_rows_dropped(good, tmp_path):
    victim = StoreReader(good).sample_ids[0]
    store = rewrite(good, tmp_path / "f", lambda sid, h, _: h[3:] if sid == victim else h)
    expect_failure(store, kind="token_count", samples=[victim])


def test_prefix_missing_rows_zero_filled(good, tmp_path):
    victim = StoreReader(good).sample_ids[1]

    def mutate(sid, h, _):
        if sid == victim:
            h[:2] = 0
        return h

    expect_failure(rewrite(good, tmp_path / "f", mutate), kind="numbers", samples=[victim])


def test_prefix_recomputed_without_context(good, tmp_path, tiny_target_dir):
    """The prefix-cache failure proper: the suffix's states computed as if it started the sequence."""
    r = StoreReader(good)
    victim = r.sample_ids[0]
    from eyas.data.prepared import PreparedDataset

    split = PreparedDataset(r.manifest["prepared"]["path"]).split("train")
    ids = split[split.index_of(victim)].input_ids
    model = load_target(tiny_target_dir)
    aux, final = reference_hidden_states(model, ids[4:], layer_ids=LAYERS)

    def mutate(sid, h, _):
        if sid == victim:
            h[4:] = torch.cat([aux, final.unsqueeze(1)], dim=1)
        return h

    expect_failure(rewrite(good, tmp_path / "f", mutate), kind="numbers", samples=[victim])


def test_rows_shifted_by_one(good, tmp_path):
    victim = StoreReader(good).sample_ids[2]
    store = rewrite(good, tmp_path / "f", lambda sid, h, _: torch.cat([h[1:], h[-1:]]) if sid == victim else h)
    expect_failure(store, kind="numbers", samples=[victim])


def test_wrong_layer(good, tmp_path, tiny_target_dir):
    """Slot 1 holds layer 2's input instead of layer 3's, for every sample."""
    r = StoreReader(good)
    from eyas.data.prepared import PreparedDataset

    split = PreparedDataset(r.manifest["prepared"]["path"]).split("train")
    model = load_target(tiny_target_dir)

    def mutate(sid, h, _):
        aux, _final = reference_hidden_states(model, split[split.index_of(sid)].input_ids, layer_ids=[2])
        h[:, 1] = aux[:, 0]
        return h

    expect_failure(rewrite(good, tmp_path / "f", mutate), kind="numbers", samples=r.sample_ids)


def test_two_samples_rows_swapped_within_a_batch(good, tmp_path):
    r = StoreReader(good)
    recs = r.manifest["samples"]
    # Neighbours in the store were in one batch (sorted by length); swap the rows of two of them,
    # trimmed/padded to each other's length as a buggy unpacker would.
    a, b = recs[0]["id"], recs[1]["id"]

    def mutate(sid, h, everything):
        if sid in (a, b):
            other = everything[b if sid == a else a]
            t = h.shape[0]
            src = (
                other[:t] if other.shape[0] >= t else torch.cat([other, other[-1:].expand(t - other.shape[0], -1, -1)])
            )
            return src.clone()
        return h

    expect_failure(rewrite(good, tmp_path / "f", mutate), kind="numbers", samples=[a, b])


def test_nan(good, tmp_path):
    victim = StoreReader(good).sample_ids[3]

    def mutate(sid, h, _):
        if sid == victim:
            h[1, 2, 5] = float("nan")
        return h

    expect_failure(rewrite(good, tmp_path / "f", mutate), kind="nonfinite", samples=[victim])


def test_truncated_shard_and_bit_flip(good, tmp_path):
    import shutil

    store = tmp_path / "f"
    shutil.copytree(good, store)
    m = json.loads((store / "manifest.json").read_text())
    with open(store / m["shards"][-1]["name"], "r+b") as f:
        f.truncate(m["shards"][-1]["bytes"] - 1)
    lost = [s["id"] for s in m["samples"] if s["shard"] == len(m["shards"]) - 1]
    s = expect_failure(store, kind="truncated_shard", samples=lost)
    assert any("truncated" in note for note in s["coverage"]["notes"])
    shutil.rmtree(store)
    shutil.copytree(good, store)
    rec = m["samples"][0]
    with open(store / m["shards"][rec["shard"]]["name"], "r+b") as f:
        f.seek(4096 + rec["start"] * 4 * 64 * 2 + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    expect_failure(store, kind="checksum", samples=[rec["id"]])


def test_missing_duplicated_and_incomplete(good, tmp_path):
    import shutil

    store = tmp_path / "f"
    shutil.copytree(good, store)
    m = json.loads((store / "manifest.json").read_text())
    dropped = m["samples"].pop()["id"]
    m["samples"].append(dict(m["samples"][0]))
    m["status"] = "in_progress"
    (store / "manifest.json").write_text(json.dumps(m))
    s = expect_failure(store, kind="missing", samples=[dropped])
    assert s["coverage"]["problems"]["duplicated"] == [m["samples"][0]["id"]]
    assert any("not 'complete'" in n for n in s["coverage"]["notes"])


def test_cli_exit_codes(good, tmp_path):
    from eyas.cli import app

    ok = CliRunner().invoke(app, ["verify", "--store", str(good), "--numbers", "2"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout.strip().splitlines()[-1])["ok"] is True
    victim = StoreReader(good).sample_ids[0]
    bad = rewrite(good, tmp_path / "f", lambda sid, h, _: torch.cat([h[1:], h[-1:]]) if sid == victim else h)
    res = CliRunner().invoke(app, ["verify", "--store", str(bad), "--numbers", "100"])
    assert res.exit_code == 1
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failing_samples"] == [victim] and list(summary["invariants"]["failures"]) == [victim]
    res = CliRunner().invoke(app, ["verify", "--store", str(bad), "--numbers", "100", "--no-invariants"])
    assert res.exit_code == 1
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failing_samples"] == [victim] and summary["numbers"]["worst_sample"] == victim
    missing = CliRunner().invoke(app, ["verify", "--store", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2
