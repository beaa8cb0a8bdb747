"""`eyas bench-serve` (eyas/serve_bench.py) end to end against stand-in servers on 127.0.0.1: the SGLang
stand-in (eyas/sglang/standin.py) pretending to run a draft, a baseline stand-in without one, and a minimal
vLLM-like server defined here (/v1/models, /v1/completions, /tokenize, /metrics with spec-decode counters)."""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.common import marker_kind
from eyas.serve_bench import parse_prometheus
from eyas.sglang.standin import StandinConfig, StandinServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LEDGER_KEYS = {"metric", "value", "unit", "date", "commit", "device", "command"}
TURNS = [["Name a colour.", "And another one?"], ["Count to three.", "Now backwards."]]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("bench_prompts") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"q{k}", "turns": t}) + "\n" for k, t in enumerate(TURNS)))
    return p


def standin(target, tmp_path, name, **kw) -> StandinServer:
    return StandinServer(StandinConfig(target=target, dump_dir=tmp_path / f"dumps-{name}", plugin=False, **kw)).start()


def bench(*args: str):
    """(exit code, the JSON summary or None, the stderr lines)."""
    res = CliRunner().invoke(app, ["bench-serve", *args])
    lines = res.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if res.exit_code == 0 and lines else None
    return res.exit_code, summary, res.stderr.strip().splitlines()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_draft_against_baseline_on_eval_prompts(tiny_target_dir, prompts, tmp_path):
    from eyas.specdec.generate import generate_conversations, load_prompts
    from eyas.target import load_target, load_tokenizer

    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "report.json").write_text(json.dumps({"modes": {"chain": {"acceptance_length": 1.6}}}))
    draft = standin(tiny_target_dir, tmp_path, "draft", draft_accept_length=2.0)
    base = standin(tiny_target_dir, tmp_path, "base")
    out = tmp_path / "out"
    try:
        code, s, err = bench(
            "--url",
            draft.url,
            "--baseline-url",
            base.url,
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "6",
            "--concurrency",
            "1,2",
            "--label",
            "tiny",
            "--eval-report",
            str(eval_dir),
            "--out",
            str(out),
        )
        assert code == 0, err
        cumulative = draft.spec_totals[0] / draft.spec_totals[1]  # every answer the draft server gave
    finally:
        draft.close(), base.close()
    turns = read_jsonl(out / "turns.jsonl")
    assert len(turns) == 2 * 2 * 4  # two servers x two concurrencies x (2 conversations x 2 turns)
    for c in (1, 2):
        r = s["runs"][f"c{c}"]
        mine = [t for t in turns if t["server"] == "draft" and t["concurrency"] == c]
        tokens = sum(t["completion_tokens"] for t in mine)
        # the stand-in's rounds are ceil(tokens / 2) per answer: the run's accept length is their ratio, ~2
        assert r["accept_length"] == round(tokens / sum(math.ceil(t["completion_tokens"] / 2) for t in mine), 4)
        assert r["accept_length"] == pytest.approx(2.0, abs=0.25)
        assert r["speedup"] == round(r["tokens_per_s"] / r["baseline"]["tokens_per_s"], 4)
        assert r["tokens_per_s"] == pytest.approx(tokens / r["wall_s"], rel=1e-3)
        assert r["outputs_identical_fraction"] == 1.0
        assert r["latency_s"]["p50"] <= r["latency_s"]["p90"]
    # the server-wide figure is cumulative: after the last run it is every answer's ratio so far
    assert s["runs"]["c2"]["server_accept_length"]["after"] == pytest.approx(cumulative)
    assert s["server"]["speculative_algorithm"] == "EAGLE3" and s["server"]["speculative_num_steps"] == 3
    assert s["accept_len_vs_eval_chain"] == round(s["runs"]["c1"]["accept_length"] / 1.6, 4)
    assert any("warning" in line and "eval's chain tau" in line for line in err)  # ~1.25, outside [0.95, 1.05]

    # the same token ids as `eyas eval`: its prompts, rendering and greedy answers, turn 2 after turn 1's answer
    tok = load_tokenizer(tiny_target_dir)
    seqs = generate_conversations(
        load_target(tiny_target_dir), tok, load_prompts(str(prompts)), max_new_tokens=6, batch_size=4
    )
    want = {(q.id, q.turn): (q.prompt_ids, q.generated_ids) for q in seqs}
    for t in turns:
        assert (t["prompt_ids"], t["output_ids"]) == want[(t["id"], t["turn"])]

    ledger = read_jsonl(out / "results.jsonl")
    assert all(set(line) == LEDGER_KEYS for line in ledger)
    assert {line["metric"] for line in ledger} == {
        f"tiny_serve_{m}_c{c}" for c in (1, 2) for m in ("tok_s", "baseline_tok_s", "speedup", "accept_len")
    }
    assert next(x for x in ledger if x["metric"] == "tiny_serve_speedup_c2")["value"] == s["runs"]["c2"]["speedup"]
    assert "--baseline-url" in ledger[0]["command"]
    report = (out / "report.md").read_text()
    assert "| concurrency | tok/s draft | tok/s baseline | speed-up |" in report
    assert json.loads((out / "summary.json").read_text())["runs"] == s["runs"]
    assert marker_kind(out) == "bench-serve"


