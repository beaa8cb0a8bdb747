"""The stand-in server drives the plugin through its real entry points (plugin.enable and the hook
functions plugin.register_hooks registers), so a broken hook fails the client tests that use it."""

from __future__ import annotations

import pytest

from eyas.sglang import plugin, standin
from eyas.sglang.core import make_rid, read_dump
from eyas.sglang.standin import StandinConfig, StandinServer


def test_ranks_are_set_up_by_plugin_enable_and_hooks_come_from_register_hooks(tiny_target_dir, tmp_path):
    srv = StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path, layer_ids=[2, 3, 4], tp_size=2))
    try:
        # enable turned capture on in each rank's model with Llama's +1 rule and read the layers back
        assert [r.model.model.layers_to_capture for r in srv.runners] == [[2, 3, 4], [2, 3, 4]]
        assert srv.layer_ids == [2, 3, 4]
        assert [st.enabled for st in srv.states] == [True, True]
        assert srv.states[0].writer is not None and srv.states[1].writer is None  # only attention-TP rank 0 writes
        status = srv.server_info()["internal_states"][0]["eyas_capture"]  # through the AFTER hook
        assert status["model"]["ids_passed"] == [1, 2, 3] and status["model"]["layer_id_rule"] == "plus-one"
        hooks = srv.hooks.hooks
        assert hooks[standin.LOGITS_TARGET] == [(standin.HookType.BEFORE, plugin._on_logits)]
        assert hooks[standin.LIVE_BATCH_TARGET] == [(standin.HookType.BEFORE, plugin._on_model_runner_forward)]
    finally:
        srv.httpd.server_close()


def test_the_standin_does_not_start_when_the_plugin_refuses(tiny_target_dir, tmp_path):
    with pytest.raises(plugin.PluginConfigError, match="--pp-size"):
        StandinServer(
            StandinConfig(target=tiny_target_dir, dump_dir=tmp_path, layer_ids=[2, 3, 4], server_args={"pp_size": 2})
        )
    with pytest.raises(plugin.PluginConfigError, match="EYAS_CAPTURE_LAYERS"):
        StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path, layer_ids=[3, 3, 4]))


def test_each_forward_runs_the_registered_hooks_with_each_ranks_state(tiny_target_dir, tmp_path, monkeypatch):
    calls = []
    real_forward, real_logits = plugin._on_model_runner_forward, plugin._on_logits

    def on_forward(runner, forward_batch=None, *a, **k):
        calls.append(("forward", plugin._STATE, forward_batch.rids))
        return real_forward(runner, forward_batch, *a, **k)

    def on_logits(proc, *a, **k):
        calls.append(("logits", plugin._STATE, a[3].rids))
        return real_logits(proc, *a, **k)

    monkeypatch.setattr(plugin, "_on_model_runner_forward", on_forward)
    monkeypatch.setattr(plugin, "_on_logits", on_logits)
    rid = make_rid(13, "hooks")
    with StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path, layer_ids=[2, 3, 4], tp_size=2)) as srv:
        code, _ = srv.generate(
            {"input_ids": list(range(100, 113)), "rid": rid, "sampling_params": {"max_new_tokens": 1}}
        )
    assert code == 200 and plugin._STATE is None  # each rank's state is set for its call only
    s0, s1 = srv.states
    # ModelRunner.forward gets the scheduler's batch (rids); the logits step the graph-replay batch (none)
    assert calls == [("forward", s0, [rid]), ("forward", s1, [rid]), ("logits", s0, None), ("logits", s1, None)]
    assert read_dump(tmp_path / rid).status == "complete"
    assert s0.counts["rids_from_live_batch"] == 1 and s1.counts["live_batches"] == 0  # rank 1 reads nothing


def test_a_burst_of_connections_is_accepted_as_a_real_server_accepts_it(tiny_target_dir, tmp_path):
    # the client connects in bursts (many requests in flight); with the default listen backlog of 5 most
    # bursts of this size lost connections (timeouts or resets) before the stand-in's backlog was raised
    import threading
    import urllib.request

    with StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path)) as srv:
        for _ in range(3):
            n, errors = 128, []
            barrier = threading.Barrier(n)

            def one(barrier=barrier, errors=errors):
                barrier.wait()
                try:
                    urllib.request.urlopen(f"{srv.url}/server_info", timeout=10).read()
                except OSError as exc:
                    errors.append(repr(exc))

            threads = [threading.Thread(target=one) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
