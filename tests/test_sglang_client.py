"""`capture_from_sglang` and `eyas verify-server` end to end, against the stand-in server.

The stand-in (eyas/sglang/standin.py) speaks SGLang's /generate and server-info contract and writes
dumps of real hidden states (a tiny random Llama) through the plugin's own core. These tests are
what CI runs in place of a real SGLang server.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from eyas.errors import CheckFailed, EyasError
from eyas.sglang.client import capture_from_sglang
from eyas.sglang.server import preflight
from eyas.sglang.standin import StandinConfig, StandinServer

LENGTHS = [5, 12, 23, 40, 9, 31, 17, 26]
LAYERS = [2, 3, 4]  # eyas convention, on the 6-layer tiny target (default would be 2, 3, 3 -> repeats)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, smol_tokenizer):
    """8 samples of random ids; samples 5 and 7 share a 20-token prefix with sample 3."""
    from eyas.data.prepared import write_prepared
    from eyas.target import tokenizer_hash

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, 40000, (n,), generator=g) for n in LENGTHS]
    seqs[5][:20] = seqs[3][:20]
    seqs[7][:20] = seqs[3][:20]
    out = tmp_path_factory.mktemp("prep") / "data"
    samples = [(f"s{i}", s.tolist(), [True] * len(s)) for i, s in enumerate(seqs)]
    write_prepared(out, {"train": samples, "eval": []}, {"tokenizer_hash": tokenizer_hash(smol_tokenizer)})
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from eyas.target import load_target

    return load_target(tiny_target_dir)


def serve(tiny_target_dir, tmp_path, **kw) -> StandinServer:
    kw.setdefault("layer_ids", LAYERS)
    return StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path / "dumps", **kw))


def check_store_against_reference(store, prepared, model, n=None):
    n = len(LENGTHS) if n is None else n
    from eyas.data.prepared import PreparedDataset
    from eyas.store.reader import StoreReader
    from eyas.target import forward_capture

    reader = StoreReader(store)
    split = PreparedDataset(prepared).split("train")
    assert sorted(reader.sample_ids) == sorted(split.ids[:n])
    for i in range(n):
        s = split[i]
        aux, final = reader.get(s.id, torch.float32)
        ref_aux, ref_final = forward_capture(model, s.input_ids[None], layer_ids=LAYERS)
        torch.testing.assert_close(aux, ref_aux[0], rtol=1e-2, atol=1e-2)  # stored as bf16
        torch.testing.assert_close(final, ref_final[0], rtol=1e-2, atol=1e-2)


def test_chunked_prefill_batched_capture_ingests_real_states(tiny_target_dir, tiny_model, prepared, tmp_path):
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
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, concurrency=4
        )
        forwards = srv.forwards
    assert out["captured"] == len(LENGTHS) and out["rejected_count"] == 0 and out["store_complete"]
    assert out["tokens"] == sum(LENGTHS) and out["cache_bypass"] == ["none"]
    # the server really did batch several requests and stitch chunks
    assert any(len(f["rids"]) > 1 for f in forwards)
    assert any(p > 0 for f in forwards for p in f["extend_prefix_lens"])
    check_store_against_reference(tmp_path / "store", prepared, tiny_model)
    assert list((tmp_path / "dumps").iterdir()) == []  # every dump deleted once ingested
    # the loop's own rate leaves out the set-up, and the summary says where the loop's time went
    assert 0 < out["loop_s"] < out["elapsed_s"] and out["loop_tokens_per_s"] > out["tokens_per_s"]
    assert sorted(out["seconds_summed"]) == ["check", "dump", "encode", "gate", "ingest", "request"]
    assert fresh_thread_intra_op() == intra_op  # the request threads' one intra-op thread is not left behind
    # every part took time, the wait for a slot too (8 samples, 4 slots: half of them started waiting)
    assert all(v > 0 for v in out["seconds_summed"].values()) and out["procs"] == 0
    # at most the slots' worth of requests at the server at once, on average
    assert 0 < out["in_flight_mean"] <= 4
    phases = out["phase_seconds"]
    assert sorted(phases) == ["calibrate", "close", "loop", "loop_cpu", "setup"] and phases["loop"] == out["loop_s"]
    # each figure rounded to 1 ms, the whole too
    assert sum(phases[k] for k in ("setup", "loop", "calibrate", "close")) <= out["elapsed_s"] + 5 * 5e-4
    setup = out["setup_seconds"]  # the set-up's parts, in order, within it
    assert list(setup) == ["data", "preflight", "probe"] and setup["probe"] > 0
    assert sum(setup.values()) <= phases["setup"] + (len(setup) + 1) * 5e-4  # each figure rounded to 1 ms
    # beside the loop: the store opened (the loop waited for it before it ended), then the calibration's reference
    # loaded (the calibration waited for it)
    beside = out["beside_loop_seconds"]
    assert list(beside) == ["target_identity", "tokenizer", "open_store", "reference"] and beside["reference"] > 0
    opening = sum(beside[k] for k in ("target_identity", "tokenizer", "open_store"))
    assert 0 < opening <= phases["loop"] + 4 * 5e-4
    assert sum(beside.values()) <= phases["loop"] + phases["calibrate"] + 5 * 5e-4
    assert out["store_seconds"]["write"] > 0 and out["store_seconds"]["commit"] > 0


def test_samples_waiting_for_dumps_leave_their_server_slots(tiny_target_dir, prepared, tmp_path, monkeypatch):
    # With 2 slots, a dump wait that lasts until a third request is answered ends only if the samples
    # waiting for dumps gave their slots to the next ones; the server never has more than 2 requests.
    from eyas.sglang import request, server
    from eyas.sglang.sender import SWITCH_INTERVAL_S

    cond = threading.Condition()
    st = {"at_server": 0, "most": 0, "answered": 0, "stuck": 0, "waited": 0}
    intervals, before = set(), sys.getswitchinterval()
    real_http, real_wait = server.http_json, request.dump_appeared

    def http(method, url, body=None, **kw):
        if not url.endswith("/generate") or "probe" in body["rid"]:
            return real_http(method, url, body, **kw)
        with cond:
            st["at_server"] += 1
            st["most"] = max(st["most"], st["at_server"])
        try:
            return real_http(method, url, body, **kw)
        finally:
            with cond:
                st["at_server"] -= 1
                st["answered"] += 1
                cond.notify_all()

    def wait(dump_dir, rid, **kw):
        if "probe" not in rid:
            intervals.add(sys.getswitchinterval())
            with cond:
                st["waited"] += 1
                st["stuck"] += not cond.wait_for(lambda: st["answered"] >= 3, timeout=20)
        return real_wait(dump_dir, rid, **kw)

    monkeypatch.setattr(server, "http_json", http)
    monkeypatch.setattr(request, "dump_appeared", wait)
    with serve(tiny_target_dir, tmp_path) as srv:
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=2, calibrate=0)
    assert st["waited"] == st["answered"] == len(LENGTHS)  # every sample waited here for its dump
    # the request threads ran with the capture's short thread switch interval, and the one before is back
    assert intervals == {SWITCH_INTERVAL_S} and before > SWITCH_INTERVAL_S and sys.getswitchinterval() == before
    assert st["stuck"] == 0 and st["most"] == 2
    assert out["captured"] == len(LENGTHS) and out["rejected_count"] == 0


def test_a_shorter_switch_interval_is_kept_and_every_one_restored():
    from eyas.sglang.sender import SWITCH_INTERVAL_S, short_switch_interval

    before = sys.getswitchinterval()
    try:
        for given, during in ((0.005, SWITCH_INTERVAL_S), (SWITCH_INTERVAL_S / 4, SWITCH_INTERVAL_S / 4)):
            sys.setswitchinterval(given)
            with pytest.raises(RuntimeError), short_switch_interval():
                assert sys.getswitchinterval() == pytest.approx(during)
                raise RuntimeError  # restored after an error too
            assert sys.getswitchinterval() == pytest.approx(given)
    finally:
        sys.setswitchinterval(before)


def test_wait_for_dump_never_pauses_long_between_looks(tmp_path):
    # a dump lands milliseconds after the answer: however long it takes, the pause between looks stays short
    from eyas.sglang.core import CaptureCore, ForwardInfo, make_rid, write_dump
    from eyas.sglang.request import DUMP_POLL_S, wait_for_dump

    rid = make_rid(3, "late")
    sample = CaptureCore().observe(
        ForwardInfo(
            rids=[rid],
            extend_prefix_lens=[0],
            extend_seq_lens=[3],
            aux=torch.zeros(3, 3, 4),
            final_TD=torch.zeros(3, 4),
        )
    )[0]
    pauses = []

    def sleep(s):
        pauses.append(s)
        if len(pauses) == 50:
            write_dump(tmp_path, sample, layer_ids=LAYERS)

    d = wait_for_dump(tmp_path, rid, timeout=3600, sleep=sleep)
    assert d is not None and d.status == "complete" and len(pauses) == 50
    assert pauses[0] == DUMP_POLL_S[0] and max(pauses) == DUMP_POLL_S[1] <= 0.005


def test_ingested_store_passes_eyas_verify(tiny_target_dir, prepared, tmp_path):
    from eyas.store.verify import verify_store

    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=16) as srv:
        # no target given: the server's model_path is a directory here, so the store records it
        capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS)
    summary = verify_store(tmp_path / "store", numbers=3)
    assert summary["ok"] and summary["samples"] == len(LENGTHS)


def test_capture_records_the_engine_numerics_that_verify_holds_the_store_to(tiny_target_dir, prepared, tmp_path):
    from eyas.store.reader import StoreReader
    from eyas.store.verify import verify_store

    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=16) as srv:
        out = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=3
        )
        again = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=3
        )
        plain = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "plain", LAYERS, target=tiny_target_dir, calibrate=0
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


def test_capture_fails_when_the_engine_disagrees_with_the_reference(tiny_target_dir, prepared, tmp_path, monkeypatch):
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
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, calibrate=2
        )
    summary = info.value.summary
    assert summary["store_complete"] and "at layer 2" in summary["engine_numerics"]["problem"]
    with pytest.raises(CheckFailed, match="engine_numerics is refused"):
        verify_store(tmp_path / "store", numbers=1, invariants=False)


def test_radix_cache_needs_a_bypass_and_plugin_salt_or_logprob_work(tiny_target_dir, tiny_model, prepared, tmp_path):
    # samples 5 and 7 share 20 tokens with sample 3, sent before them one at a time: each bypass must keep
    # them whole; the plugin's (auto's choice) asks the server for nothing but the prompt
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=16) as srv:
        with pytest.raises(EyasError, match="--disable-radix-cache"):
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "s0", LAYERS, cache_bypass="none")
        sent = []
        gen = srv.generate
        srv.generate = lambda body: (sent.append(sorted(body)), gen(body))[1]
        for bypass, chosen in (("auto", "plugin"), ("salt", "salt"), ("logprob", "logprob")):
            sent.clear()
            out = capture_from_sglang(
                [srv.url], prepared, "train", tmp_path / f"s-{bypass}", LAYERS, cache_bypass=bypass, concurrency=1
            )
            assert out["rejected_count"] == 0, out["rejected"]
            assert out["cache_bypass"] == [chosen]
            if chosen == "plugin":
                assert all(keys == ["input_ids", "rid", "sampling_params"] for keys in sent), sent[:2]
        # a plugin that reports the cap while SGLang does not run the hooked method: the probe tells, before a
        # sample is sent
        put_back = without_the_prefix_cap(srv)
        with pytest.raises(EyasError, match="did not pass through it .* --sglang-cache-bypass logprob"):
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "s-off", LAYERS, concurrency=1)
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
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "s-old", LAYERS, concurrency=1)
        assert out["cache_bypass"] == ["salt"] and out["rejected_count"] == 0
        with pytest.raises(EyasError, match="does not cap prefix matches .* install this eyas"):
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "s1", LAYERS, cache_bypass="plugin")
    check_store_against_reference(tmp_path / "s-auto", prepared, tiny_model)


def test_the_plugins_bypass_asked_for_on_a_server_without_radix_cache_captures(tiny_target_dir, prepared, tmp_path):
    # nothing to cap there, and SGLang still runs the hook (it computes the cap whatever the cache): no probe check
    with serve(tiny_target_dir, tmp_path) as srv:
        out = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "s", LAYERS, cache_bypass="plugin", concurrency=2, calibrate=0
        )
        caps = srv.server_info()["internal_states"][0]["eyas_capture"]["stats"]["prefix_caps"]
    assert out["cache_bypass"] == ["plugin"] and out["captured"] == len(LENGTHS) and out["rejected_count"] == 0
    assert caps == len(LENGTHS) + 1  # every sample and the probe passed through the hook


def test_prefix_hits_on_a_misreporting_server_are_rejected_then_resumed(
    tiny_target_dir, tiny_model, prepared, tmp_path
):
    # The server caches prefixes but reports the cache as off: samples 5 and 7 (sharing 20 tokens
    # with sample 3, sent before them one at a time) come back with cached_tokens > 0.
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        srv.cfg.disable_radix_cache = False
        info = srv.server_info
        srv.server_info = lambda: {**info(), "disable_radix_cache": True}
        without_the_prefix_cap(srv)
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
    assert out["captured"] == 6 and not out["store_complete"]
    assert sorted(r["id"] for r in out["rejected"]) == ["s5", "s7"]
    assert all("cached_tokens = 20" in r["reason"] for r in out["rejected"])
    # a rerun against an honest server resumes: only the two rejected samples are sent
    with serve(tiny_target_dir, tmp_path) as srv:
        again = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS)
    assert again["already_committed"] == 6 and again["captured"] == 2 and again["store_complete"]
    check_store_against_reference(tmp_path / "store", prepared, tiny_model)


def without_the_prefix_cap(srv):
    """The stand-in with the plugin's cap on eyas requests' prefix match not in effect (as on a server whose
    SGLang stopped calling the hooked method): prefixes are served again. Returns a function putting it back."""
    from eyas.sglang.standin import PREFIX_CAP_TARGET

    hooks = srv.hooks.hooks.pop(PREFIX_CAP_TARGET)
    return lambda: srv.hooks.hooks.__setitem__(PREFIX_CAP_TARGET, hooks)


def hide_the_prefix_cache(srv):
    """The stand-in made to say its radix cache is off and that nothing was cached (cached_tokens 0) while it
    serves prefixes, past the plugin's cap: only the plugin's own check can tell. Returns a function that
    makes the server truthful again (its radix cache on, the cap in effect)."""
    info, gen = srv.server_info, srv.generate
    put_back_the_cap = without_the_prefix_cap(srv)

    def lying_generate(body):
        code, obj = gen(body)
        if code == 200:
            obj["meta_info"]["cached_tokens"] = 0
        return code, obj

    srv.server_info = lambda: {**info(), "disable_radix_cache": True}
    srv.generate = lying_generate

    def truthful():
        srv.server_info, srv.generate = info, gen
        put_back_the_cap()

    return truthful


def test_plugin_rejection_reaches_the_client(tiny_target_dir, prepared, tmp_path):
    # cached_tokens reported as 0 but the forward started at a prefix: only the plugin can tell.
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        truthful = hide_the_prefix_cache(srv)
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
        reasons = {r["id"]: r["reason"] for r in out["rejected"]}
        assert sorted(reasons) == ["s5", "s7"]
        assert all("plugin rejected it" in r and "prefix 20" in r for r in reasons.values())
        # the same server, now described truthfully: the rerun bypasses the cache and completes the store
        truthful()
        again = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS)
    assert again["cache_bypass"] == ["plugin"] and again["captured"] == 2 and again["store_complete"]


def test_preflight_refusals(tiny_target_dir, tmp_path):
    with (
        serve(tiny_target_dir, tmp_path, plugin=False) as srv,
        pytest.raises(EyasError, match="plugin is not loaded.*EYAS_CAPTURE=1"),
    ):
        preflight(srv.url, LAYERS)
    with serve(tiny_target_dir, tmp_path) as srv:
        with pytest.raises(EyasError, match="EYAS_CAPTURE_LAYERS=1,3,5"):
            preflight(srv.url, [1, 3, 5])
        with pytest.raises(EyasError, match="not visible here"):
            preflight(srv.url, LAYERS, dump_dir=tmp_path / "nowhere")
    with (
        serve(tiny_target_dir, tmp_path, speculative_algorithm="EAGLE3") as srv,
        pytest.raises(EyasError, match="speculative"),
    ):
        preflight(srv.url, LAYERS)
    with pytest.raises(EyasError, match="cannot read the server's info"):
        preflight("http://127.0.0.1:9", LAYERS)
    with (
        serve(tiny_target_dir, tmp_path, enable_dp_attention=True) as srv,
        pytest.raises(EyasError, match="DP attention.*--enable-dp-attention"),
    ):
        preflight(srv.url, LAYERS)
    with (
        serve(tiny_target_dir, tmp_path, enable_two_batch_overlap=True) as srv,
        pytest.raises(EyasError, match="--enable-two-batch-overlap"),
    ):
        preflight(srv.url, LAYERS)


def test_preflight_refuses_a_plugin_blind_to_graph_replay_unless_the_graph_is_off(tiny_target_dir, tmp_path):
    with serve(tiny_target_dir, tmp_path) as srv:
        info = srv.server_info

        def old_plugin(**extra):
            out = info()
            out["internal_states"][0]["eyas_capture"]["plugin_version"] = "1"
            return {**out, **extra}

        srv.server_info = old_plugin
        with pytest.raises(EyasError, match="restart it with --disable-prefill-cuda-graph"):
            preflight(srv.url, LAYERS)
        srv.server_info = lambda: old_plugin(disable_prefill_cuda_graph=True)
        assert preflight(srv.url, LAYERS).status["plugin_version"] == "1"
        srv.server_info = info
        assert preflight(srv.url, LAYERS).status["plugin_version"] == "3"


def test_preflight_and_verify_server_refuse_prefill_cp_and_a_piecewise_prefill_graph(tiny_target_dir, tmp_path):
    # what /server_info reports (SGLang's resolved ServerArgs): a server whose plugin let them through (older
    # plugins read the raw fields, which from 0.5.19 miss what SGLang resolved) is refused before any request
    with serve(tiny_target_dir, tmp_path) as srv:
        info = srv.server_info
        srv.server_info = lambda: {**info(), "enable_prefill_cp": True}
        with pytest.raises(
            EyasError,
            match=r"^--url \S+: the server has enable_prefill_cp on: [^\n]*"
            r"Restart it without --enable-prefill-cp$",
        ):
            preflight(srv.url, LAYERS)
        with pytest.raises(EyasError, match="--enable-prefill-cp"):
            _verify(srv)
        piecewise = {"prefill": {"backend": "tc_piecewise"}, "decode": {"backend": "full"}}
        srv.server_info = lambda: {**info(), "cuda_graph_config": piecewise}
        with pytest.raises(EyasError, match=r"tc_piecewise[^\n]*--disable-prefill-cuda-graph[^\n]*$"):
            preflight(srv.url, LAYERS)
        with pytest.raises(EyasError, match="tc_piecewise"):
            _verify(srv)
        srv.server_info = lambda: {
            **info(),
            "enable_prefill_cp": False,
            "cuda_graph_config": {"prefill": {"backend": "breakable"}},
        }
        assert preflight(srv.url, LAYERS).status["enabled"]


def test_the_prefill_graph_is_on_when_the_resolved_config_says_so_not_by_cuda_default(tiny_target_dir, tmp_path):
    # Off CUDA the prefill graph is not on by default (0.5.15-0.5.21: tc_piecewise, turned off on HIP/NPU/XPU/CPU
    # by SGLang's cascade; 0.5.22+: disabled), though disable_prefill_cuda_graph stays False: the resolved
    # cuda_graph_config decides whether an older plugin, blind to graph-replay batches, can capture
    with serve(tiny_target_dir, tmp_path) as srv:
        info = srv.server_info

        def old_plugin(backend):
            out = info()
            out["internal_states"][0]["eyas_capture"]["plugin_version"] = "1"
            return {**out, "disable_prefill_cuda_graph": False, "cuda_graph_config": {"prefill": {"backend": backend}}}

        srv.server_info = lambda: old_plugin("disabled")
        assert preflight(srv.url, LAYERS).status["plugin_version"] == "1"
        for backend in ("breakable", "full"):
            srv.server_info = lambda backend=backend: old_plugin(backend)
            with pytest.raises(EyasError, match="restart it with --disable-prefill-cuda-graph"):
                preflight(srv.url, LAYERS)
    # and lost request ids are blamed on the graph only where it runs
    from eyas.sglang.server import prefill_graph_on, request_ids_lost

    before, after = {"live_batches": 0, "rids_from_live_batch": 0}, {"live_batches": 3, "rids_from_live_batch": 0}
    assert request_ids_lost(before, after, {"cuda_graph_config": {"prefill": {"backend": "breakable"}}})
    assert not request_ids_lost(before, after, {"cuda_graph_config": {"prefill": {"backend": "disabled"}}})
    assert not prefill_graph_on({"disable_prefill_cuda_graph": True})  # servers that report no config
    assert prefill_graph_on({"disable_prefill_cuda_graph": False})


def test_legacy_info_path_retries_and_data_parallel(tiny_target_dir, prepared, tmp_path):
    with (
        serve(tiny_target_dir, tmp_path, legacy_info_path=True, fail_first=3) as a,
        serve(tiny_target_dir, tmp_path) as b,
    ):
        out = capture_from_sglang(
            [a.url, b.url], prepared, "train", tmp_path / "store", None, backoff_s=0.01, concurrency=2
        )
        assert a.generate_calls > 3 and b.generate_calls > 0  # both servers got work
    assert out["layer_ids"] == LAYERS and out["captured"] == len(LENGTHS) and out["retries"] == 3


def test_resume_after_a_crash_and_stale_dumps(tiny_target_dir, tiny_model, prepared, tmp_path):
    from eyas.sglang.client import _job_tag

    with serve(tiny_target_dir, tmp_path) as srv:
        first = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, limit=3, target=tiny_target_dir
        )
        assert first["captured"] == 3
        # a crashed run left a dump of this job behind; the next run removes it
        stale = tmp_path / "dumps" / f"eyas.9.{_job_tag(tmp_path / 'store', 'train')}-4-0"
        stale.mkdir()
        (stale / "meta.json").write_text("{}")
        with pytest.raises(EyasError, match="different dtype"):
            capture_from_sglang(
                [srv.url], prepared, "train", tmp_path / "store", LAYERS, dtype="fp32", target=tiny_target_dir
            )
        assert not stale.exists()
        second = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir)
    assert second["already_committed"] == 3 and second["captured"] == 5 and second["store_complete"]
    check_store_against_reference(tmp_path / "store", prepared, tiny_model)


def test_a_slow_store_write_does_not_stop_sending(tiny_target_dir, prepared, tmp_path, monkeypatch):
    # the first sample's write blocks until the server has seen more samples: a sender that stored on its
    # own thread would never send them, and the write would give up waiting
    import time

    from eyas.store.writer import StoreWriter

    real_add, sent_meanwhile = StoreWriter.add_encoded, []

    def slow_first(self, encoded):
        if not sent_meanwhile:
            n0, deadline = len(srv.forwards), time.monotonic() + 20
            while len(srv.forwards) < n0 + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            sent_meanwhile.append(len(srv.forwards) - n0)
        return real_add(self, encoded)

    with serve(tiny_target_dir, tmp_path) as srv:
        monkeypatch.setattr(StoreWriter, "add_encoded", slow_first)
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
    assert sent_meanwhile[0] >= 3 and out["captured"] == len(LENGTHS) and out["store_complete"]


def test_the_store_opens_beside_the_first_samples_and_its_refusal_stops_the_capture(
    tiny_target_dir, tiny_model, prepared, tmp_path, monkeypatch
):
    # the store's opening (the target's identity, the tokenizer check, the manifest) waits here until the server
    # has answered every sample: a capture that opened the store before sending would never get there
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
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, concurrency=2
        )
        assert answered == [len(LENGTHS)] and out["captured"] == len(LENGTHS) and out["store_complete"]
        check_store_against_reference(tmp_path / "store", prepared, tiny_model)
        # a store that cannot be opened (the data tokenised by another tokenizer) stops the capture with its own
        # error, samples sent meanwhile or not, and nothing is written
        monkeypatch.setattr("eyas.target.tokenizer_hash", lambda tok: "f" * 64)
        for procs in (0, 2):
            with pytest.raises(EyasError, match="another tokenizer"):
                capture_from_sglang(
                    [srv.url], prepared, "train", tmp_path / f"s{procs}", LAYERS, target=tiny_target_dir, procs=procs
                )
            assert not (tmp_path / f"s{procs}").exists()
    assert list((tmp_path / "dumps").iterdir()) == []


def test_a_loop_that_fails_while_the_store_opens_loads_no_reference_and_leaves_the_store_open_to_a_rerun(
    tiny_target_dir, prepared, tmp_path, monkeypatch
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
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir)
        assert loaded == []  # the calibration's reference was never needed
        monkeypatch.setattr(client, "send_all", real_send)
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir)
    assert out["captured"] == len(LENGTHS) and out["store_complete"] and len(loaded) == 1


def test_the_states_held_between_servers_and_a_slow_disk_stay_within_the_budget(
    tiny_target_dir, tiny_model, prepared, tmp_path, monkeypatch
):
    # every store write is slow: unbounded, every sample in flight is held at once; with a budget of about
    # three samples' states no more is held, every sample is still stored, and so is one larger than the budget
    import json
    import time

    from eyas.store.writer import StoreWriter

    real_add = StoreWriter.add_encoded

    def slow(self, encoded):
        time.sleep(0.05)
        return real_add(self, encoded)

    monkeypatch.setattr(StoreWriter, "add_encoded", slow)
    hidden = json.loads((tiny_target_dir / "config.json").read_text())["hidden_size"]
    row = (len(LAYERS) + 1) * hidden * 4  # a token's states as the stand-in sends them (the tiny target in fp32)
    budget = 3 * 26 * row
    runs = {}
    with serve(tiny_target_dir, tmp_path) as srv:
        for name, memory in (("free", 10 * sum(LENGTHS) * row), ("bound", budget), ("tiny", 1)):
            runs[name] = capture_from_sglang(
                [srv.url], prepared, "train", tmp_path / name, LAYERS, concurrency=4, memory_bytes=memory
            )
    assert runs["free"]["memory"]["peak_bytes"] == sum(LENGTHS) * row  # all 8 samples sent at once
    assert runs["bound"]["memory"] == {"limit_bytes": budget, "peak_bytes": runs["bound"]["memory"]["peak_bytes"]}
    assert max(LENGTHS) * row <= runs["bound"]["memory"]["peak_bytes"] <= budget
    assert runs["tiny"]["memory"]["peak_bytes"] == max(LENGTHS) * row  # one sample at a time, the largest too
    for name in ("bound", "tiny"):
        assert runs[name]["captured"] == len(LENGTHS) and runs[name]["store_complete"]
        check_store_against_reference(tmp_path / name, prepared, tiny_model)


def test_crash_mid_run_keeps_verified_samples_and_resumes(tiny_target_dir, tiny_model, prepared, tmp_path, monkeypatch):
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
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
        monkeypatch.setattr(StoreWriter, "add_encoded", real_add)
        assert list((tmp_path / "dumps").iterdir()) == []
        out = capture_from_sglang([srv.url], prepared, "train", tmp_path / "store", LAYERS)
    assert out["already_committed"] == 3 and out["captured"] == 5 and out["store_complete"]
    check_store_against_reference(tmp_path / "store", prepared, tiny_model)


def _verify(srv, **kw) -> dict:
    """`eyas verify-server` against `srv`; a typer command, so every option is passed (these defaults, then `kw`)."""
    from eyas.commands.verify_server import verify_server

    args = dict(
        url=srv.url,
        layers=None,
        dump_dir=None,
        cache_bypass="auto",
        target=None,
        prompt_tokens=24,
        tolerance=None,
        device="cpu",
        seed=0,
        dump_wait_s=10.0,
    )
    return verify_server(**{**args, **kw})


def test_verify_server_passes_and_compares_numbers(tiny_target_dir, tmp_path):
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=32) as srv:
        out = _verify(srv, target=str(tiny_target_dir), prompt_tokens=None)
    assert out["ok"] and out["cache_bypass"] == "plugin"
    assert out["checks"]["unique_prompt"]["tokens"] == 51 and out["checks"]["unique_prompt"]["pieces"] == 2
    assert out["checks"]["batched"]["ok"] and out["checks"]["batched"]["tokens"] == [51, 25, 17, 10]
    counters = out["checks"]["plugin_counters"]
    # every forward went through the graph-replay batch (no rids) and took the scheduler's ids
    assert counters["ok"] and counters["unmatched_forwards"] == 0
    assert counters["rids_from_live_batch"] == counters["live_batches"] > 0
    nums = out["checks"]["numbers"]
    assert nums["ok"] and max(nums["mean_rel_l2"].values()) < 1e-4


def test_verify_server_sizes_its_prompts_to_the_context_length(tiny_target_dir, tmp_path):
    """A chunk as long as the context (SmolLM2: 8192 and 8192 on a default SGLang server, which reports
    context_length None) made the default probe 1.5 chunks long and every request an HTTP 400 (the first
    live run, 2026-12-01). The model's own limit (2048 for the tiny target) bounds the probe."""
    with serve(tiny_target_dir, tmp_path, chunked_prefill_size=2048) as srv:
        assert srv.server_info()["context_length"] is None
        out = _verify(srv, prompt_tokens=None)
        assert out["ok"] and out["checks"]["unique_prompt"]["tokens"] == 2048 - 8
        # a --context-length given to the server wins over the model's limit
        srv.cfg.context_length = 300
        out = _verify(srv, prompt_tokens=None)
    assert out["ok"] and out["checks"]["unique_prompt"]["tokens"] == 300 - 8


