"""`capture_from_sglang` end to end, against the stand-in server.

The stand-in (eyas/sglang/standin.py) speaks SGLang's /generate and server-info contract and writes
dumps of real hidden states (a tiny random Llama) through the plugin's own core. These tests and those of
tests/test_sglang_*.py and tests/test_verify_server.py are what CI runs in place of a real SGLang server.
"""

from __future__ import annotations

import threading

import pytest
import torch

from eyas.errors import CheckFailed, EyasError
from eyas.sglang.client import capture_from_sglang
from tests.sglang_helpers import (
    LAYERS,
    LENGTHS,
    check_store_against_reference,
    hide_the_prefix_cache,
    serve,
    without_the_prefix_cap,
)


def test_chunked_prefill_batched_capture_ingests_real_states(tiny_target_dir, tiny_model, sglang_prepared, tmp_path):
    def fresh_thread_intra_op() -> int:  # torch's setting as a thread started now finds it
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start(), t.join()
        return seen[0]

    intra_op = fresh_thread_intra_op()
    # the stand-in gathers what arrives within batch_wait_s into one batch: long enough that a busy machine
    # still sends it several of the 4 requests in flight (the batching asserted below)
    with serve(
        tiny_target_dir, tmp_path, chunked_prefill_size=8, max_forward_tokens=24, tp_size=2, batch_wait_s=0.05
    ) as srv:
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, concurrency=4
        )
        forwards = srv.forwards
    assert out["captured"] == len(LENGTHS) and out["rejected_count"] == 0 and out["store_complete"]
    assert out["tokens"] == sum(LENGTHS) and out["cache_bypass"] == ["none"]
    # the server really did batch several requests and stitch chunks
    assert any(len(f["rids"]) > 1 for f in forwards)
    assert any(p > 0 for f in forwards for p in f["extend_prefix_lens"])
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)
    assert list((tmp_path / "dumps").iterdir()) == []  # every dump deleted once ingested
    # the loop's own rate leaves out the set-up, and the summary says where the loop's time went
    assert 0 < out["loop_s"] < out["elapsed_s"] and out["loop_tokens_per_s"] > out["tokens_per_s"]
    assert sorted(out["seconds_summed"]) == ["check", "dump", "encode", "gate", "ingest", "request"]
    assert fresh_thread_intra_op() == intra_op  # the request threads' one intra-op thread is not left behind
    # every part took time, the wait for a slot too (8 samples, 4 slots: half of them started waiting)
    assert all(v > 0 for v in out["seconds_summed"].values()) and out["procs"] == 0
    # at most the slots' worth of requests at the server at once, on average
    assert 0 < out["in_flight_mean"] <= 4
    # every stored token in the timeline of the loop's seconds (a sub-second loop: one bucket)
    timeline = out["stored_tokens_timeline"]
    assert timeline["bucket_s"] == 1 and sum(timeline["tokens"]) == out["tokens"]
    assert len(timeline["tokens"]) <= int(out["loop_s"]) + 1
    phases = out["phase_seconds"]
    assert sorted(phases) == ["calibrate", "close", "loop", "loop_cpu", "setup"] and phases["loop"] == out["loop_s"]
    # each figure rounded to 1 ms, the whole too
    assert sum(phases[k] for k in ("setup", "loop", "calibrate", "close")) <= out["elapsed_s"] + 5 * 5e-4
    setup = out["setup_seconds"]  # the set-up's parts, in order, within it
    assert list(setup) == ["data", "preflight", "probe"] and setup["probe"] > 0
    assert sum(setup.values()) <= phases["setup"] + (len(setup) + 1) * 5e-4  # each figure rounded to 1 ms
    # beside the loop: the store opened, the tokenizer checked (the loop waited for both before it ended), then the
    # calibration's reference loaded (the calibration waited for it)
    beside = out["beside_loop_seconds"]
    assert list(beside) == ["target_identity", "open_store", "tokenizer", "reference"] and beside["reference"] > 0
    opening = sum(beside[k] for k in ("target_identity", "open_store", "tokenizer"))
    assert 0 < opening <= phases["loop"] + 4 * 5e-4
    assert sum(beside.values()) <= phases["loop"] + phases["calibrate"] + 5 * 5e-4
    assert out["store_seconds"]["write"] > 0 and out["store_seconds"]["commit"] > 0