# ----------------------------------------------------------------------------------------------
# a vLLM-like server


class FakeVLLM:
    """/v1/models, /version, /tokenize, /v1/completions (fixed output ids per prompt) and /metrics; with
    `draft`, every request adds 4 drafts with 3, 2 and 1 tokens accepted at positions 0, 1, 2."""

    PER_POS = (3, 2, 1)

    def __init__(self, target: Path, *, draft: bool):
        from transformers import AutoTokenizer

        self.target, self.draft = target, draft
        self.tok = AutoTokenizer.from_pretrained(target)
        self.drafts, self.per_pos = 0, [0, 0, 0]
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def metrics(self) -> str:
        lines = [
            "# HELP vllm:num_requests_running Number of requests.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        ]
        if self.draft:
            lab = 'engine="0",model_name="tiny"'
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(self.drafts)}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(sum(self.per_pos))}",
            ]
            lines += [
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{j}"}} {float(v)}'
                for j, v in enumerate(self.per_pos)
            ]
        return "\n".join(lines) + "\n"

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj, *, text=False):
                body = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny", "root": str(fake.target), "max_model_len": 2048}]})
                if self.path == "/version":
                    return self._send(200, {"version": "0.11.0"})
                if self.path == "/metrics":
                    return self._send(200, fake.metrics(), text=True)
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/tokenize":
                    return self._send(200, {"tokens": fake.tok.encode(body["prompt"])})
                if self.path != "/v1/completions":
                    return self._send(404, {"detail": "Not Found"})
                ids = body["prompt"]
                out = [100 + (sum(ids) * 7 + k) % 500 for k in range(body["max_tokens"])]
                if fake.draft:
                    with fake.lock:
                        fake.drafts += 4
                        fake.per_pos = [a + b for a, b in zip(fake.per_pos, FakeVLLM.PER_POS)]
                self._send(
                    200,
                    {
                        "choices": [{"text": fake.tok.decode(out), "token_ids": out, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)},
                    },
                )

        return Handler


def test_vllm_counters_give_the_accept_length_and_per_position_rates(tiny_target_dir, prompts, tmp_path):
    draft, base = FakeVLLM(tiny_target_dir, draft=True), FakeVLLM(tiny_target_dir, draft=False)
    try:
        code, s, err = bench(
            "--url",
            draft.url,
            "--baseline-url",
            base.url,
            "--engine",
            "vllm",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "5",
            "--concurrency",
            "1,3",
            "--out",
            str(tmp_path / "out"),
        )
    finally:
        draft.close(), base.close()
    assert code == 0, err
    assert s["engine"] == "vllm" and s["server"]["num_speculative_tokens"] == 3
    for c in (1, 3):
        r = s["runs"][f"c{c}"]
        assert r["accept_length"] == 1 + 6 / 4  # differences of the counters around the run
        assert r["per_position_acceptance"] == [0.75, 0.5, 0.25]
        assert r["drafts"] == 4 * 4  # four turns, no warm-up or probe request counted in the run
        assert r["speedup"] == round(r["tokens_per_s"] / r["baseline"]["tokens_per_s"], 4)
        assert r["outputs_identical_fraction"] == 1.0
    assert s["runs"]["c3"]["server_accept_length"]["after"] == 2.5


def test_prometheus_text_is_parsed_with_labels_and_comments():
    got = parse_prometheus(
        '# HELP x a counter\nx_total{a="1",b="q\\"uote"} 3.5\nx_total{a="2"} 1e2 1700000000\n'
        "no_labels 7\nbroken line here\n"
    )
    assert got["x_total"] == [({"a": "1", "b": 'q"uote'}, 3.5), ({"a": "2"}, 100.0)]
    assert got["no_labels"] == [({}, 7.0)]


# ----------------------------------------------------------------------------------------------
# refusals before the runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(tiny_target_dir, tmp_path_factory, smol_tokenizer):
    """A draft stand-in, a second one, a baseline, one serving another model, one with another tokenizer."""
    from conftest import make_tiny_target
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("bench_servers")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "eyas": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    other_tok = tmp / "words"
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(other_tok)
    other_model = make_tiny_target(tmp / "other_model", smol_tokenizer, seed=1)
    srv = {
        "draft": standin(tiny_target_dir, tmp, "d", draft_accept_length=2.0),
        "draft2": standin(tiny_target_dir, tmp, "d2", draft_accept_length=3.0),
        "base": standin(tiny_target_dir, tmp, "b"),
        "other_model": standin(other_model, tmp, "o"),
        "other_tok": standin(tiny_target_dir, tmp, "t", tokenizer=other_tok, draft_accept_length=2.0),
    }
    yield srv
    for s in srv.values():
        s.close()


