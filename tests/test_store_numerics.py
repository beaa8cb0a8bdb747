"""`eyas verify` on stores made by a serving engine: engine-sized noise passes, every single-sample fault fails.

The engine store is a correct in-process store with bf16-engine-like noise added to EVERY token:
per token, a random direction scaled to a lognormal fraction of the state's norm, larger at higher
layers, and the final slot recomputed from the noisy highest aux layer through the last layers and
the norm (an engine's final state comes from its own high layer). The noise is sized so that the
worst single token at the highest aux layer is about 0.104 against verify's bf16 reference, as on
the live SGLang store, so the single-worst-token check at 0.1 fails some seeds and not others.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eyas.data.prepared import PreparedDataset
from eyas.errors import CheckFailed
from eyas.store import StoreReader
from eyas.store.format import manifest_fields_sha256
from eyas.store.invariants import tail_final, target_parts
from eyas.store.numerics import calibrate_store, engine_limits, token_errors
from eyas.store.verify import verify_store
from eyas.target import load_target, load_tokenizer, reference_hidden_states, tokenizer_hash
from tests.test_capture_run import make_prepared
from tests.test_verify_faults import rewrite

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = [1, 3, 4]
HIGH = 2  # slot of the highest aux layer
SLOT_NOISE = [0.35, 0.7, 1.0]  # relative size of the noise per aux slot
WORST = 0.104  # the worst token's error at the highest aux layer, as on the live store
SGLANG = {"backend": "sglang", "sglang_version": "0.5.17", "server_dtype": "bfloat16"}


def write_store(src, dst, mutate=lambda sid, h, everything: h, **kw):
    """test_verify_faults.rewrite with this file's shard size."""
    return rewrite(src, dst, mutate, shard_bytes=20_000, **kw)


def edit_manifest(src, dst, edit, *, rehash: bool):
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    if rehash:
        m["fields_sha256"] = manifest_fields_sha256(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_target_dir):
    """{"clean": in-process store, "engine": noisy engine store with its calibration, "uncalibrated": the same
    without, "split": the prepared split, "record": the calibration, "worst": per-sample worst high-layer error}."""
    from eyas.capture.run import CaptureSettings, run_capture

    root = tmp_path_factory.mktemp("numerics")
    data = make_prepared(root / "p", tokenizer_hash(load_tokenizer(tiny_target_dir)), n=12, seed=1, max_len=40)
    run_capture(
        CaptureSettings(
            target=str(tiny_target_dir),
            data=data,
            out=root / "clean",
            aux_layers=LAYERS,
            token_budget=64,
            shard_bytes=20_000,
        )
    )
    split = PreparedDataset(data).split("train")
    model = load_target(tiny_target_dir)
    ref_model = load_target(tiny_target_dir, dtype=torch.bfloat16)  # what verify recomputes a bf16 store with
    parts = target_parts(model, LAYERS)
    clean = StoreReader(root / "clean")
    g = torch.Generator().manual_seed(7)
    draws = {}
    for sid in clean.sample_ids:
        t = clean.record(sid)["tokens"]
        draws[sid] = (
            torch.exp(0.4 * torch.randn(t, len(LAYERS), generator=g)),
            torch.nn.functional.normalize(torch.randn(t, len(LAYERS), 64, generator=g), dim=-1),
        )

    def noisy(sid, h, sigma):
        mag, unit = draws[sid]
        for k in range(len(LAYERS)):
            h[:, k] += (sigma * SLOT_NOISE[k] * mag[:, k] * h[:, k].norm(dim=-1))[:, None] * unit[:, k]
        ids = split[split.index_of(sid)].input_ids
        with torch.no_grad():
            h[:, -1] = tail_final(parts, ids, h[:, HIGH], first_layer=LAYERS[HIGH]).float()
        return h

    def worst_high(sigma):
        out = {}
        for sid in clean.sample_ids:
            ids = split[split.index_of(sid)].input_ids
            with torch.no_grad():
                aux, final = reference_hidden_states(ref_model, ids, layer_ids=LAYERS)
            ref = torch.cat([aux, final[:, None]], dim=1).float()
            stored = noisy(sid, clean.get_hidden(sid, torch.float32), sigma).to(torch.bfloat16).float()
            out[sid] = float(token_errors(stored, ref)[:, HIGH].max())
        return out

    sigma = 0.03
    sigma *= WORST / max(worst_high(sigma).values())  # the noise dominates: the error is about linear in sigma
    with torch.no_grad():
        write_store(
            root / "clean",
            root / "uncalibrated",
            lambda sid, h, _: noisy(sid, h, sigma),
            model_dtype="bf16",
            producer=dict(SGLANG),
        )
    record = calibrate_store(root / "uncalibrated", split, str(tiny_target_dir), device="cpu", samples=4, engine=SGLANG)
    write_store(root / "uncalibrated", root / "engine", extra={"engine_numerics": record})
    return {
        "clean": root / "clean",
        "engine": root / "engine",
        "uncalibrated": root / "uncalibrated",
        "split": split,
        "record": record,
        "worst": worst_high(sigma),
        "root": root,
    }


