"""eyas/sglang/server.py: the preflight's refusals, the server's info, HTTP answers (against the stand-in server)."""

from __future__ import annotations

import pytest

from eyas.errors import EyasError
from eyas.sglang import plugin
from eyas.sglang.server import preflight
from tests.sglang_helpers import (
    LAYERS,
    plain_http_server,
    serve,
    verify_server_on,
)


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
        assert preflight(srv.url, LAYERS).status["plugin_version"] == plugin.PLUGIN_VERSION


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
            verify_server_on(srv)
        piecewise = {"prefill": {"backend": "tc_piecewise"}, "decode": {"backend": "full"}}
        srv.server_info = lambda: {**info(), "cuda_graph_config": piecewise}
        with pytest.raises(EyasError, match=r"tc_piecewise[^\n]*--disable-prefill-cuda-graph[^\n]*$"):
            preflight(srv.url, LAYERS)
        with pytest.raises(EyasError, match="tc_piecewise"):
            verify_server_on(srv)
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