def test_verify_server_fails_on_a_server_that_serves_prefixes(tiny_target_dir, tmp_path):
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        info = srv.server_info
        srv.server_info = lambda: {**info(), "disable_radix_cache": True}
        without_the_prefix_cap(srv)
        with pytest.raises(CheckFailed) as exc:
            _verify(srv, prompt_tokens=64)
    checks = exc.value.summary["checks"]
    assert checks["unique_prompt"]["ok"] and not checks["shared_prefix"]["ok"]
    assert "cached_tokens" in checks["shared_prefix"]["reason_b"]


def test_verify_server_names_the_flag_when_replay_batches_cannot_be_matched(tiny_target_dir, tmp_path, monkeypatch):
    # a graph runner that rebuilds the batch with lengths the plugin cannot match to the scheduler's
    from eyas.sglang import standin

    real = standin.replay_batch

    def foreign(live, *, bucket):
        fb = real(live, bucket=bucket)
        fb.extend_seq_lens_cpu = list(fb.extend_seq_lens_cpu) + [0]
        return fb

    monkeypatch.setattr(standin, "replay_batch", foreign)
    with serve(tiny_target_dir, tmp_path) as srv, pytest.raises(CheckFailed) as exc:
        _verify(srv)
    checks = exc.value.summary["checks"]
    assert "--disable-prefill-cuda-graph" in checks["unique_prompt"]["reason"]
    assert not checks["plugin_counters"]["ok"] and "--disable-prefill-cuda-graph" in checks["plugin_counters"]["fix"]
    assert checks["plugin_counters"]["unmatched_forwards"] >= 1