def test_the_engine_store_looks_like_the_live_one(stores):
    worst = sorted(stores["worst"].values())
    assert 0.095 <= worst[-1] <= 0.115  # the worst single token, as on the live store
    assert sum(w > 0.1 for w in worst) <= 2 < sum(w > 0.03 for w in worst)  # most samples well below, noise on all
    rec = stores["record"]
    assert rec["n_samples"] == 4 and list(rec["per_layer"]) == ["1", "3", "4", "final"]
    assert rec["per_layer"]["4"]["rms"]["max"] > 0.01  # the calibration saw the noise


def test_engine_noise_passes_under_20_seeds_where_the_worst_token_check_would_not(stores):
    worst_tokens = []
    for seed in range(20):
        s = verify_store(stores["engine"], numbers=4, seed=seed, invariants=False)
        assert s["ok"] and s["numbers"]["seed"] == seed and s["numbers"]["checked"] == 4
        assert s["numbers"]["engine_limits"]["source"] == "calibration"
        worst_tokens.append(s["numbers"]["worst_rel_err"])
    assert max(worst_tokens) > 0.1 >= min(worst_tokens)  # a fixed 0.1 on the worst token fails some seeds
    # with the invariants too (the prefix invariant holds single tokens to the gross limit on an engine store)
    s = verify_store(stores["engine"], numbers=2, seed=0)
    assert s["ok"] and s["invariants"]["checked"] == 12 and s["invariants"]["prefix"]["tolerance"] > 0.1


def test_an_in_process_store_keeps_the_worst_token_check(stores, tmp_path):
    s = verify_store(stores["clean"], numbers=3)
    assert s["ok"] and "engine_limits" not in s["numbers"] and s["numbers"]["tolerance"] == pytest.approx(1e-2)
    # the same noisy numbers, claimed by eyas's own capture: held to 0.1 on every token, they fail
    ours = write_store(stores["uncalibrated"], tmp_path / "ours", producer={"backend": "transformers"})
    with pytest.raises(CheckFailed, match="over tolerance 0.1"):
        verify_store(ours, numbers=100, invariants=False)


def _victims(stores):
    recs = [r for r in StoreReader(stores["engine"]).manifest["samples"] if r["tokens"] >= 10]
    a = recs[0]
    b = min((r for r in recs if r["id"] != a["id"]), key=lambda r: abs(r["tokens"] - a["tokens"]))
    return a["id"], b["id"]


def _fault(kind, stores, tiny_target_dir):
    """mutate(sid, h, everything) injecting `kind` into one sample (two for `swapped`), and the samples hit."""
    a, b = _victims(stores)
    split = stores["split"]

    def only(f):
        return lambda sid, h, everything: f(h, everything) if sid == a else h

    if kind == "zeros":  # prefix rows never written
        return only(lambda h, _: torch.cat([torch.zeros_like(h[:2]), h[2:]])), [a]
    if kind == "shifted":
        return only(lambda h, _: torch.cat([h[1:], h[-1:]])), [a]
    if kind == "scaled":
        return only(lambda h, _: h * 1.25), [a]
    if kind == "dropped":  # a missing prefix: its rows are not stored at all
        return only(lambda h, _: h[3:]), [a]
    model = load_target(tiny_target_dir)
    ids = split[split.index_of(a)].input_ids
    if kind == "wrong_layer":  # slot 1 holds layer 2's input instead of layer 3's
        aux, _ = reference_hidden_states(model, ids, layer_ids=[2])

        def wrong(h, _):
            h[:, 1] = aux[:, 0]
            return h

        return only(wrong), [a]
    if kind == "no_context":  # the suffix computed as if it started the sequence (a radix-cache gap)
        aux, final = reference_hidden_states(model, ids[4:], layer_ids=LAYERS)

        def lost(h, _):
            h[4:] = torch.cat([aux, final[:, None]], dim=1)
            return h

        return only(lost), [a]
    if kind == "swapped":  # two samples' rows exchanged, trimmed or padded to each other's length

        def swap(sid, h, everything):
            if sid not in (a, b):
                return h
            other = everything[b if sid == a else a]
            t = h.shape[0]
            return (
                other[:t] if other.shape[0] >= t else torch.cat([other, other[-1:].expand(t - other.shape[0], -1, -1)])
            ).clone()

        return swap, [a, b]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["zeros", "shifted", "scaled", "wrong_layer", "no_context", "swapped", "dropped"])
