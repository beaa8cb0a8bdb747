"""`eyas verify-server` (eyas/commands/verify_server.py) against the stand-in server."""

from __future__ import annotations

import pytest

from eyas.errors import CheckFailed
from tests.sglang_helpers import (
    run_model_runner_forward_elsewhere,
    serve,
    verify_server_on,
    without_the_prefix_cap,
)


def test_verify_server_passes_and_compares_numbers(tiny_target_dir, tmp_path):
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False, chunked_prefill_size=32) as srv:
        out = verify_server_on(srv, target=str(tiny_target_dir), prompt_tokens=None)
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
        out = verify_server_on(srv, prompt_tokens=None)
        assert out["ok"] and out["checks"]["unique_prompt"]["tokens"] == 2048 - 8
        # a --context-length given to the server wins over the model's limit
        srv.cfg.context_length = 300
        out = verify_server_on(srv, prompt_tokens=None)
    assert out["ok"] and out["checks"]["unique_prompt"]["tokens"] == 300 - 8


def test_verify_server_fails_on_a_server_that_serves_prefixes(tiny_target_dir, tmp_path):
    with serve(tiny_target_dir, tmp_path, disable_radix_cache=False) as srv:
        info = srv.server_info
        srv.server_info = lambda: {**info(), "disable_radix_cache": True}
        without_the_prefix_cap(srv)
        with pytest.raises(CheckFailed) as exc:
            verify_server_on(srv, prompt_tokens=64)
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
        verify_server_on(srv)
    checks = exc.value.summary["checks"]
    assert "--disable-prefill-cuda-graph" in checks["unique_prompt"]["reason"]
    assert not checks["plugin_counters"]["ok"] and "--disable-prefill-cuda-graph" in checks["plugin_counters"]["fix"]
    assert checks["plugin_counters"]["unmatched_forwards"] >= 1


@pytest.mark.parametrize("old_plugin", [False, True])
def test_verify_server_names_the_flag_when_replay_batches_find_no_scheduler_batch(
    tiny_target_dir, tmp_path, monkeypatch, old_plugin
):
    # no dump at all (not even a rejected one): the counters must name the flag, not the dump directory
    run_model_runner_forward_elsewhere(monkeypatch, old_plugin=old_plugin)
    with serve(tiny_target_dir, tmp_path) as srv, pytest.raises(CheckFailed) as exc:
        verify_server_on(srv, dump_wait_s=0.3)
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
        out = verify_server_on(srv)
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
        verify_server_on(srv, layers="2,3,4", target=str(tiny_target_dir), prompt_tokens=40)
    checks = exc.value.summary["checks"]
    assert checks["unique_prompt"]["ok"] and checks["shared_prefix"]["ok"] and not checks["numbers"]["ok"]
    assert min(checks["numbers"]["mean_rel_l2"][k] for k in ("aux2", "aux3", "aux4")) > 0.05
    assert checks["numbers"]["mean_rel_l2"]["final"] < 1e-4  # the final state is still right
