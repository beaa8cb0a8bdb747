"""serve_live's summary of py-spy's stacks of the capture server (what the live run prints as `profile`)."""

from __future__ import annotations

from lab.tests.conftest import load_script

RAW = """\
process 100:"sglang::scheduler_TP0";thread (7): MainThread;event_loop (sglang/scheduler.py:10);run_batch (sglang/scheduler.py:20) 60
process 100:"sglang::scheduler_TP0";thread (7): MainThread;event_loop (sglang/scheduler.py:10);_on_logits (eyas/sglang/plugin.py:5);observe (eyas/sglang/core.py:9) 30
process 100:"sglang::scheduler_TP0";thread (8): eyas-dump-writer-0;_loop (eyas/sglang/core.py:630);_write_buffers (eyas/sglang/core.py:478) 50
process 1:"python -m sglang.launch_server";process 100:"sglang::scheduler_TP0";thread (9): eyas-dump-writer-1;write_dump (eyas/sglang/core.py:527) 10
process 1:"python -m sglang.launch_server";thread (2): MainThread;serve (uvicorn/server.py:1) 5
"""


def test_profile_summary_gives_each_threads_busy_share_and_its_share_in_eyas_code(tmp_path):
    serve_live = load_script("serve_live")
    raw = tmp_path / "pyspy-capture.txt"
    raw.write_text(RAW)
    out = serve_live.profile_summary(raw, seconds=1.0, top=2)  # 100 samples a second at --rate 100
    main = out["sglang::scheduler_TP0 (100) / MainThread"]
    assert main["busy"] == 0.9 and main["eyas_share"] == round(30 / 90, 3)
    assert main["top"] == [
        ["run_batch (sglang/scheduler.py)", round(60 / 90, 3)],
        ["observe (eyas/sglang/core.py)", round(30 / 90, 3)],
    ]
    # a nested process prefix (the launcher, then its child) is read as the innermost process
    assert out["sglang::scheduler_TP0 (100) / eyas-dump-writer-1"] == {
        "busy": 0.1,
        "eyas_share": 1.0,
        "top": [["write_dump (eyas/sglang/core.py)", 1.0]],
    }
    assert out["python -m sglang.launch_server (1) / MainThread"]["eyas_share"] == 0.0
    # each process's threads together, then the threads, the busiest first
    together = out["sglang::scheduler_TP0 (100) / all threads"]
    assert together["busy"] == 1.5 and together["eyas_share"] == round(90 / 150, 3)  # 90 + 50 + 10 samples
    assert together["top"] == [
        ["run_batch (sglang/scheduler.py)", round(60 / 150, 3)],
        ["_write_buffers (eyas/sglang/core.py)", round(50 / 150, 3)],
    ]
    assert list(out)[:2] == ["sglang::scheduler_TP0 (100) / all threads", "sglang::scheduler_TP0 (100) / MainThread"]


def test_flush_cache_waits_out_running_requests_and_gives_up_on_a_server_without_it(monkeypatch):
    import http.server
    import threading

    serve_live = load_script("serve_live")
    monkeypatch.setattr(serve_live.time, "sleep", lambda s: None)
    answers: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            code = answers.pop(0)
            self.send_response(code)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        answers[:] = [400, 400, 200]  # refused while requests run, then flushed
        assert serve_live.flush_cache(url) and answers == []
        answers[:] = [404, 200]  # a server without the endpoint: no retry
        assert not serve_live.flush_cache(url) and answers == [200]
        answers[:] = [400] * 3
        assert not serve_live.flush_cache(url, tries=3) and answers == []
    finally:
        srv.shutdown()