def test_ingested_store_passes_eyas_verify(tiny_target_dir, sglang_prepared, tmp_path):
    from eyas.store.verify import verify_store

    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=16) as srv:
        # no target given: the server's model_path is a directory here, so the store records it
        capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS)
    summary = verify_store(tmp_path / "store", numbers=3)
    assert summary["ok"] and summary["samples"] == len(LENGTHS)


def test_capture_records_the_engine_numerics_that_verify_holds_the_store_to(tiny_target_dir, sglang_prepared, tmp_path):
    from eyas.store.reader import StoreReader
    from eyas.store.verify import verify_store

    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=16) as srv:
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=3
        )
        again = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=3
        )
        plain = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "plain", LAYERS, target=tiny_target_dir, calibrate=0
        )
    rec = StoreReader(tmp_path / "store").manifest["engine_numerics"]
    assert out["engine_numerics"]["n_samples"] == rec["n_samples"] == 3 and rec["engine"]["backend"] == "sglang"
    assert list(rec["per_layer"]) == ["2", "3", "4", "final"]
    assert 0 < rec["per_layer"]["4"]["max"]["max"] < 0.01  # the stand-in computes in fp32: only the bf16 store rounds
    assert "kept" in again["engine_numerics"]  # a rerun with the same engine keeps the record
    assert "engine_numerics" not in StoreReader(tmp_path / "plain").manifest and "skipped" in plain["engine_numerics"]
    s = verify_store(tmp_path / "store", numbers=3, invariants=False)
    assert s["ok"] and s["numbers"]["engine_limits"]["source"] == "calibration"
    assert (
        verify_store(tmp_path / "plain", numbers=3, invariants=False)["numbers"]["engine_limits"]["source"]
        == "fallback"
    )


def test_capture_fails_when_the_engine_disagrees_with_the_reference(
    tiny_target_dir, sglang_prepared, tmp_path, monkeypatch
):
    # a server whose aux states are the next layer's: every structural check passes, the calibration does not
    import eyas.target
    from eyas.store.verify import verify_store

    real = eyas.target.forward_capture
    monkeypatch.setattr(
        eyas.target,
        "forward_capture",
        lambda model, ids, mask=None, *, layer_ids: real(model, ids, mask, layer_ids=[i + 1 for i in layer_ids]),
    )
    with (
        serve(tiny_target_dir, tmp_path) as srv,
        pytest.raises(CheckFailed, match="disagree with the reference") as info,
    ):
        capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=2
        )
    summary = info.value.summary
    assert summary["store_complete"] and "at layer 2" in summary["engine_numerics"]["problem"]
    with pytest.raises(CheckFailed, match="engine_numerics is refused"):
        verify_store(tmp_path / "store", numbers=1, invariants=False)