def run_model_runner_forward_elsewhere(monkeypatch, *, old_plugin: bool) -> None:
    """The plugin's ModelRunner.forward hook runs on another thread than the logits step: it sees the
    scheduler's batches but cannot give the rid-less replay batches their ids. `old_plugin`: a status
    without the `rid_less_forwards` counter (eyas before it was added)."""
    from eyas.sglang import plugin

    real, real_status = plugin._State.on_model_runner_forward, plugin._State.status

    def elsewhere(self, fb):
        t = threading.Thread(target=real, args=(self, fb))
        t.start(), t.join()

    def status(self):
        st = real_status(self)
        st["stats"].pop("rid_less_forwards")
        return st

    monkeypatch.setattr(plugin._State, "on_model_runner_forward", elsewhere)
    if old_plugin:
        monkeypatch.setattr(plugin._State, "status", status)


@pytest.mark.parametrize("old_plugin", [False, True])
def test_verify_server_names_the_flag_when_replay_batches_find_no_scheduler_batch(
    tiny_target_dir, tmp_path, monkeypatch, old_plugin
):
    # no dump at all (not even a rejected one): the counters must name the flag, not the dump directory
    run_model_runner_forward_elsewhere(monkeypatch, old_plugin=old_plugin)
    with serve(tiny_target_dir, tmp_path) as srv, pytest.raises(CheckFailed) as exc:
        _verify(srv, dump_wait_s=0.3)
    checks = exc.value.summary["checks"]
    assert "no dump appeared" in checks["unique_prompt"]["reason"]
    counters = checks["plugin_counters"]
    assert not counters["ok"] and "--disable-prefill-cuda-graph" in counters["fix"]
    assert "--disable-prefill-cuda-graph" in str(exc.value)
    assert counters["live_batches"] > 0 and counters["rids_from_live_batch"] == 0
    assert counters["rid_less_forwards"] == (0 if old_plugin else counters["live_batches"])