def test_every_single_sample_fault_fails_an_engine_store(stores, tiny_target_dir, tmp_path, kind):
    mutate, hit = _fault(kind, stores, tiny_target_dir)
    with torch.no_grad():
        store = write_store(stores["engine"], tmp_path / "f", mutate, extra={"engine_numerics": stores["record"]})
    with pytest.raises(CheckFailed) as info:
        verify_store(store, numbers=100, invariants=False)
    s = info.value.summary
    if kind == "dropped":
        assert s["coverage"]["problems"]["token_count"] == hit
        return
    nums = s["numbers"]
    assert s["coverage"]["ok"] and nums["engine_limits"]["source"] == "calibration"
    assert sorted(nums["failing_samples"]) == sorted(hit)  # the noisy correct samples all pass
    assert nums["worst_over"]["ratio"] > 1.5, nums["worst_over"]  # caught with room, not at the edge
    assert "over the engine limits" in str(info.value)


def test_a_store_without_calibration_uses_the_fixed_limits(stores, tiny_target_dir, tmp_path):
    s = verify_store(stores["uncalibrated"], numbers=100, invariants=False)
    assert s["ok"] and s["numbers"]["engine_limits"]["source"] == "fallback"
    assert s["numbers"]["engine_limits"]["per_layer"]["4"] == {"rms": 0.05, "p999": 0.2, "max": 0.4}
    mutate, hit = _fault("shifted", stores, tiny_target_dir)
    with torch.no_grad():
        bad = write_store(stores["uncalibrated"], tmp_path / "f", mutate)
    with pytest.raises(CheckFailed) as info:
        verify_store(bad, numbers=100, invariants=False)
    assert info.value.summary["numbers"]["failing_samples"] == hit


def test_calibrated_limits_follow_the_record_within_floor_and_margin(stores):
    m = StoreReader(stores["engine"]).manifest
    lim = engine_limits(m, 0.1)
    rec = stores["record"]["per_layer"]
    assert lim.source == "calibration"
    for slot, key in enumerate(["1", "3", "4", "final"]):
        for stat, floor in (("rms", 0.025), ("p999", 0.1), ("max", 0.25)):
            assert lim.limits[slot][stat] == pytest.approx(max(2 * rec[key][stat]["max"], floor))


def test_an_absurd_calibration_is_refused_and_an_unhashed_edit_fails_coverage(stores, tmp_path):
    def absurd(m):
        m["engine_numerics"]["per_layer"]["4"]["rms"]["max"] = 5.0
        m["engine_numerics"]["per_layer"]["4"]["p999"]["max"] = 50.0

    edited = edit_manifest(stores["engine"], tmp_path / "edited", absurd, rehash=False)
    with pytest.raises(CheckFailed) as info:
        verify_store(edited, numbers=2, invariants=False)
    assert any("fields_sha256" in n for n in info.value.summary["coverage"]["notes"])
    rehashed = edit_manifest(stores["engine"], tmp_path / "rehashed", absurd, rehash=True)
    with pytest.raises(CheckFailed, match="engine_numerics is refused: it records rms 5 at layer 4") as info:
        verify_store(rehashed, numbers=2, invariants=False)
    s = info.value.summary
    assert s["coverage"]["ok"] and s["numbers"]["engine_limits"]["source"] == "refused"
    assert s["numbers"]["engine_limits"]["per_layer"]["4"]["rms"] == pytest.approx(0.05)  # judged by the fixed limits

    def malformed(m):
        del m["engine_numerics"]["per_layer"]["final"]

    broken = edit_manifest(stores["engine"], tmp_path / "broken", malformed, rehash=True)
    with pytest.raises(CheckFailed, match="are not the store's"):
        verify_store(broken, numbers=2, invariants=False)