def test_radix_cache_needs_a_bypass_and_plugin_salt_or_logprob_work(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path
):
    # samples 5 and 7 share 20 tokens with sample 3, sent before them one at a time: each bypass must keep
    # them whole; the plugin's (auto's choice) asks the server for nothing but the prompt
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=16) as srv:
        with pytest.raises(EyasError, match="--disable-radix-cache"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s0", LAYERS, cache_bypass="none")
        sent = []
        gen = srv.generate
        srv.generate = lambda body: (sent.append(sorted(body)), gen(body))[1]
        for bypass, chosen in (("auto", "plugin"), ("salt", "salt"), ("logprob", "logprob")):
            sent.clear()
            out = capture_from_sglang(
                [srv.url],
                sglang_prepared,
                "train",
                tmp_path / f"s-{bypass}",
                LAYERS,
                cache_bypass=bypass,
                concurrency=1,
            )
            assert out["rejected_count"] == 0, out["rejected"]
            assert out["cache_bypass"] == [chosen]
            if chosen == "plugin":
                assert all(keys == ["input_ids", "rid", "sampling_params"] for keys in sent), sent[:2]
        # a plugin that reports the cap while SGLang does not run the hooked method: the probe tells, before a
        # sample is sent
        put_back = without_the_prefix_cap(srv)
        with pytest.raises(EyasError, match="did not pass through it .* --sglang-cache-bypass logprob"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s-off", LAYERS, concurrency=1)
        assert not (tmp_path / "s-off").exists()
        put_back()
        # a plugin whose cap is not in effect and not reported (an older plugin): auto falls back to the salt,
        # and the plugin's bypass asked for by name is refused, naming what to do
        without_the_prefix_cap(srv)
        info = srv.server_info

        def older_plugin():
            got = info()
            got["internal_states"][0]["eyas_capture"].pop("prefix_cap")
            return got

        srv.server_info = older_plugin
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s-old", LAYERS, concurrency=1)
        assert out["cache_bypass"] == ["salt"] and out["rejected_count"] == 0
        with pytest.raises(EyasError, match="does not cap prefix matches .* install this eyas"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s1", LAYERS, cache_bypass="plugin")
    check_store_against_reference(tmp_path / "s-auto", sglang_prepared, tiny_model)


def test_the_plugins_bypass_asked_for_on_a_server_without_radix_cache_captures(
    tiny_target_dir, sglang_prepared, tmp_path
):
    # nothing to cap there, and SGLang still runs the hook (it computes the cap whatever the cache): no probe check
    with serve(tiny_target_dir, tmp_path) as srv:
        out = capture_from_sglang(
            [srv.url],
            sglang_prepared,
            "train",
            tmp_path / "s",
            LAYERS,
            cache_bypass="plugin",
            concurrency=2,
            calibrate=0,
        )
        caps = srv.server_info()["internal_states"][0]["eyas_capture"]["stats"]["prefix_caps"]
    assert out["cache_bypass"] == ["plugin"] and out["captured"] == len(LENGTHS) and out["rejected_count"] == 0
    assert caps == len(LENGTHS) + 1  # every sample and the probe passed through the hook


def test_captured_prompts_leave_the_radix_cache_as_it_was(tiny_target_dir, sglang_prepared, tmp_path):
    # an eyas prompt is never matched (the cap), so the plugin's release hook keeps it out of the cache: the
    # server's cache holds what other requests put there, and no eviction is spent on the capture's prompts
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s", LAYERS, concurrency=2)
        stats = srv.server_info()["internal_states"][0]["eyas_capture"]["stats"]
        assert out["captured"] == len(LENGTHS) and out["cache_bypass"] == ["plugin"] and srv.radix == []
        assert stats["insert_skips"] == stats["prefix_caps"] == len(LENGTHS) + 1  # the samples and the probe
        code, _ = srv.generate({"input_ids": [5, 6, 7, 8], "rid": "plain-1", "sampling_params": {"max_new_tokens": 1}})
        assert code == 200 and srv.radix == [(None, [5, 6, 7, 8])]  # a request of anyone else is cached as before


def test_prefix_hits_on_a_misreporting_server_are_rejected_then_resumed(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path
):
    # The server caches prefixes but reports the cache as off: samples 5 and 7 (sharing 20 tokens
    # with sample 3, sent before them one at a time) come back with cached_tokens > 0.
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        srv.cfg.disable_radix_cache = False
        info = srv.server_info
        srv.server_info = lambda: {**info(), "disable_radix_cache": True}
        without_the_prefix_cap(srv)
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
    assert out["captured"] == 6 and not out["store_complete"]
    assert sorted(r["id"] for r in out["rejected"]) == ["s5", "s7"]
    assert all("cached_tokens = 20" in r["reason"] for r in out["rejected"])
    # a rerun against an honest server resumes: only the two rejected samples are sent
    with serve(tiny_target_dir, tmp_path) as srv:
        again = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS)
    assert again["already_committed"] == 6 and again["captured"] == 2 and again["store_complete"]
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)


def test_plugin_rejection_reaches_the_client(tiny_target_dir, sglang_prepared, tmp_path):
    # cached_tokens reported as 0 but the forward started at a prefix: only the plugin can tell.
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        truthful = hide_the_prefix_cache(srv)
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
        reasons = {r["id"]: r["reason"] for r in out["rejected"]}
        assert sorted(reasons) == ["s5", "s7"]
        assert all("plugin rejected it" in r and "prefix 20" in r for r in reasons.values())
        # the same server, now described truthfully: the rerun bypasses the cache and completes the store
        truthful()
        again = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS)
    assert again["cache_bypass"] == ["plugin"] and again["captured"] == 2 and again["store_complete"]