def test_verify_server_passes_an_older_plugin_whose_replay_batches_keep_their_rids(
    tiny_target_dir, tmp_path, monkeypatch
):
    # a graph backend that copies rids (no ids taken from the scheduler's batches) and a status without
    # rid_less_forwards: with every dump present, the counters must not be read as lost request ids
    from eyas.sglang import plugin, standin

    real, real_status = standin.replay_batch, plugin._State.status

    def with_rids(live, *, bucket):
        fb = real(live, bucket=bucket)
        fb.rids = list(live.rids)
        return fb

    def status(self):
        st = real_status(self)
        st["stats"].pop("rid_less_forwards")
        return st

    monkeypatch.setattr(standin, "replay_batch", with_rids)
    monkeypatch.setattr(plugin._State, "status", status)
    with serve(tiny_target_dir, tmp_path) as srv:
        out = _verify(srv)
    counters = out["checks"]["plugin_counters"]
    assert out["ok"] and counters["ok"] and counters["fix"] == ""
    assert counters["live_batches"] > 0 and counters["rids_from_live_batch"] == 0


def test_verify_server_numbers_catch_an_off_by_one_layer_convention(tiny_target_dir, tmp_path, monkeypatch):
    # A server that captures the OUTPUT of the named layers (SGLang's convention) while claiming
    # eyas's (their input): shapes, counts and positions all pass; only the numbers can tell.
    import eyas.target

    real = eyas.target.forward_capture

    def shifted(model, ids, mask=None, *, layer_ids):
        return real(model, ids, mask, layer_ids=[i + 1 for i in layer_ids])

    monkeypatch.setattr(eyas.target, "forward_capture", shifted)
    with serve(tiny_target_dir, tmp_path) as srv, pytest.raises(CheckFailed) as exc:
        _verify(srv, layers="2,3,4", target=str(tiny_target_dir), prompt_tokens=40)
    checks = exc.value.summary["checks"]
    assert checks["unique_prompt"]["ok"] and checks["shared_prefix"]["ok"] and not checks["numbers"]["ok"]
    assert min(checks["numbers"]["mean_rel_l2"][k] for k in ("aux2", "aux3", "aux4")) > 0.05
    assert checks["numbers"]["mean_rel_l2"]["final"] < 1e-4  # the final state is still right


