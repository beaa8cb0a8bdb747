"""The server engine against a local fake OpenAI-compatible server (stdlib http.server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eyas.data.sources import iter_conversations
from eyas.errors import EyasError
from eyas.regen.driver import Regenerator, RegenOptions
from eyas.regen.output import META, ChatsWriter, read_chats
from eyas.regen.requests import CONTEXT_OVERFLOW, SERVER_ERROR, Request
from eyas.regen.sampling import Sampling
from eyas.regen.server import ServerEngine, ServerOptions


class FakeServer:
    """Answers `echo(<last user text>)`. Scripted by the user text: LONG -> 400 context error,
    FAIL -> 500 always, FLAKY -> 503 on the first try, EMPTY -> empty content, TRUNC -> length.
    `die_after` requests: stop answering (connection refused from then on)."""

    def __init__(self, die_after=None):
        self.requests, self.lock, self.die_after = [], threading.Lock(), die_after
        self.flaky_seen: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-model"}]})
                else:
                    self._send(404, {"error": "no"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                    n = len(outer.requests)
                if outer.die_after is not None and n > outer.die_after:
                    threading.Thread(target=outer.stop).start()
                    self.close_connection = True
                    self.connection.close()  # reset mid-request, like a crashed server
                    return
                text = body["messages"][-1]["content"]
                if "LONG" in text:
                    return self._send(
                        400,
                        {
                            "object": "error",
                            "message": "This model's maximum context length is 2048 tokens. However, you requested 5000 tokens.",
                        },
                    )
                if "FAIL" in text:
                    return self._send(500, {"error": "internal"})
                if "FLAKY" in text and text not in outer.flaky_seen:
                    outer.flaky_seen.add(text)
                    return self._send(503, {"error": "busy"})
                content = "" if "EMPTY" in text else f"echo({text})"
                self._send(
                    200,
                    {
                        "choices": [
                            {
                                "message": {"role": "assistant", "content": content},
                                "finish_reason": "length" if "TRUNC" in text else "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": len(content.split()) + 1},
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.stop()


def _engine(urls, **kw):
    opts = dict(urls=urls, concurrency=4, retries=2, backoff_s=0.01, timeout_s=5)
    opts.update(kw)
    return ServerEngine(ServerOptions(**opts), sampling=Sampling())


def test_single_calls_and_failure_reasons(server):
    eng = _engine([server.url + "/v1/"])
    assert eng.model == "fake-model" and eng.alive == [server.url]

    def req(text):
        return Request((0, 0), [{"role": "user", "content": text}], 7, 99)

    ok = eng.call(req("hello"))
    assert ok.text == "echo(hello)" and ok.failure is None and not ok.truncated and ok.new_tokens == 2
    body = server.requests[-1]
    assert body["model"] == "fake-model" and body["max_tokens"] == 7 and body["seed"] == 99 and body["temperature"] == 0
    assert eng.call(req("TRUNC x")).truncated
    assert eng.call(req("LONG x")).failure == CONTEXT_OVERFLOW
    fail = eng.call(req("FAIL x"))
    assert fail.failure == SERVER_ERROR and "500" in fail.detail
    assert server.requests.count(server.requests[-1]) == 3  # 1 try + 2 retries
    flaky = eng.call(req("FLAKY x"))
    assert flaky.text == "echo(FLAKY x)" and eng.retried >= 3


def test_no_server_is_a_clear_error():
    dead = FakeServer()
    dead.stop()
    with pytest.raises(EyasError, match="no server answered.*127.0.0.1"):
        _engine([dead.url])


def test_one_dead_url_of_two_is_skipped(server):
    dead = FakeServer()
    dead.stop()
    eng = _engine([dead.url, server.url])
    assert eng.alive == [server.url]


def _source(tmp_path, n=40):
    recs = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": f"r{i}"},
                {"role": "assistant", "content": "old"},
            ],
        }
        for i in range(n)
    ]
    recs[3]["messages"][0]["content"] = "LONG q3"
    recs[5]["messages"][2]["content"] = "FAIL r5"
    recs[7]["messages"][0]["content"] = "EMPTY q7"
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _drive(src, out, eng):
    writer = ChatsWriter(out, settings={"s": 1}, extra_meta={"engine": eng.describe()})
    drv = Regenerator(
        enumerate(iter_conversations(src)),
        writer,
        sampling=Sampling(),
        options=RegenOptions(max_new_tokens=16, commit_every=3, max_in_flight=8),
    )
    drv.run(eng)
    return writer


def test_full_run_through_server(server, tmp_path):
    src = _source(tmp_path)
    _drive(src, tmp_path / "out", _engine([server.url]))
    recs = {r["id"]: r["messages"] for r in read_chats(tmp_path / "out")}
    assert len(recs) == 38
    assert recs["c0"][1]["content"] == "echo(q0)" and recs["c0"][3]["content"] == "echo(r0)"
    # the second turn's prompt held the regenerated first answer
    second = [b for b in server.requests if b["messages"][-1]["content"] == "r0"][0]
    assert second["messages"][1] == {"role": "assistant", "content": "echo(q0)"}
    assert [m["content"] for m in recs["c5"]] == ["q5", "echo(q5)"]
    counts = json.loads((tmp_path / "out" / META).read_text())["counts"]
    assert counts["skipped"] == {"context_overflow": 1, "empty_answer": 1}
    assert counts["failed_turns"] == {"context_overflow": 1, "empty_answer": 1, "server_error": 1}


def test_server_dying_mid_run_then_resume(tmp_path):
    src = _source(tmp_path)
    dying = FakeServer(die_after=30)
    with pytest.raises(EyasError, match="stopped answering.*resume"):
        _drive(src, tmp_path / "out", _engine([dying.url]))
    first = read_chats(tmp_path / "out")
    assert 0 < len(first) < 38
    assert json.loads((tmp_path / "out" / META).read_text())["complete"] is False
    fresh = FakeServer()
    try:
        _drive(src, tmp_path / "out", _engine([fresh.url]))
    finally:
        fresh.stop()
    final = read_chats(tmp_path / "out")
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == 38
    assert {r["id"] for r in first} <= set(ids)
    # the resumed run did not ask again for conversations already written
    asked = {b["messages"][0]["content"] for b in fresh.requests}
    assert not asked & {r["messages"][0]["content"] for r in first}
    meta = json.loads((tmp_path / "out" / META).read_text())
    assert meta["complete"] is True and meta["counts"]["conversations"] == 40


def test_regenerate_command_with_server_urls(server, tmp_path, tiny_target_dir):
    from eyas.regen.run import RegenConfig, regenerate

    src = _source(tmp_path, n=8)
    s = regenerate(
        RegenConfig(
            out=tmp_path / "o",
            source=str(src),
            target=str(tiny_target_dir),
            server_urls=[server.url],
            concurrency=3,
            max_retries=1,
            max_turns=1,
        )
    )
    assert s["engine"] == "server" and s["written"] == 6 and s["assistant_turns"] == 6  # c3, c7 skipped
    meta = json.loads((tmp_path / "o" / META).read_text())
    assert meta["engine"]["served_model"] == "fake-model" and meta["settings"]["max_len"] is None
    with pytest.raises(EyasError, match="--engine server"):
        RegenConfig(out=tmp_path / "p", engine="static", server_urls=[server.url])