def test_legacy_info_path_retries_and_data_parallel(tiny_target_dir, sglang_prepared, tmp_path):
    with (
        serve(tiny_target_dir, tmp_path, legacy_info_path=True, fail_first=3) as a,
        serve(tiny_target_dir, tmp_path) as b,
    ):
        out = capture_from_sglang(
            [a.url, b.url], sglang_prepared, "train", tmp_path / "store", None, backoff_s=0.01, concurrency=2
        )
        assert a.generate_calls > 3 and b.generate_calls > 0  # both servers got work
    assert out["layer_ids"] == LAYERS and out["captured"] == len(LENGTHS) and out["retries"] == 3


def test_resume_after_a_crash_and_stale_dumps(tiny_target_dir, tiny_model, sglang_prepared, tmp_path):
    from eyas.sglang.client import _job_tag

    with serve(tiny_target_dir, tmp_path) as srv:
        first = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, limit=3, target=tiny_target_dir
        )
        assert first["captured"] == 3
        # a crashed run left a dump of this job behind; the next run removes it
        stale = tmp_path / "dumps" / f"eyas.9.{_job_tag(tmp_path / 'store', 'train')}-4-0"
        stale.mkdir()
        (stale / "meta.json").write_text("{}")
        with pytest.raises(EyasError, match="different dtype"):
            capture_from_sglang(
                [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, dtype="fp32", target=tiny_target_dir
            )
        assert not stale.exists()
        second = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir
        )
    assert second["already_committed"] == 3 and second["captured"] == 5 and second["store_complete"]
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)