def test_check_sample_names_every_fault(tmp_path):
    from eyas.sglang.core import CaptureCore, ForwardInfo, make_rid, read_dump, write_dump
    from eyas.sglang.request import check_sample

    L, ids = 6, torch.arange(10, 16)
    g = torch.Generator().manual_seed(0)
    aux, final = torch.randn(L, 3, 4, generator=g), torch.randn(L, 4, generator=g)

    def dump(pieces=((0, 6),), ids_=ids, aux_=aux):
        rid, cc = make_rid(L, f"t{len(list(tmp_path.iterdir()))}"), CaptureCore()
        for a, n in pieces:
            out = cc.observe(
                ForwardInfo(
                    rids=[rid],
                    extend_prefix_lens=[a],
                    extend_seq_lens=[n],
                    aux=aux_[a : a + n],
                    final_TD=final[a : a + n],
                    positions_T=torch.arange(a, a + n),
                    input_ids_T=ids_[a : a + n],
                )
            )
        return read_dump(write_dump(tmp_path, out[0], layer_ids=LAYERS))

    ok_meta = {"prompt_tokens": L, "cached_tokens": 0}
    good = dump(((0, 4), (4, 2)))
    assert check_sample(ids, ok_meta, good, layer_ids=LAYERS, hidden_size=4) is None
    faults = {
        "cached_tokens = 3": (ids, {"prompt_tokens": L, "cached_tokens": 3}, good, LAYERS),
        "prompt_tokens = 5": (ids, {"prompt_tokens": 5, "cached_tokens": 0}, good, LAYERS),
        "no dump appeared": (ids, ok_meta, None, LAYERS),
        "plugin rejected it": (ids, ok_meta, dump(((2, 4),)), LAYERS),
        "dump has layers": (ids, ok_meta, good, [1, 2, 3]),
        "token ids differ": (ids + 1, ok_meta, good, LAYERS),
        "non-finite": (ids, ok_meta, dump(aux_=aux.clone().index_fill_(0, torch.tensor([3]), float("nan"))), LAYERS),
    }
    for want, (i, m, d, lay) in faults.items():
        assert want in check_sample(i, m, d, layer_ids=lay, hidden_size=4), want
    assert "hidden size 4" in check_sample(ids, ok_meta, good, layer_ids=LAYERS, hidden_size=8)
    gap = read_dump(good.path)
    gap.meta["positions_covered"] = [[0, 4], [5, 6]]
    assert "positions 4..4 missing" in check_sample(ids, ok_meta, gap, layer_ids=LAYERS, hidden_size=4)
    short = read_dump(good.path)
    short.meta["num_tokens"] = 5
    assert "dump holds 5 tokens" in check_sample(ids, ok_meta, short, layer_ids=LAYERS, hidden_size=4)


