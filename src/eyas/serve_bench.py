"""`eyas bench-serve`: speculative decoding measured on a RUNNING SGLang or vLLM server, as users measure it.

The prompts are `eyas eval`'s, token for token: the same prompt source (`mtbench` = 80 questions x 2 turns),
rendered with the target's chat template by the same function (eyas.specdec.generate.render), the 2nd turn
after the server's own greedy 1st answer (decoded without special tokens, as eval does), greedy, at most
--max-new-tokens per turn, ending after the first of eval's EOS ids (sent as `stop_token_ids`). So the
engine's accept length can be set beside eval's replay of the same inputs.

For each concurrency C, one run over all prompts (every conversation's turn 1, then every turn 2) with at
most C requests in flight: output tokens/s (completion tokens / the turns' wall seconds), request latency,
and the accept length as the ENGINE counts it (both count the bonus token):
- SGLang (`POST /generate` with `input_ids`): sum(completion_tokens) / sum(meta_info.spec_verify_ct) of the
  run, and the server's own `avg_spec_accept_length` (GET /server_info, in `internal_states[0]`), which is
  cumulative since the server started: the value after the run is reported, with the one before it;
- vLLM (`POST /v1/completions` with the prompt as token ids): 1 + d(accepted) / d(drafts) of the
  `vllm:spec_decode_num_drafts_total` and `..._num_accepted_tokens_total` counters in GET /metrics around
  the run, and per draft position d(accepted at position j) / d(drafts).
With --baseline-url (the same target served without a draft) the same runs against it give the speed-up
(tokens/s with the draft / tokens/s without) and the fraction of turns whose greedy outputs are identical
(speculative decoding must not change them, up to bf16 batch numerics).

Checked before the first timed request, each a one-line error (exit 2): a URL that does not answer or is not
an SGLang or vLLM server; --url without a draft (unless --allow-no-draft), --baseline-url with one; the two
serving different models; --target's tokenizer splitting a probe text differently from the server's.

Outputs (--out): summary.json (also the printed summary), report.md, throughput.png (when matplotlib
imports), turns.jsonl (every turn's ids and counts) and results.jsonl in benchmarks/results.jsonl's ledger
format.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import log
from eyas.errors import EyasError

SCHEMA = "eyas.bench-serve/1"
KIND = "bench-serve"
ENGINES = ("auto", "sglang", "vllm")
EVAL_RATIO_BAND = (0.95, 1.05)
PROBE_TEXT = (
    "eyas tokenizer probe: naive cafe \u00e9t\u00e9, na\u00efve \u00fcber 12,345.678 and 0x1F; "
    '`def f(x): return x ** 2`  {"k": [1, 2]} \u4f60\u597d \U0001f600 end.'
)
"""Mixed text (accents, digits, code, CJK, emoji) that tokenizers of different models split differently."""
WARMUP_TOKENS = 32
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(kw_only=True)
class BenchServeConfig:
    """Settings of one serving benchmark (the CLI's options)."""

    url: str
    """URL of the server running the target WITH the draft model (SGLang or vLLM), e.g. http://127.0.0.1:30000."""
    baseline_url: str | None = None
    """URL of the same target served WITHOUT a draft: the same runs against it give the speed-up and whether
    the greedy outputs agree."""
    target: str = "default"
    """Local copy of the served target (Hugging Face directory) whose chat template renders the prompts as
    `eyas eval` does; `default` = embedded SmolLM2-135M-Instruct."""
    prompts: str = "mtbench"
    """`mtbench` (80 questions x 2 turns, the 2nd after the server's own 1st answer) or a JSONL file of
    {"turns": [...]} or {"prompt": "..."}."""
    limit: int | None = None
    """Use only the first N conversations."""
    max_new_tokens: int = 256
    """Greedy tokens generated per turn (an answer also ends after the target's EOS, as in `eyas eval`)."""
    concurrency: list[int] = field(default_factory=lambda: [1, 16])
    """Requests in flight at once, comma-separated: one run over all prompts per value."""
    engine: str = "auto"
    """`auto` (asks the server), `sglang` or `vllm`."""
    label: str | None = None
    """Prefix of the metric names in results.jsonl (`LABEL_serve_speedup_c1`): letters, digits, `_`, `-`, `.`."""
    allow_no_draft: bool = False
    """Benchmark a --url server that runs no draft model (no accept length is measured then)."""
    eval_report: Path | None = None
    """An `eyas eval` report (its --out directory or report.json): adds the engine's accept length at
    concurrency 1 divided by eval's chain tau."""
    warmup: int = 2
    """Untimed requests sent to each server before its first run."""
    request_timeout: float = 1800.0
    """Seconds to wait for one answer."""

    def __post_init__(self):
        from eyas.config_checks import check_in, check_number, check_url

        self.url = check_url(self.url, option="--url")
        if self.baseline_url is not None:
            self.baseline_url = check_url(self.baseline_url, option="--baseline-url")
            if self.baseline_url == self.url:
                raise EyasError(
                    f"--baseline-url {self.baseline_url} is --url itself: give the server that runs the "
                    "same target without a draft"
                )
        check_in(self.engine, "--engine", ENGINES)
        check_number(self, "max_new_tokens", ge=1)
        check_number(self, "limit", ge=1, optional=True)
        check_number(self, "warmup", ge=0)
        check_number(self, "request_timeout", gt=0)
        if not self.concurrency:
            raise EyasError("--concurrency: give at least one value, e.g. 1,16")
        if any(c < 1 for c in self.concurrency):
            raise EyasError(f"--concurrency: values must be >= 1, got {','.join(map(str, self.concurrency))}")
        self.concurrency = list(dict.fromkeys(self.concurrency))
        if self.label is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.label):
            raise EyasError(
                f"--label {self.label!r}: use letters, digits, `_`, `-` and `.` only (it prefixes metric names)"
            )
        if self.prompts != "mtbench" and not Path(self.prompts).is_file():
            raise EyasError(f"--prompts {self.prompts}: not a file and not 'mtbench'")
        if self.eval_report is not None:
            read_eval_chain_tau(self.eval_report)