def test_the_store_opens_beside_the_first_samples_and_its_refusal_stops_the_capture(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path, monkeypatch
):
    # the store's opening (the target's identity, the manifest) waits here until the server has answered every
    # sample: a capture that opened the store before sending would never get there
    import time

    from eyas.sglang import client

    real_open, answered = client.open_store, []

    def sent() -> int:  # the samples' requests the server has run (the probe's aside)
        return len({r for f in srv.forwards for r in f["rids"] if "probe" not in r})

    def slow_open(*a, **kw):
        deadline = time.monotonic() + 20
        while sent() < len(LENGTHS) and time.monotonic() < deadline:
            time.sleep(0.01)
        answered.append(sent())
        return real_open(*a, **kw)

    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(client, "open_store", slow_open)
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, concurrency=2
        )
        assert answered == [len(LENGTHS)] and out["captured"] == len(LENGTHS) and out["store_complete"]
        check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)

        # a store that cannot be opened stops the capture with its own error, and nothing is written
        def refused_open(*a, **kw):
            raise EyasError("cannot open")

        monkeypatch.setattr(client, "open_store", refused_open)
        with pytest.raises(EyasError, match="cannot open"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s", LAYERS, target=tiny_target_dir)
        assert not (tmp_path / "s").exists()
        monkeypatch.setattr(client, "open_store", real_open)
    assert list((tmp_path / "dumps").iterdir()) == []


def refused_for_its_model_type(url, tiny_target_dir, sglang_prepared, tmp_path) -> None:
    """A copy of the tiny target of a model type transformers does not know: the capture refuses it and leaves no
    store."""
    import json
    import shutil

    bogus = tmp_path / "bogus_target"
    shutil.copytree(tiny_target_dir, bogus)
    config = json.loads((bogus / "config.json").read_text())
    (bogus / "config.json").write_text(json.dumps({**config, "model_type": "bogus_arch"}))
    with pytest.raises(EyasError, match="model_type 'bogus_arch' is unknown"):
        capture_from_sglang([url], sglang_prepared, "train", tmp_path / "sb", LAYERS, target=bogus)
    assert not (tmp_path / "sb").exists()


def test_the_tokenizer_check_runs_after_the_opening_and_its_refusal_leaves_no_store(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path, monkeypatch
):
    # the tokenizer check (seconds on a real target) runs once the store is open, the samples' rows going into it
    # meanwhile; data tokenised by another tokenizer stops the capture with its own error, samples written before
    # the check ended or not, and nothing is left of the store
    import time

    import eyas.target
    from eyas.store.writer import StoreWriter

    real_add, real_hash, added, seen = StoreWriter.add_encoded, eyas.target.tokenizer_hash, [], []

    def counting_add(self, sample):
        added.append(sample.id)
        return real_add(self, sample)

    def slow_hash(wrong: bool):
        def tokenizer_hash(tok):
            deadline = time.monotonic() + 20
            while len(added) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(len(added))  # samples stored while the check ran
            return "f" * 64 if wrong else real_hash(tok)

        return tokenizer_hash

    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(StoreWriter, "add_encoded", counting_add)
        monkeypatch.setattr(eyas.target, "tokenizer_hash", slow_hash(wrong=True))
        with pytest.raises(EyasError, match="another tokenizer"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s", LAYERS, target=tiny_target_dir)
        assert len(seen) == 1 and seen[0] >= 2 and not (tmp_path / "s").exists()
        # the same slow check passing: the rows written before it are committed after it, every sample stored
        added.clear()
        monkeypatch.setattr(eyas.target, "tokenizer_hash", slow_hash(wrong=False))
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "slow", LAYERS, target=tiny_target_dir, concurrency=2
        )
        assert seen[-1] >= 2 and out["captured"] == len(LENGTHS) and out["store_complete"]
        check_store_against_reference(tmp_path / "slow", sglang_prepared, tiny_model)
        monkeypatch.setattr(StoreWriter, "add_encoded", real_add)
        monkeypatch.setattr("eyas.target.tokenizer_hash", lambda tok: "f" * 64)
        for procs in (0, 2):
            with pytest.raises(EyasError, match="another tokenizer"):
                capture_from_sglang(
                    [srv.url],
                    sglang_prepared,
                    "train",
                    tmp_path / f"s{procs}",
                    LAYERS,
                    target=tiny_target_dir,
                    procs=procs,
                )
            assert not (tmp_path / f"s{procs}").exists()
        # a target whose model type transformers does not know: its identity is hashed without importing
        # transformers, and the check after the opening refuses it, leaving nothing
        monkeypatch.setattr("eyas.target.tokenizer_hash", real_hash)
        refused_for_its_model_type(srv.url, tiny_target_dir, sglang_prepared, tmp_path)
    assert list((tmp_path / "dumps").iterdir()) == []


def test_the_calibration_starts_beside_the_loop_once_enough_samples_are_committed(
    tiny_target_dir, sglang_prepared, tmp_path, monkeypatch
):
    # the engine's numbers are recomputed while the rest is still being captured (its seconds then leave the
    # command's); the record is the same kind and verify still holds the store to it
    import functools
    import time

    import eyas.store.writer
    from eyas.sglang import apart
    from eyas.store.reader import StoreReader
    from eyas.store.verify import verify_store

    writer_cls = eyas.store.writer.StoreWriter
    monkeypatch.setattr(eyas.store.writer, "StoreWriter", functools.partial(writer_cls, shard_bytes=1))  # commits
    committed_then, loaded, added = [], threading.Event(), []  # come during the loop: a shard per sample
    real_calibrate, real_load, real_add = apart.OPS["calibrate"], apart.OPS["load_reference"], writer_cls.add_encoded

    def calibrate(state, **kw):
        committed_then.append(len(StoreReader(kw["store"]).manifest["samples"]))
        return real_calibrate(state, **kw)

    def load_reference(state, **kw):
        real_load(state, **kw)
        loaded.set()

    def add_encoded(self, sample):  # the loop is held until the reference is loaded, then until the calibration
        added.append(sample.id)  # started: it must start while samples are left, however fast the stand-in is
        if len(added) == 3:
            assert loaded.wait(30)
            time.sleep(0.5)  # the loading Future settles
        if len(added) == 5:
            deadline = time.monotonic() + 30
            while not committed_then and time.monotonic() < deadline:
                time.sleep(0.01)
        return real_add(self, sample)

    monkeypatch.setitem(apart.OPS, "calibrate", calibrate)
    monkeypatch.setitem(apart.OPS, "load_reference", load_reference)
    monkeypatch.setattr(writer_cls, "add_encoded", add_encoded)
    with serve(tiny_target_dir, tmp_path) as srv:
        out = capture_from_sglang(
            [srv.url],
            sglang_prepared,
            "train",
            tmp_path / "store",
            LAYERS,
            target=tiny_target_dir,
            calibrate=2,
            concurrency=1,
        )
    assert len(committed_then) == 1 and 2 <= committed_then[0] <= 4  # started with samples left to send
    assert out["store_complete"] and out["engine_numerics"]["n_samples"] == 2
    rec = StoreReader(tmp_path / "store").manifest["engine_numerics"]
    assert rec["n_samples"] == 2 and rec["engine"]["backend"] == "sglang"
    s = verify_store(tmp_path / "store", numbers=3, invariants=False)
    assert s["ok"] and s["numbers"]["engine_limits"]["source"] == "calibration"


@pytest.mark.capture_child
def test_the_transformers_work_runs_in_a_child_process_and_its_refusals_reach_the_capture(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path
):
    # importing transformers, the tokenizer and the reference model would hold the capture loop's GIL for seconds:
    # a spawned child does them (the tokenizer check, the reference, the calibration) and a refusal there must
    # reach the capture as it is

    from eyas.sglang import apart
    from eyas.store.reader import StoreReader

    assert apart.started_in_process is not apart.started_in_thread  # the marker kept the child
    with serve(tiny_target_dir, tmp_path) as srv:
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=2
        )
        assert out["store_complete"] and out["engine_numerics"]["n_samples"] == 2
        assert StoreReader(tmp_path / "store").manifest["engine_numerics"]["n_samples"] == 2
        assert {"tokenizer", "reference"} <= set(out["beside_loop_seconds"])
        refused_for_its_model_type(srv.url, tiny_target_dir, sglang_prepared, tmp_path)
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)