class NotAServer(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(404)
        self.end_headers()


@pytest.mark.parametrize(
    "case", ["no_draft", "baseline_with_draft", "unreachable", "not_a_server", "other_model", "other_tokenizer"]
)
def test_bad_servers_are_refused_in_one_line_before_any_run(case, servers, tiny_target_dir, prompts, tmp_path):
    url, base = servers["draft"].url, None
    if case == "no_draft":
        url = servers["base"].url
    elif case == "baseline_with_draft":
        base = servers["draft2"].url
    elif case == "unreachable":
        url = f"http://127.0.0.1:{free_port()}"
    elif case == "other_model":
        base = servers["other_model"].url
    elif case == "other_tokenizer":
        url = servers["other_tok"].url
    httpd = None
    if case == "not_a_server":
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotAServer)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
    calls = {k: s.generate_calls for k, s in servers.items()}
    out = tmp_path / "out"
    try:
        code, _, err = bench(
            "--url",
            url,
            *(["--baseline-url", base] if base else []),
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--concurrency",
            "1",
            "--out",
            str(out),
        )
    finally:
        if httpd is not None:
            httpd.shutdown(), httpd.server_close()
    expected = {
        "no_draft": ("--url", "runs no draft model"),
        "baseline_with_draft": ("--baseline-url", "runs a draft model"),
        "unreachable": ("--url", "no answer"),
        "not_a_server": ("--url", "nor a vLLM server"),
        "other_model": ("--baseline-url", "the speed-up needs the same target"),
        "other_tokenizer": ("--url", "splits a probe text"),
    }[case]
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {expected[0]} ") and expected[1] in err[0], err
    assert (base or url) in err[0] if case in ("baseline_with_draft", "other_model") else url in err[0]
    assert not out.exists()
    # nothing was generated but the one-token tokenizer probe (text prompts)
    assert all(servers[k].generate_calls - calls[k] <= 1 for k in servers)


def test_allow_no_draft_measures_a_server_without_one_and_overwrite_keeps_the_users_files(
    servers, tiny_target_dir, prompts, tmp_path
):
    out = tmp_path / "out"
    args = (
        "--url",
        servers["base"].url,
        "--allow-no-draft",
        "--target",
        str(tiny_target_dir),
        "--prompts",
        str(prompts),
        "--limit",
        "1",
        "--max-new-tokens",
        "3",
        "--concurrency",
        "1",
        "--out",
        str(out),
    )
    code, s, err = bench(*args)
    assert code == 0, err
    r = s["runs"]["c1"]
    assert r["accept_length"] is None and r["requests"] == 2 and r["completion_tokens"] == 6
    assert "speedup" not in r
    (out / "notes.txt").write_text("mine")
    code, _, err = bench(*args)
    assert code == 2 and "already exists" in err[0] and "--overwrite" in err[0]
    code, _, err = bench(*args, "--overwrite")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and (out / "summary.json").is_file()


def test_eval_tau_over_the_conversations_sent(tiny_target_dir, prompts, tmp_path):
    """With eval's sequences.jsonl, the comparison uses eval's rounds of exactly the conversations bench-serve sent
    (an 80-question tau against 20 served conversations differs by the categories alone); eval sequences that lack
    a sent conversation are refused before any timed request."""
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "report.json").write_text(json.dumps({"modes": {"chain": {"acceptance_length": 9.0}}}))
    seqs = [
        {"id": "q0", "turn": 1, "accepted_chain": [1, 0, 2]},
        {"id": "q0", "turn": 2, "accepted_chain": [3]},
        {"id": "q1", "turn": 1, "accepted_chain": [0, 0]},
        {"id": "q1", "turn": 2, "accepted_chain": [1, 1]},
        {"id": "q7", "turn": 1, "accepted_chain": [7, 7, 7]},
    ]  # not sent: left out
    (eval_dir / "sequences.jsonl").write_text("".join(json.dumps(x) + "\n" for x in seqs))
    draft = standin(tiny_target_dir, tmp_path, "draft", draft_accept_length=2.0)
    try:
        args = [
            "--url",
            draft.url,
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--concurrency",
            "1",
            "--eval-report",
            str(eval_dir),
        ]
        code, s, err = bench(*args, "--out", str(tmp_path / "out"))
        assert code == 0, err
        assert s["eval_chain_tau"] == round(1 + 8 / 8, 4) and "2 conversations sent" in s["eval_chain_tau_from"]
        assert s["accept_len_vs_eval_chain"] == round(s["runs"]["c1"]["accept_length"] / 2.0, 4)
        (eval_dir / "sequences.jsonl").write_text("".join(json.dumps(x) + "\n" for x in seqs if x["id"] != "q1"))
        code, s, err = bench(*args, "--out", str(tmp_path / "out2"))
        assert code == 2 and s is None
        assert any("no eval sequences for 1 of the 2 conversations" in line and "q1" in line for line in err), err
    finally:
        draft.close()