def test_eyas_capture_cli_sglang_backend(tiny_target_dir, prepared, tmp_path):
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
                str(prepared),
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
        app, ["capture", "--backend", "sglang", "--data", str(prepared), "--out", str(tmp_path / "s2")]
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
            str(prepared),
            "--out",
            str(tmp_path / "s3"),
            "--sglang-calibrate",
            "-1",
        ],
    )
    assert neg.exit_code == 2 and "--sglang-calibrate" in neg.output and not (tmp_path / "s3").exists()
    procs = CliRunner().invoke(
        app,
        ["capture", "--backend", "sglang", "--url", "http://127.0.0.1:9", "--data", str(prepared)]
        + ["--out", str(tmp_path / "s4"), "--sglang-procs", "-1"],
    )
    assert procs.exit_code == 2 and "--sglang-procs" in procs.output and not (tmp_path / "s4").exists()


def test_probe_blames_the_missing_batch_hook_not_the_dump_dir(tiny_target_dir, tmp_path, monkeypatch):
    # A plugin whose ModelRunner.forward hook never ran sees replay batches without rids and writes
    # nothing; the probe must say so and name the flag, not send the user to the dump directory.
    from eyas.sglang import plugin
    from eyas.sglang.request import probe

    monkeypatch.setattr(plugin._State, "on_model_runner_forward", lambda self, fb: None)
    with serve(tiny_target_dir, tmp_path) as srv:
        plan = preflight(srv.url, LAYERS)
        with pytest.raises(EyasError, match="saw no scheduler batch.*--disable-prefill-cuda-graph"):
            probe(plan, torch.arange(100, 120), layer_ids=LAYERS, tag="probe", dump_wait_s=1.0, max_retries=0)
        assert not list((tmp_path / "dumps").iterdir())