def test_samples_another_capture_committed_meanwhile_are_refused_without_waiting_for_the_tokenizer(
    tiny_target_dir, sglang_prepared, tmp_path, monkeypatch
):
    # between the command's look at the store and its opening, another capture commits one of the samples being sent
    from eyas.data.prepared import PreparedDataset
    from eyas.sglang import client

    real_open = client.open_store
    first = PreparedDataset(sglang_prepared).split("train").ids[0]

    def racing_open(*a, **kw):
        other = real_open(*a, **{**kw, "hold_commits": None})
        other.add_encoded(other.encode(first, torch.zeros(3, len(LAYERS) + 1, other.spec.hidden_size)))
        other.close()
        return real_open(*a, **kw)

    errors = []

    def run():
        try:
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "s", LAYERS, target=tiny_target_dir)
        except EyasError as exc:
            errors.append(str(exc))

    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(client, "open_store", racing_open)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=120)  # the refusal must not wait on the check queued behind the opening
        assert not t.is_alive()
    assert len(errors) == 1 and "were committed while the capture opened the store" in errors[0]


def test_a_loop_that_fails_while_the_store_opens_loads_no_reference_and_leaves_the_store_open_to_a_rerun(
    tiny_target_dir, sglang_prepared, tmp_path, monkeypatch
):
    import time

    import eyas.store.verify
    from eyas.sglang import client

    real_open, real_send, loaded = client.open_store, client.send_all, []

    def slow_open(*a, **kw):
        time.sleep(0.5)
        return real_open(*a, **kw)

    def failing_send(*a, **kw):
        raise RuntimeError("the loop failed")

    real_load = eyas.store.verify._load_reference_target
    monkeypatch.setattr(eyas.store.verify, "_load_reference_target", lambda *a: loaded.append(a) or real_load(*a))
    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(client, "open_store", slow_open)
        monkeypatch.setattr(client, "send_all", failing_send)
        with pytest.raises(RuntimeError, match="the loop failed"):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir)
        assert loaded == []  # the calibration's reference was never needed
        monkeypatch.setattr(client, "send_all", real_send)
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir
        )
    assert out["captured"] == len(LENGTHS) and out["store_complete"] and len(loaded) == 1


