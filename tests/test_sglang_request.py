"""eyas/sglang/request.py: one sample's dump, its checks and the probe (against the stand-in server)."""

from __future__ import annotations

import pytest
import torch

from eyas.errors import EyasError
from eyas.sglang.server import preflight
from tests.sglang_helpers import (
    LAYERS,
    run_model_runner_forward_elsewhere,
    serve,
)


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
