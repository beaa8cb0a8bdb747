"""eyas/sglang/sender.py: the capture's loop in one process: server slots, the store's pace, the memory budget,
the thread switch interval (against the stand-in server)."""

from __future__ import annotations

import sys
import threading

import pytest

from eyas.sglang.client import capture_from_sglang
from tests.sglang_helpers import (
    LAYERS,
    LENGTHS,
    check_store_against_reference,
    serve,
)


def test_samples_waiting_for_dumps_leave_their_server_slots(tiny_target_dir, sglang_prepared, tmp_path, monkeypatch):
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
        out = capture_from_sglang(
            [srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=2, calibrate=0
        )
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


def test_a_slow_store_write_does_not_stop_sending(tiny_target_dir, sglang_prepared, tmp_path, monkeypatch):
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
        out = capture_from_sglang([srv.url], sglang_prepared, "train", tmp_path / "store", LAYERS, concurrency=1)
    assert sent_meanwhile[0] >= 3 and out["captured"] == len(LENGTHS) and out["store_complete"]


def test_the_states_held_between_servers_and_a_slow_disk_stay_within_the_budget(
    tiny_target_dir, tiny_model, sglang_prepared, tmp_path, monkeypatch
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
                [srv.url], sglang_prepared, "train", tmp_path / name, LAYERS, concurrency=4, memory_bytes=memory
            )
    assert runs["free"]["memory"]["peak_bytes"] == sum(LENGTHS) * row  # all 8 samples sent at once
    assert runs["bound"]["memory"] == {"limit_bytes": budget, "peak_bytes": runs["bound"]["memory"]["peak_bytes"]}
    assert max(LENGTHS) * row <= runs["bound"]["memory"]["peak_bytes"] <= budget
    assert runs["tiny"]["memory"]["peak_bytes"] == max(LENGTHS) * row  # one sample at a time, the largest too
    for name in ("bound", "tiny"):
        assert runs[name]["captured"] == len(LENGTHS) and runs[name]["store_complete"]
        check_store_against_reference(tmp_path / name, sglang_prepared, tiny_model)


def test_the_stored_tokens_timeline_keeps_each_second_and_buckets_a_long_loop(monkeypatch):
    import eyas.sglang.sender as sender
    from eyas.sglang.request import Outcome

    now = [1000.0]
    monkeypatch.setattr(sender.time, "time", lambda: now[0])
    tally = sender.Tally(retries=0, t0=1000.0)  # the loop began at 1000 s

    class Writer:
        def add_encoded(self, encoded):
            pass

    for at, tokens in [(0.2, 5), (0.9, 7), (3.5, 11)]:  # nothing stored in seconds 1 and 2: a stall shows
        now[0] = 1000.0 + at
        tally.ingest(Outcome(sample_id=f"s{at}", tokens=tokens, encoded=object(), seconds={}), Writer())
    assert tally.timeline() == {"bucket_s": 1, "tokens": [12, 0, 0, 11]}
    assert tally.timeline(buckets=2) == {"bucket_s": 2, "tokens": [12, 11]}
    assert tally.timeline(buckets=3) == {"bucket_s": 2, "tokens": [12, 11]}  # at most 3 buckets of whole seconds