def test_crash_mid_run_keeps_verified_samples_and_resumes(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path, monkeypatch
):
    from eyas.store.writer import StoreWriter

    real_add, calls = StoreWriter.add_encoded, []

    def crashing_add(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 4:
            raise KeyboardInterrupt  # the user's Ctrl-C (or any error) in the middle of ingestion
        return real_add(self, *args, **kwargs)

    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(StoreWriter, "add_encoded", crashing_add)
        with pytest.raises(KeyboardInterrupt):
            capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
        monkeypatch.setattr(StoreWriter, "add_encoded", real_add)
        assert list((tmp_path / "dumps").iterdir()) == []
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS)
    assert out["already_committed"] == 3 and out["captured"] == 5 and out["store_complete"]
    check_store_against_reference(tmp_path / "store", sglang_prepared, tiny_model)


def test_eyas_capture_cli_sglang_backend(tiny_target_dir, sglang_prepared, tmp_path):
    """`eyas capture --backend sglang --url ...` is the same capture, from the command line."""
    import json

    from typer.testing import CliRunner

    from eyas.cli import app

    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=16) as srv:
        res = CliRunner().invoke(
            app,
            [
                "capture",
                "--backend",
                "sglang",
                "--url",
                srv.url,
                "--data",
                str(sglang_prepared),
                "--out",
                str(tmp_path / "store"),
                "--aux-layers",
                ",".join(map(str, LAYERS)),
                "--target",
                str(tiny_target_dir),
                "--sglang-concurrency",
                "3",
                "--sglang-calibrate",
                "2",
                "--sglang-procs",
                "2",
            ],
        )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["captured"] == len(LENGTHS) and summary["rejected_count"] == 0
    assert summary["engine_numerics"]["n_samples"] == 2 and summary["procs"] == 2  # the option reached the capture
    bad = CliRunner().invoke(
        app, ["capture", "--backend", "sglang", "--data", str(sglang_prepared), "--out", str(tmp_path / "s2")]
    )
    assert bad.exit_code == 2 and "--url" in bad.output
    neg = CliRunner().invoke(
        app,
        [
            "capture",
            "--backend",
            "sglang",
            "--url",
            "http://127.0.0.1:9",
            "--data",
            str(sglang_prepared),
            "--out",
            str(tmp_path / "s3"),
            "--sglang-calibrate",
            "-1",
        ],
    )
    assert neg.exit_code == 2 and "--sglang-calibrate" in neg.output and not (tmp_path / "s3").exists()
    procs = CliRunner().invoke(
        app,
        ["capture", "--backend", "sglang", "--url", "http://127.0.0.1:9", "--data", str(sglang_prepared)]
        + ["--out", str(tmp_path / "s4"), "--sglang-procs", "-1"],
    )
    assert procs.exit_code == 2 and "--sglang-procs" in procs.output and not (tmp_path / "s4").exists()