def read_eval_chain_tau(path: Path) -> float:
    """The chain tau of an `eyas eval` report (the directory or its report.json); bad input is an EyasError."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise EyasError(f"--eval-report {path}: no such file (give `eyas eval`'s --out directory or its report.json)")
    from eyas.common import read_text_file

    try:
        report = json.loads(read_text_file(p, what="--eval-report"))
    except json.JSONDecodeError as exc:
        raise EyasError(f"--eval-report {p}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    tau = (
        ((report.get("modes") or {}).get("chain") or {}).get("acceptance_length") if isinstance(report, dict) else None
    )
    if not isinstance(tau, (int, float)) or not tau > 0:
        raise EyasError(
            f"--eval-report {p}: no chain tau (modes.chain.acceptance_length) in it; was it written by "
            "`eyas eval` with --chain-k > 0?"
        )
    return float(tau)


def eval_chain_tau_on(path: Path, conv_ids: list[str]) -> tuple[float, str]:
    """Eval's chain tau over the conversations bench-serve sends, and where it came from.

    From the report's sequences.jsonl (every round of every turn) where it exists: a tau over other
    conversations is not comparable (MT-bench categories differ by more than the band). Without it,
    the report's own tau, said so."""
    tau = read_eval_chain_tau(path)
    d = Path(path) if Path(path).is_dir() else Path(path).parent
    seq = d / "sequences.jsonl"
    if not seq.is_file():
        return tau, f"the report's tau over its own prompts ({seq} not found)"
    from eyas.common import read_text_file

    want = {str(c) for c in conv_ids}
    accepted = rounds = 0
    seen: set[str] = set()
    for n, line in enumerate(read_text_file(seq, what="--eval-report").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            cid, chain = str(rec["id"]), rec["accepted_chain"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise EyasError(
                f"--eval-report {seq}: line {n} is not an `eyas eval` sequence (id, accepted_chain)"
            ) from None
        if cid in want:
            seen.add(cid)
            accepted += sum(chain)
            rounds += len(chain)
    missing = sorted(want - seen)
    if missing:
        raise EyasError(
            f"--eval-report {seq}: no eval sequences for {len(missing)} of the {len(want)} conversations "
            f"bench-serve sends (e.g. {', '.join(missing[:3])}): run `eyas eval` on the same --prompts with "
            "a --limit at least bench-serve's"
        )
    if not rounds:
        raise EyasError(f"--eval-report {seq}: the conversations bench-serve sends have no chain rounds")
    return 1 + accepted / rounds, f"eval's sequences of the {len(want)} conversations sent"


# ----------------------------------------------------------------------------------------------
# HTTP


class RequestFailed(Exception):
    """A request got no usable answer; `unreachable` when no server answered at all."""

    def __init__(self, message: str, *, code: int = 0, unreachable: bool = False):
        super().__init__(message)
        self.code, self.unreachable = code, unreachable


def http(method: str, url: str, body: Any = None, *, timeout: float, text: bool = False) -> Any:
    """One request; the answer as JSON (or text). An HTTP error or a connection failure is a RequestFailed."""
    from eyas.common import HTTPFailure, http_body_excerpt, http_request

    try:
        raw = http_request(method, url, body, timeout=timeout)
    except HTTPFailure as exc:
        raise RequestFailed(str(exc), code=exc.code or 0, unreachable=exc.code is None) from None
    if text:
        return raw.decode("utf-8", "replace")
    try:
        return json.loads(raw or b"null")
    except ValueError:
        raise RequestFailed(f"{url} answered with something that is not JSON: {http_body_excerpt(raw)!r}") from None


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {metric name: [(labels, value), ...]} (comments and bad lines skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    line_re = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
    label_re = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in label_re.findall(m.group(3) or "")}
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def vllm_counters(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """The spec-decode counters, summed over engines: drafts, accepted, accepted per position."""
    per_pos: dict[int, float] = {}
    for labels, v in metrics.get(VLLM_PER_POS, []):
        if str(labels.get("position", "")).isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + v
    return {
        "drafts": sum(v for _, v in metrics.get(VLLM_DRAFTS, [])),
        "accepted": sum(v for _, v in metrics.get(VLLM_ACCEPTED, [])),
        "per_pos": [per_pos[j] for j in sorted(per_pos)],
    }


# ----------------------------------------------------------------------------------------------
# servers


@dataclass
class Answer:
    output_ids: list[int] | None
    text: str | None
    completion_tokens: int
    spec_verify_ct: int | None
    latency_s: float
    finish: Any = None


@dataclass(kw_only=True)
class Server:
    """One server, probed: what it runs and how to ask it."""

    url: str
    option: str
    engine: str
    model: str
    version: str | None
    settings: dict[str, Any]
    """What the server reports of itself (speculative settings, model path, version, ...)."""
    has_draft: bool
    context: int | None = None
    served_name: str | None = None
    timeout: float = 1800.0

    # -- requests

    def generate(self, ids: list[int], *, max_new_tokens: int, stop_ids: list[int]) -> Answer:
        t0 = time.perf_counter()
        if self.engine == "sglang":
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids},
            }
            got = http("POST", f"{self.url}/generate", body, timeout=self.timeout)
            if isinstance(got, list):
                got = got[0] if got else {}
            meta = got.get("meta_info") or {} if isinstance(got, dict) else {}
            out = got.get("output_ids") if isinstance(got, dict) else None
            if "completion_tokens" not in meta:
                raise RequestFailed(
                    f"{self.url}/generate answered without meta_info.completion_tokens: {str(got)[:120]}"
                )
            verify = meta.get("spec_verify_ct")
            return Answer(
                output_ids=[int(t) for t in out] if isinstance(out, list) else None,
                text=got.get("text"),
                completion_tokens=int(meta["completion_tokens"]),
                spec_verify_ct=None if verify is None else int(verify),
                latency_s=time.perf_counter() - t0,
                finish=meta.get("finish_reason"),
            )
        body = {
            "model": self.served_name,
            "prompt": ids,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
        }
        got = http("POST", f"{self.url}/v1/completions", body, timeout=self.timeout)
        choice = ((got or {}).get("choices") or [{}])[0]
        usage = (got or {}).get("usage") or {}
        if "completion_tokens" not in usage:
            raise RequestFailed(f"{self.url}/v1/completions answered without usage.completion_tokens: {str(got)[:120]}")
        out = choice.get("token_ids")
        return Answer(
            output_ids=[int(t) for t in out] if isinstance(out, list) else None,
            text=choice.get("text"),
            completion_tokens=int(usage["completion_tokens"]),
            spec_verify_ct=None,
            latency_s=time.perf_counter() - t0,
            finish=choice.get("finish_reason"),
        )

    def spec_state(self) -> dict[str, Any]:
        """The server-wide acceptance counters now (SGLang: avg_spec_accept_length; vLLM: spec-decode counters)."""
        if self.engine == "sglang":
            from eyas.sglang.server import get_server_info

            try:
                info = get_server_info(self.url, timeout=60.0)
            except Exception as exc:  # noqa: BLE001  (a report value, not worth failing a finished run for)
                log(f"bench-serve: {self.url}: server info not read ({exc})")
                return {}
            return {"avg_spec_accept_length": sglang_avg_accept_length(info)}
        try:
            return vllm_counters(parse_prometheus(http("GET", f"{self.url}/metrics", timeout=60.0, text=True)))
        except RequestFailed as exc:
            log(f"bench-serve: {self.url}: /metrics not read ({exc}); no accept length for this run")
            return {}


def sglang_avg_accept_length(info: dict[str, Any]) -> float | None:
    for st in [info, *(info.get("internal_states") or [])]:
        if isinstance(st, dict) and isinstance(st.get("avg_spec_accept_length"), (int, float)):
            return float(st["avg_spec_accept_length"])
    return None


SGLANG_SETTINGS = (
    "model_path",
    "tokenizer_path",
    "version",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "tp_size",
    "dp_size",
    "dtype",
    "device",
    "context_length",
    "max_running_requests",
    "cuda_graph_max_bs",
    "disable_radix_cache",
    "attention_backend",
)


def probe(url: str, option: str, *, engine: str, timeout: float) -> Server:
    """Ask `url` what it is; an EyasError (naming the option and URL) when it does not answer or is neither engine."""
    from eyas.sglang.server import PermanentHTTPError, TransientHTTPError, get_server_info

    if engine in ("auto", "sglang"):
        info: Any = None
        try:
            info = get_server_info(url, timeout=30.0)
        except TransientHTTPError as exc:
            raise EyasError(f"{option} {url}: no answer ({exc}); start the server or fix the URL") from None
        except PermanentHTTPError as exc:
            if engine == "sglang":
                raise EyasError(f"{option} {url}: not an SGLang server ({exc})") from None
        if isinstance(info, dict) and ("model_path" in info or "internal_states" in info):
            alg = info.get("speculative_algorithm")
            has_draft = alg not in (None, "", "NONE", "None", "none")
            settings = {k: info.get(k) for k in SGLANG_SETTINGS if k in info}
            return Server(
                url=url,
                option=option,
                engine="sglang",
                model=str(info.get("model_path") or ""),
                version=info.get("version"),
                settings=settings,
                has_draft=has_draft,
                context=info.get("context_length") or None,
                timeout=timeout,
            )
        if engine == "sglang":
            raise EyasError(f"{option} {url}: not an SGLang server (its server info has no model_path)")
    try:
        models = http("GET", f"{url}/v1/models", timeout=30.0)
        metrics_text = http("GET", f"{url}/metrics", timeout=30.0, text=True)
    except RequestFailed as exc:
        if exc.unreachable:
            raise EyasError(f"{option} {url}: no answer ({exc}); start the server or fix the URL") from None
        raise EyasError(f"{option} {url}: not an SGLang server (no /server_info) nor a vLLM server ({exc})") from None
    metrics = parse_prometheus(metrics_text)
    data = (models or {}).get("data") if isinstance(models, dict) else None
    if not data or not any(name.startswith("vllm:") for name in metrics):
        raise EyasError(
            f"{option} {url}: not an SGLang server (no /server_info) nor a vLLM server (no models in "
            "/v1/models or no vllm: metrics in /metrics)"
        )
    card = data[0]
    try:
        version = http("GET", f"{url}/version", timeout=30.0).get("version")
    except (RequestFailed, AttributeError):
        version = None
    counters = vllm_counters(metrics)
    settings = {
        "model": card.get("root") or card.get("id"),
        "served_model_name": card.get("id"),
        "max_model_len": card.get("max_model_len"),
        "version": version,
        "num_speculative_tokens": len(counters["per_pos"]) or None,
    }
    return Server(
        url=url,
        option=option,
        engine="vllm",
        model=str(card.get("root") or card.get("id")),
        version=version,
        settings=settings,
        has_draft=VLLM_DRAFTS in metrics,
        context=card.get("max_model_len") or None,
        served_name=card.get("id"),
        timeout=timeout,
    )


def same_model(a: str, b: str) -> bool:
    """The same model path or name, or the same last path component (one model under two roots)."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or (bool(a) and a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1])


def check_tokenizer(server: Server, tokenizer) -> dict[str, Any]:
    """Compare how the server and --target's tokenizer split PROBE_TEXT; a different split is an EyasError.
    Whether a BOS is added is not compared (prompts are sent as ids, so it does not matter)."""
    ours = [tokenizer.encode(PROBE_TEXT, add_special_tokens=s) for s in (True, False)]
    if server.engine == "sglang":
        try:
            got = http(
                "POST",
                f"{server.url}/generate",
                {"text": PROBE_TEXT, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                timeout=server.timeout,
            )
        except RequestFailed as exc:  # e.g. --skip-tokenizer-init: no text prompts
            log(f"bench-serve: {server.option} {server.url}: tokenizer probe skipped (text prompt refused: {exc})")
            return {"checked": False}
        n = int(((got or {}).get("meta_info") or {}).get("prompt_tokens", -1))
        ok = n in {len(x) for x in ours}
        seen = f"{n} tokens"
    else:
        try:
            got = http(
                "POST",
                f"{server.url}/tokenize",
                {"model": server.served_name, "prompt": PROBE_TEXT},
                timeout=server.timeout,
            )
            theirs = [int(t) for t in (got or {}).get("tokens", [])]
        except RequestFailed as exc:
            log(f"bench-serve: {server.option} {server.url}: tokenizer probe skipped (/tokenize: {exc})")
            return {"checked": False}
        ok, n = theirs in ours, len(theirs)
        seen = f"{n} tokens" + (" (other ids)" if n in {len(x) for x in ours} else "")
    if not ok:
        raise EyasError(
            f"{server.option} {server.url}: its tokenizer splits a probe text into {seen}, --target's into "
            f"{len(ours[0])}: the server serves another model or tokenizer than --target "
            f"({server.model}); give --target a local copy of the served model"
        )
    return {"checked": True, "probe_tokens": n}


def target_eos_and_context(target_path: Path, tokenizer) -> tuple[set[int], int]:
    """eval's EOS ids (model config, generation config, tokenizer) and the target's context, without its weights."""
    import types

    from transformers import AutoConfig, GenerationConfig

    from eyas.specdec.generate import context_length, eos_ids_of

    config = AutoConfig.from_pretrained(target_path)
    try:
        gen = GenerationConfig.from_pretrained(target_path)
    except (OSError, ValueError):
        gen = None
    stand_in = types.SimpleNamespace(config=config, generation_config=gen)
    eos = eos_ids_of(stand_in, tokenizer)
    if not eos:
        raise EyasError("the target defines no eos_token_id; cannot tell where an answer ends")
    return eos, context_length(stand_in)


# ----------------------------------------------------------------------------------------------
# runs


class Progress:
    """Requests done / total, output tokens/s and an ETA on stderr, at most every `every_s` seconds."""

    def __init__(self, what: str, total: int, *, every_s: float = 10.0):
        self.what, self.total, self.every_s = what, total, every_s
        self.done = self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        self.lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self.lock:
            self.done += 1
            self.tokens += tokens
            now = time.perf_counter()
            if now - self.last < self.every_s and self.done < self.total:
                return
            self.last = now
        el = max(now - self.t0, 1e-9)
        eta = (self.total - self.done) * el / self.done
        log(
            f"bench-serve: {self.what}: {self.done}/{self.total} requests, {self.tokens / el:,.0f} tok/s, "
            f"ETA {eta:.0f}s"
        )


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile q in [0, 100] of xs (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_stats(xs: list[float]) -> dict[str, float | None]:
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {"mean": r(sum(xs) / len(xs)) if xs else None, "p50": r(percentile(xs, 50)), "p90": r(percentile(xs, 90))}


@dataclass
class Turn:
    conv: str
    turn: int
    prompt_ids: list[int]
    answer: Answer


def run_conversations(
    server: Server,
    convs,
    tokenizer,
    *,
    concurrency: int,
    max_new_tokens: int,
    stop_ids: list[int],
    context: int,
    what: str,
) -> tuple[list[Turn], float]:
    """Every conversation's turn 1, then every turn 2, ... with at most `concurrency` requests in flight;
    returns the turns (conversation order, turn by turn) and the summed wall seconds of the turns."""
    from eyas.specdec.generate import Sequence, check_fits, render

    history: list[list[dict[str, str]]] = [[] for _ in convs]
    turns: list[Turn] = []
    wall = 0.0
    bar = Progress(what, sum(len(c.turns) for c in convs))
    for t in range(max(len(c.turns) for c in convs)):
        live = [i for i, c in enumerate(convs) if t < len(c.turns)]
        prompts = []
        for i in live:
            history[i].append({"role": "user", "content": convs[i].turns[t]})
            ids = render(tokenizer, history[i])
            check_fits(
                Sequence(id=convs[i].id, turn=t + 1, prompt_ids=ids), max_new_tokens=max_new_tokens, context=context
            )
            prompts.append(ids)
        answers: list[Answer | None] = [None] * len(live)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futs = {
                pool.submit(server.generate, ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids): k
                for k, ids in enumerate(prompts)
            }
            try:
                for fut in as_completed(futs):
                    k = futs[fut]
                    try:
                        answers[k] = fut.result()
                    except RequestFailed as exc:
                        raise EyasError(
                            f"{server.option} {server.url}: conversation {convs[live[k]].id} turn {t + 1} failed: {exc}"
                        ) from None
                    bar.add(answers[k].completion_tokens)
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
        wall += time.perf_counter() - t0
        for k, i in enumerate(live):
            a = answers[k]
            text = (
                tokenizer.decode(a.output_ids, skip_special_tokens=True) if a.output_ids is not None else (a.text or "")
            )
            history[i].append({"role": "assistant", "content": text})
            turns.append(Turn(conv=convs[i].id, turn=t + 1, prompt_ids=prompts[k], answer=a))
    return turns, wall


def summarize_run(server: Server, turns: list[Turn], wall: float, before: dict, after: dict) -> dict[str, Any]:
    tokens = sum(t.answer.completion_tokens for t in turns)
    out: dict[str, Any] = {
        "requests": len(turns),
        "completion_tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "latency_s": latency_stats([t.answer.latency_s for t in turns]),
        "accept_length": None,
    }
    if server.engine == "sglang":
        verify = [t.answer.spec_verify_ct for t in turns]
        if server.has_draft and all(v is not None for v in verify) and sum(verify) > 0:
            out["accept_length"] = round(tokens / sum(verify), 4)
            out["spec_verify_ct"] = sum(verify)
        elif server.has_draft:
            log(f"bench-serve: {server.url}: answers carry no meta_info.spec_verify_ct; no per-run accept length")
        out["server_accept_length"] = {
            "after": after.get("avg_spec_accept_length"),
            "before": before.get("avg_spec_accept_length"),
            "note": "the server's avg_spec_accept_length, cumulative since it started (not this run alone)",
        }
    else:
        drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
        accepted = after.get("accepted", 0.0) - before.get("accepted", 0.0)
        if drafts > 0:
            out["accept_length"] = round(1 + accepted / drafts, 4)
            b = before.get("per_pos", [])
            out["per_position_acceptance"] = [
                round((v - (b[j] if j < len(b) else 0.0)) / drafts, 4) for j, v in enumerate(after.get("per_pos", []))
            ]
            out["drafts"], out["accepted_tokens"] = drafts, accepted
        out["server_accept_length"] = {
            "after": round(1 + after["accepted"] / after["drafts"], 4) if after.get("drafts") else None,
            "before": round(1 + before["accepted"] / before["drafts"], 4) if before.get("drafts") else None,
            "note": "1 + accepted / drafts of the server's counters, cumulative since it started",
        }
    return out


def identical_fraction(a: list[Turn], b: list[Turn]) -> float | None:
    """Fraction of turns (matched by conversation and turn) whose outputs are identical: ids when both servers
    returned them, else texts."""
    theirs = {(t.conv, t.turn): t.answer for t in b}
    pairs = [(t.answer, theirs[(t.conv, t.turn)]) for t in a if (t.conv, t.turn) in theirs]
    if not pairs:
        return None

    def same(x: Answer, y: Answer) -> bool:
        if x.output_ids is not None and y.output_ids is not None:
            return x.output_ids == y.output_ids
        return (x.text or "") == (y.text or "")

    return round(sum(same(x, y) for x, y in pairs) / len(pairs), 4)


# ----------------------------------------------------------------------------------------------
# the command


def bench_serve(
    cfg: BenchServeConfig, *, out: Path, overwrite: bool = False, on_run: Callable[[str, int, dict], None] | None = None
) -> dict[str, Any]:
    """Check everything, run every concurrency against each server, write --out; returns the summary."""
    from eyas.common import check_out_dir
    from eyas.defaults import resolve_target
    from eyas.specdec.generate import load_prompts
    from eyas.target import load_tokenizer

    out = Path(out)
    check_out_dir(out, kind=KIND, overwrite=overwrite, empty_ok=True)
    convs = load_prompts(cfg.prompts, limit=cfg.limit)
    target_path = resolve_target(cfg.target)

    draft = probe(cfg.url, "--url", engine=cfg.engine, timeout=cfg.request_timeout)
    if not draft.has_draft and not cfg.allow_no_draft:
        why = (
            "speculative_algorithm is not set in its server info"
            if draft.engine == "sglang"
            else f"its /metrics has no {VLLM_DRAFTS} counter"
        )
        raise EyasError(
            f"--url {draft.url}: runs no draft model ({why}); start it with the draft "
            "(docs/serving.md), or pass --allow-no-draft to measure it anyway"
        )
    servers = [("draft", draft)]
    if cfg.baseline_url is not None:
        base = probe(cfg.baseline_url, "--baseline-url", engine=cfg.engine, timeout=cfg.request_timeout)
        if base.has_draft:
            raise EyasError(
                f"--baseline-url {base.url}: runs a draft model ({base.settings.get('speculative_algorithm') or 'spec-decode counters in /metrics'}); "
                "the baseline must serve the target alone"
            )
        if not same_model(draft.model, base.model):
            raise EyasError(
                f"--baseline-url {base.url} serves {base.model!r}, --url {draft.url} serves "
                f"{draft.model!r}: the speed-up needs the same target on both"
            )
        if base.engine != draft.engine:
            log(
                f"bench-serve: --url is {draft.engine}, --baseline-url is {base.engine}: the speed-up compares engines too"
            )
        servers.append(("baseline", base))
    tokenizer = load_tokenizer(target_path)  # after the servers answered: a wrong URL is named at once
    if getattr(tokenizer, "chat_template", None) is None:
        raise EyasError(f"--target {cfg.target}: its tokenizer has no chat template; the prompts are rendered with it")
    eos, target_context = target_eos_and_context(target_path, tokenizer)
    stop_ids = sorted(eos)
    probes = {name: check_tokenizer(s, tokenizer) for name, s in servers}
    contexts = [c for c in [target_context, *(s.context for _, s in servers)] if isinstance(c, int) and c > 0]
    context = min(contexts)
    eval_tau, eval_from = (
        eval_chain_tau_on(cfg.eval_report, [c.id for c in convs]) if cfg.eval_report is not None else (None, None)
    )
    log(
        f"bench-serve: {len(convs)} conversations ({sum(len(c.turns) for c in convs)} turns) from {cfg.prompts}, "
        f"max {cfg.max_new_tokens} new tokens a turn, concurrency {','.join(map(str, cfg.concurrency))}; "
        + "; ".join(f"{name}: {s.engine} {s.version or ''} at {s.url} ({s.model})" for name, s in servers)
    )

    runs: dict[str, dict[str, Any]] = {f"c{c}": {"concurrency": c} for c in cfg.concurrency}
    all_turns: dict[tuple[str, int], list[Turn]] = {}
    for name, server in servers:
        _warm_up(server, convs, tokenizer, cfg, stop_ids)
        for c in cfg.concurrency:
            before = server.spec_state()
            turns, wall = run_conversations(
                server,
                convs,
                tokenizer,
                concurrency=c,
                max_new_tokens=cfg.max_new_tokens,
                stop_ids=stop_ids,
                context=context,
                what=f"{name} c={c}",
            )
            res = summarize_run(server, turns, wall, before, server.spec_state())
            all_turns[(name, c)] = turns
            log(
                f"bench-serve: {name} c={c}: {res['tokens_per_s']:,.1f} tok/s, latency p50 "
                f"{res['latency_s']['p50']:.3f}s, accept length {res['accept_length']}"
            )
            if name == "draft":
                runs[f"c{c}"].update(res)
            else:
                runs[f"c{c}"]["baseline"] = res
            if on_run is not None:
                on_run(name, c, res)
    for c in cfg.concurrency:
        r = runs[f"c{c}"]
        if "baseline" in r:
            b = r["baseline"]["tokens_per_s"]
            r["speedup"] = round(r["tokens_per_s"] / b, 4) if b and r["tokens_per_s"] is not None else None
            r["outputs_identical_fraction"] = identical_fraction(all_turns[("draft", c)], all_turns[("baseline", c)])

    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "url": draft.url,
        "baseline_url": cfg.baseline_url,
        "engine": draft.engine,
        "target": str(target_path),
        "prompts": {
            "source": cfg.prompts,
            "conversations": len(convs),
            "turns": sum(len(c.turns) for c in convs),
            "limit": cfg.limit,
        },
        "max_new_tokens": cfg.max_new_tokens,
        "stop_token_ids": stop_ids,
        "concurrency": cfg.concurrency,
        "server": draft.settings,
        "tokenizer_probe": probes,
        "runs": runs,
        "definitions": {
            "tokens_per_s": "completion tokens of all turns / the summed wall seconds of the turns (turn 2 starts when "
            "every turn 1 has answered)",
            "accept_length": "tokens per verify round, counting the bonus token: SGLang sum(completion_tokens) / "
            "sum(spec_verify_ct) over the run; vLLM 1 + accepted / drafts from /metrics around the run",
            "speedup": "tokens_per_s with the draft / tokens_per_s of the baseline at the same concurrency",
            "outputs_identical_fraction": "turns whose greedy output ids are identical on both servers",
        },
    }
    if cfg.baseline_url is not None:
        summary["baseline_server"] = servers[1][1].settings
    if eval_tau is not None:
        c0 = 1 if 1 in cfg.concurrency else min(cfg.concurrency)
        engine_tau = runs[f"c{c0}"].get("accept_length")
        ratio = round(engine_tau / eval_tau, 4) if engine_tau else None
        summary["eval_chain_tau"] = round(eval_tau, 4)
        summary["eval_chain_tau_from"] = eval_from
        summary["accept_len_vs_eval_chain"] = ratio
        summary["accept_len_vs_eval_concurrency"] = c0
        if ratio is not None and not EVAL_RATIO_BAND[0] <= ratio <= EVAL_RATIO_BAND[1]:
            log(
                f"bench-serve: warning: the engine's accept length at concurrency {c0} ({engine_tau}) is {ratio}x eval's "
                f"chain tau ({eval_tau:.4f}), outside [{EVAL_RATIO_BAND[0]}, {EVAL_RATIO_BAND[1]}]; compare the draft settings "
                f"(server: {draft.settings.get('speculative_num_steps')} steps, topk "
                f"{draft.settings.get('speculative_eagle_topk')}) with eval's --chain-k"
            )
    summary["out"] = str(out)
    _write(out, summary, all_turns, cfg)
    return summary


def _warm_up(server: Server, convs, tokenizer, cfg: BenchServeConfig, stop_ids: list[int]) -> None:
    from eyas.specdec.generate import render

    for conv in (convs * cfg.warmup)[: cfg.warmup]:
        ids = render(tokenizer, [{"role": "user", "content": conv.turns[0]}])
        try:
            server.generate(ids, max_new_tokens=min(cfg.max_new_tokens, WARMUP_TOKENS), stop_ids=stop_ids)
        except RequestFailed as exc:
            raise EyasError(f"{server.option} {server.url}: a warm-up request failed: {exc}") from None


# ----------------------------------------------------------------------------------------------
# outputs


def _git_commit() -> str:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"


def _device(settings: dict[str, Any]) -> str:
    if settings.get("device") is None and settings.get("version") is None:
        return "unknown"
    parts = [str(settings.get("device") or "unknown device")]
    if settings.get("tp_size"):
        parts.append(f"tp {settings['tp_size']}")
    return f"{' '.join(parts)} ({'sglang' if 'model_path' in settings else 'vllm'} {settings.get('version') or '?'})"


def command_line(cfg: BenchServeConfig, out: Path) -> str:
    """The `eyas bench-serve` call that reproduces these settings."""
    args = ["eyas", "bench-serve"]
    defaults = BenchServeConfig.__dataclass_fields__
    for k, v in asdict(cfg).items():
        f = defaults[k]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if v == default and k != "url":
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            args.append(flag if v else f"--no-{flag[2:]}")
        else:
            args += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return shlex.join(args + ["--out", str(out)])


def ledger_lines(summary: dict[str, Any], cfg: BenchServeConfig, out: Path) -> list[dict[str, Any]]:
    """results.jsonl lines in benchmarks/results.jsonl's format."""
    common = {
        "date": datetime.date.today().isoformat(),
        "commit": _git_commit(),
        "device": _device(summary["server"]),
        "command": command_line(cfg, out),
    }
    prefix = f"{cfg.label}_" if cfg.label else ""
    lines = []
    for c in cfg.concurrency:
        r = summary["runs"][f"c{c}"]
        for metric, value, unit in (
            ("serve_tok_s", r.get("tokens_per_s"), "tokens/s"),
            ("serve_baseline_tok_s", (r.get("baseline") or {}).get("tokens_per_s"), "tokens/s"),
            ("serve_speedup", r.get("speedup"), "x"),
            ("serve_accept_len", r.get("accept_length"), "tokens per verify round"),
        ):
            if value is not None:
                lines.append({"metric": f"{prefix}{metric}_c{c}", "value": value, "unit": unit, **common})
    return lines


def markdown(summary: dict[str, Any]) -> str:
    f = lambda v, d=1: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
    s = summary["server"]
    lines = [
        "# eyas bench-serve",
        "",
        f"- server: {summary['url']} ({summary['engine']} {s.get('version') or ''}, model `{s.get('model_path') or s.get('model')}`)",
        f"- draft: {s.get('speculative_algorithm') or '-'}, draft model `{s.get('speculative_draft_model_path') or '-'}`, "
        f"steps {s.get('speculative_num_steps', '-')}, topk {s.get('speculative_eagle_topk', '-')}, "
        f"draft tokens {s.get('speculative_num_draft_tokens', s.get('num_speculative_tokens', '-'))}",
        f"- baseline: {summary['baseline_url'] or '-'}",
        f"- prompts: {summary['prompts']['source']}, {summary['prompts']['conversations']} conversations, "
        f"{summary['prompts']['turns']} turns, max {summary['max_new_tokens']} new tokens a turn, greedy",
        "",
        "| concurrency | tok/s draft | tok/s baseline | speed-up | accept length | server accept length (cumulative) "
        "| latency mean / p50 / p90 (s) | outputs identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["concurrency"]:
        r = summary["runs"][f"c{c}"]
        lat = r["latency_s"]
        lines.append(
            f"| {c} | {f(r['tokens_per_s'])} | {f((r.get('baseline') or {}).get('tokens_per_s'))} | "
            f"{f(r.get('speedup'), 3)} | {f(r.get('accept_length'), 3)} | "
            f"{f((r.get('server_accept_length') or {}).get('after'), 3)} | "
            f"{f(lat['mean'], 3)} / {f(lat['p50'], 3)} / {f(lat['p90'], 3)} | "
            f"{f(r.get('outputs_identical_fraction'), 3)} |"
        )
    if summary.get("accept_len_vs_eval_chain") is not None:
        lines += [
            "",
            f"accept length at concurrency {summary['accept_len_vs_eval_concurrency']} / eval's chain tau "
            f"{summary['eval_chain_tau']}: {summary['accept_len_vs_eval_chain']}",
        ]
    lines += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in summary["definitions"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """tok/s against concurrency for both servers; False (with a log line) when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log(f"bench-serve: no plot ({exc})")
        return False

    from eyas.common import save_figure

    cs = summary["concurrency"]
    runs = [summary["runs"][f"c{c}"] for c in cs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [r["tokens_per_s"] for r in runs], marker="o", label="with draft")
    if summary.get("baseline_url"):
        ax.plot(cs, [r["baseline"]["tokens_per_s"] for r in runs], marker="o", label="baseline (no draft)")
    ax.set(xlabel="concurrency (requests in flight)", ylabel="output tokens/s", title="eyas bench-serve")
    if len(cs) > 1 and max(cs) / min(cs) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    return True


def _write(
    out: Path, summary: dict[str, Any], all_turns: dict[tuple[str, int], list[Turn]], cfg: BenchServeConfig
) -> None:
    from eyas.common import atomic_directory, atomic_write_bytes, atomic_write_json

    with atomic_directory(out, overwrite=True, kind=KIND) as tmp:  # --out was checked before the runs
        atomic_write_json(tmp / "summary.json", summary)
        atomic_write_bytes(tmp / "report.md", markdown(summary).encode())
        plot(summary, tmp / "throughput.png")
        records = [
            {
                "server": name,
                "concurrency": c,
                "id": t.conv,
                "turn": t.turn,
                "prompt_ids": t.prompt_ids,
                "output_ids": t.answer.output_ids,
                "text": None if t.answer.output_ids is not None else t.answer.text,
                "completion_tokens": t.answer.completion_tokens,
                "spec_verify_ct": t.answer.spec_verify_ct,
                "latency_s": round(t.answer.latency_s, 4),
                "finish": t.answer.finish,
            }
            for (name, c), turns in all_turns.items()
            for t in turns
        ]
        atomic_write_bytes(tmp / "turns.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
        atomic_write_bytes(
            tmp / "results.jsonl", "".join(json.dumps(x) + "\n" for x in ledger_lines(summary, cfg, out)).encode()
        )