@pytest.mark.parametrize("old_plugin", [False, True])
def test_probe_names_the_flag_when_replay_batches_find_no_scheduler_batch(
    tiny_target_dir, tmp_path, monkeypatch, old_plugin
):
    # the plugin saw scheduler batches but took no request ids from them: the flag, not the dump directory
    from eyas.sglang.request import probe

    run_model_runner_forward_elsewhere(monkeypatch, old_plugin=old_plugin)
    with serve(tiny_target_dir, tmp_path) as srv:
        plan = preflight(srv.url, LAYERS)
        with pytest.raises(EyasError, match="could not find.*--disable-prefill-cuda-graph") as exc:
            probe(plan, torch.arange(100, 120), layer_ids=LAYERS, tag="probe", dump_wait_s=1.0, max_retries=0)
        assert "run the client on the host" not in str(exc.value)
        assert ("rid_less_forwards" in str(exc.value)) != old_plugin
        assert not list((tmp_path / "dumps").iterdir())


@contextlib.contextmanager
def plain_http_server(directory):
    """A stock `python -m http.server` on a free port: what a wrong --url often reaches (404 pages in HTML)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_wrong_port_serving_html_gets_a_one_line_error(tmp_path):
    # a web server on the wrong port answers every path with a whole HTML page: one line, no page, on every path
    from eyas.sglang.server import TransientHTTPError, http_json

    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "server_info").write_text("<html><body>\n<h1>not json</h1>\n</body></html>\n")
    with plain_http_server(tmp_path / "www") as url:
        with pytest.raises(EyasError) as exc:
            preflight(url + "/nothing-here", LAYERS)
        msg = str(exc.value)
        assert "\n" not in msg and "<" not in msg and len(msg) < 300, msg
        assert "HTTP 404 from /server_info" in msg and "not an SGLang server" in msg
        with pytest.raises(TransientHTTPError, match="HTTP 501 from .*/generate") as exc:
            http_json("POST", f"{url}/generate", {"text": "x"})  # 501 Unsupported method, as an HTML page
        assert "\n" not in str(exc.value) and "<" not in str(exc.value) and len(str(exc.value)) < 300
        with pytest.raises(EyasError, match="not JSON") as exc:
            preflight(url, LAYERS)  # a 200 answer that is a page, not JSON
        assert "\n" not in str(exc.value) and "<" not in str(exc.value)


def test_answers_are_read_without_their_logprob_lists_and_otherwise_as_json_reads_them():
    import json

    from eyas.sglang.server import parse_answer

    meta = {"id": "eyas.4.x", "prompt_tokens": 4, "cached_tokens": 0, "finish_reason": {"type": "length", "length": 1}}
    lists = {
        "input_token_logprobs": [[None, 5, None], [-1.25, 9, None], [-0.5, 2, None], [-1e-05, 7, None]],
        "output_token_logprobs": [[-0.125, 3, None]],
    }
    answer = {"text": "", "output_ids": [3], "meta_info": {**meta, **lists, "e2e_latency": 0.01}}
    for dumps in (json.dumps, lambda o: json.dumps(o, separators=(",", ":"))):  # SGLang's orjson writes no spaces
        got = parse_answer(dumps(answer).encode())
        assert got["meta_info"] == {
            **meta,
            "input_token_logprobs": None,
            "output_token_logprobs": None,
            "e2e_latency": 0.01,
        }
        assert got["output_ids"] == [3]
    # anything but lists of numbers is read whole: token texts, top logprobs, empty lists
    for odd in (
        {"input_token_logprobs": [[-1.5, 5, "he"], [-0.5, 2, "llo"]]},
        {"input_token_logprobs": [[[-1.5, 5, None]], [[-0.5, 2, None]]]},
        {"input_token_logprobs": [], "output_token_logprobs": []},
    ):
        raw = json.dumps({"meta_info": {**meta, **odd}}, separators=(",", ":")).encode()
        assert parse_answer(raw) == json.loads(raw), odd
    # the key's name inside a string (its quotes escaped) is text, not a key
    text = 'say "input_token_logprobs":[[1]]'
    raw = json.dumps({"text": text, "meta_info": {**lists}}, separators=(",", ":")).encode()
    assert parse_answer(raw) == {
        "text": text,
        "meta_info": {"input_token_logprobs": None, "output_token_logprobs": None},
    }
    raw = raw.replace(b'say \\"', b'say "')  # an unescaped one (not JSON a server writes): named twice, read whole
    with pytest.raises(ValueError):
        parse_answer(raw)
    assert parse_answer(b'{"error": "bad"}') == {"error": "bad"}
    assert parse_answer(b"null") is None


def test_the_logprob_bypass_answer_carries_sglangs_lists_and_the_capture_reads_past_them(tiny_target_dir, tmp_path):
    from eyas.common import http_request
    from eyas.sglang.request import build_request
    from eyas.sglang.server import parse_answer

    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        body = build_request(list(range(100, 130)), "eyas.30.lp", "logprob")
        raw = http_request("POST", f"{srv.url}/generate", body, timeout=60)
    import json

    whole = json.loads(raw)["meta_info"]
    assert len(whole["input_token_logprobs"]) == 30 and whole["input_token_logprobs"][0][:2] == [None, 100]
    assert [e[1] for e in whole["input_token_logprobs"]] == list(range(100, 130))
    meta = parse_answer(raw)["meta_info"]
    assert meta["input_token_logprobs"] is None and meta["prompt_tokens"] == 30 and meta["cached_tokens"] == 0


def spools() -> list[Path]:
    """The capture workers' spool directories there are (--sglang-procs)."""
    import tempfile

    return sorted(Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()).glob("eyas-spool-*"))


def test_capture_processes_store_the_same_states_and_reject_what_one_process_rejects(
    tiny_target_dir, tiny_model, prepared, tmp_path, monkeypatch
):
    # --sglang-procs: worker processes send, read, check and encode, this one stores; the store must be the
    # reference's, and a sample the checks refuse must be refused there too (here the plugin's rejection of a
    # prompt served from a prefix, which only the dump can tell)
    import eyas.sglang.client as client
    import eyas.sglang.sender as sender

    class NoSender:  # this process must send nothing: the spawned workers import their own, unpatched
        def __init__(self, **kw):
            raise AssertionError("the parent process sent the samples itself")

    monkeypatch.setattr(sender, "Sender", NoSender)
    before = spools()
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=8) as srv:
        truthful = hide_the_prefix_cache(srv)
        out = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, concurrency=3, procs=2, calibrate=0
        )
        assert sorted(r["id"] for r in out["rejected"]) == ["s5", "s7"]
        assert all("plugin rejected it" in r["reason"] for r in out["rejected"])
        assert out["captured"] == len(LENGTHS) - 2 and out["memory"]["peak_bytes"] > 0 and out["procs"] == 2
        truthful()
        spooled = []

        class Recorded(client.Workers):
            def __init__(self, *a):
                super().__init__(*a)
                spooled.append(self.spooled)

        monkeypatch.setattr(client, "Workers", Recorded)
        # the tightest memory: one sample at a time in each worker and one waiting in the spool, still through
        again = capture_from_sglang(
            [srv.url], prepared, "train", tmp_path / "store", LAYERS, target=tiny_target_dir, procs=2, memory_bytes=1
        )
    assert spooled == [1] and again["memory"]["limit_bytes"] == 1
    assert again["captured"] == 2 and again["store_complete"] and again["rejected_count"] == 0
    assert sorted(again["seconds_summed"]) == ["check", "dump", "encode", "gate", "ingest", "request"]
    check_store_against_reference(tmp_path / "store", prepared, tiny_model)
    assert list((tmp_path / "dumps").iterdir()) == [] and spools() == before  # no dump or spooled rows left
    with pytest.raises(EyasError, match="--sglang-procs"):
        capture_from_sglang([srv.url], prepared, "train", tmp_path / "s2", LAYERS, procs=-1)


def test_a_capture_worker_that_fails_ends_the_capture_with_its_error(tiny_target_dir, prepared, tmp_path, monkeypatch):
    # a worker process that cannot go on (here: its prepared split is not there) stops the capture with its
    # reason; and a set-up that fails after the workers started ends them: neither they nor the spool outlive it
    import multiprocessing
    import types

    import numpy

    from eyas.sglang import client
    from eyas.sglang.sender import StateBudget

    before = spools()
    with serve(tiny_target_dir, tmp_path) as srv:
        plans, layer_ids, _ = client._reach_servers(
            [srv.url],
            LAYERS,
            torch.arange(100, 116),
            job="j",
            laps=client._Laps(0.0),
            cache_bypass="auto",
            dump_dir=None,
            probe_kw={"dump_wait_s": 5.0, "max_retries": 0, "backoff_s": 0.1},
        )

        def run_two_workers(source: str, todo: list[int], kill_second: bool = False) -> None:
            workers = client.Workers(2, 2, StateBudget(1 << 20), 8, numpy.array([10]))
            try:
                if kill_second:
                    workers.procs[1].kill()
                    workers.procs[1].join()
                workers.run(
                    plans,
                    types.SimpleNamespace(root=source, name="train"),  # a split as the workers find it
                    todo,
                    None,  # the store's writer, tally and progress: not reached
                    None,
                    None,
                    encode=None,
                    concurrency=2,
                    budget=StateBudget(1 << 20),
                    row_bytes=1,
                    rid_tag="t",
                    layer_ids=layer_ids,
                    max_retries=0,
                    backoff_s=0.1,
                    request_timeout_s=5.0,
                    dump_wait_s=5.0,
                )
            finally:
                workers.close()

        with pytest.raises(RuntimeError, match=r"capture worker \d: .*no-such-prepared"):
            run_two_workers(str(tmp_path / "no-such-prepared"), [0, 1, 2])
        assert multiprocessing.active_children() == [] and spools() == before
        # a worker killed outright (the kernel's OOM killer) cannot say so: its silence is an error too (nothing
        # to send here: worker 0 ends at once, worker 1 is gone)
        with pytest.raises(RuntimeError, match=r"capture worker 1 ended without a word \(exit -9\)"):
            run_two_workers(str(prepared), [], kill_second=True)
        assert multiprocessing.active_children() == [] and spools() == before
        started = []

        class Counted(client.Workers):
            def __init__(self, *a):
                super().__init__(*a)
                started.append(len(self.procs))

        monkeypatch.setattr(client, "Workers", Counted)
        (tmp_path / "taken").mkdir()
        (tmp_path / "taken" / "notes.txt").write_text("not a store")
        with pytest.raises(EyasError, match="taken"):
            capture_from_sglang([srv.url], prepared, "train", tmp_path / "taken", LAYERS, procs=2)
    assert started == [2] and multiprocessing.active_children() == [] and spools() == before
    assert (tmp_path / "taken" / "notes.txt").read_text() == "not a store"


def test_spools_of_dead_captures_are_removed_and_workers_end_with_their_parent(tmp_path):
    # a capture killed before its clean-up leaves its spool: the next one removes it, and only it; a worker
    # whose parent is gone ends itself instead of waiting for a task forever
    import subprocess
    import sys

    from eyas.sglang.workers import remove_dead_spools

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"eyas-spool-{int(gone.stdout)}-abc"
    live = tmp_path / f"eyas-spool-{os.getpid()}-xyz"
    other = tmp_path / "eyas-spool-notes"
    for d in (dead, live, other):
        d.mkdir()
        (d / "1-1").write_bytes(b"rows")
    remove_dead_spools(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
    ended = subprocess.run(
        [sys.executable, "-c", "from eyas.sglang.client import _exit_with_parent; _exit_with_parent(-1, 0.01)"],
        timeout=60,
    )
    assert ended.returncode == 1
