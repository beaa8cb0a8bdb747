"""Regeneration through OpenAI-compatible servers (SGLang, vLLM, ...) at one or more URLs.

Each turn is one `POST {url}/v1/chat/completions` with the conversation so far, `max_tokens`,
`temperature`, `top_p` and a per-answer `seed` (so a rerun asks for the same samples; whether the
server honours it is the server's business). Requests run on a thread pool of `concurrency`
workers, spread round-robin over the URLs that answered the start-up probe.

Errors, by what they mean for the data:
- connection refused / reset / timeout, HTTP 429 and 5xx: transient; retried with exponential
  backoff (on the next URL). If every attempt for a request fails without any server answering,
  the servers are gone: the run stops with an error (what was decided is committed; rerunning
  resumes). A request that keeps getting 5xx answers is counted as `server_error`.
- HTTP 400/413/422 whose message speaks of the context length: `context_overflow`.
- other 4xx: `server_error` (no retry: the same request would fail again).
- finish_reason "length": the answer is kept and marked truncated.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import threading
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from eyas.common import http_body_excerpt, log
from eyas.errors import EyasError
from eyas.regen.requests import CONTEXT_OVERFLOW, SERVER_ERROR, Deliver, Pull, Request, Result
from eyas.regen.sampling import Sampling

_CONTEXT_WORDS = (
    "context length",
    "context_length",
    "maximum context",
    "max_model_len",
    "too long",
    "longer than",
    "context window",
    "exceeds the",
)


@dataclass(kw_only=True)
class ServerOptions:
    """Where and how to ask."""

    urls: list[str]
    """Base URLs, e.g. http://127.0.0.1:30000 (a trailing /v1 is accepted)."""
    model: str | None = None
    """Served model name for the `model` field; None = the first id from GET /v1/models."""
    concurrency: int = 64
    """Requests in flight at once, over all URLs."""
    retries: int = 4
    """Retries of a request after a transient error (connection, timeout, 429, 5xx)."""
    backoff_s: float = 1.0
    """First retry delay; doubles each retry (with jitter), capped at 30 s."""
    timeout_s: float = 600.0
    """Seconds to wait for one answer."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token (default: $OPENAI_API_KEY if set)."""

    def __post_init__(self):
        if not self.urls:
            raise ValueError("--server-url: give at least one URL")
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in self.urls]
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--server-url must start with http:// or https://, got {u!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.retries}")
        if self.api_key is None:
            self.api_key = os.environ.get("OPENAI_API_KEY")


class ServersGone(Exception):
    """Every attempt for a request failed without any server answering."""


def _is_context_error(text: str) -> bool:
    low = text.lower()
    return "context" in low and any(w in low for w in _CONTEXT_WORDS) or "too long" in low


class ServerEngine:
    def __init__(self, options: ServerOptions, *, sampling: Sampling):
        self.opt, self.sampling = options, sampling
        self.stop = threading.Event()
        self.models: dict[str, list[str]] = {}
        self.alive = self._probe()
        self.model = options.model or self.models[self.alive[0]][0]
        self._rr = itertools.cycle(range(len(self.alive)))
        self._rr_lock = threading.Lock()
        self.retried = 0

    # -- HTTP ------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.opt.api_key:
            h["Authorization"] = f"Bearer {self.opt.api_key}"
        return h

    def _http(self, method: str, url: str, body: dict | None, timeout: float) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")

    def _probe(self) -> list[str]:
        alive, errors = [], []
        for url in self.opt.urls:
            try:
                status, text = self._http("GET", f"{url}/v1/models", None, timeout=min(self.opt.timeout_s, 15.0))
                if status != 200:
                    errors.append(f"{url}: HTTP {status}")
                    continue
                ids = [m.get("id") for m in json.loads(text).get("data", []) if m.get("id")]
            except (OSError, ValueError) as exc:
                errors.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if not ids and self.opt.model is None:
                errors.append(f"{url}: /v1/models lists no model (pass --server-model)")
                continue
            self.models[url] = ids
            alive.append(url)
        if not alive:
            raise EyasError(
                "no server answered GET /v1/models at " + ", ".join(self.opt.urls) + " (" + "; ".join(errors) + "); "
                "start an OpenAI-compatible server (e.g. `python -m sglang.launch_server --model-path DIR`) "
                "or fix --server-url"
            )
        for url in self.opt.urls:
            if url not in alive:
                log(f"regen: {url} did not answer; using {len(alive)} of {len(self.opt.urls)} servers")
        return alive

    def _next_url(self) -> str:
        with self._rr_lock:
            return self.alive[next(self._rr)]

    def _payload(self, req: Request) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in req.messages],
            "max_tokens": req.max_new_tokens,
            "temperature": self.sampling.temperature,
            "seed": req.seed,
        }
        if not self.sampling.greedy:
            body["top_p"] = self.sampling.top_p
        return body

    def call(self, req: Request) -> Result:
        """One request with retries; raises ServersGone when no server ever answered."""
        body = self._payload(req)
        answered, last = False, ""
        for attempt in range(self.opt.retries + 1):
            if self.stop.is_set():
                raise ServersGone("stopped")
            if attempt:
                self.retried += 1
                delay = min(30.0, self.opt.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
                if self.stop.wait(delay):
                    raise ServersGone("stopped")
            url = self._next_url()
            try:
                status, text = self._http("POST", f"{url}/v1/chat/completions", body, timeout=self.opt.timeout_s)
            except (OSError, http.client.HTTPException) as exc:  # URLError, resets, timeouts, torn replies
                last = f"{url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            answered = True
            if status == 200:
                return self._parse(req, text, url)
            last = f"{url}: HTTP {status}: {http_body_excerpt(text, limit=300)}"
            if status in (400, 413, 422) and _is_context_error(text):
                return Result(req.key, failure=CONTEXT_OVERFLOW, detail=last)
            if status == 429 or status >= 500:
                continue
            return Result(req.key, failure=SERVER_ERROR, detail=last)
        if not answered:
            raise ServersGone(last)
        return Result(req.key, failure=SERVER_ERROR, detail=f"after {self.opt.retries} retries: {last}")

    def _parse(self, req: Request, text: str, url: str) -> Result:
        try:
            data = json.loads(text)
            choice = data["choices"][0]
            content = (choice.get("message") or {}).get("content") or ""
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return Result(
                req.key, failure=SERVER_ERROR, detail=f"{url}: malformed answer: {http_body_excerpt(text, limit=300)}"
            )
        return Result(
            req.key,
            text=content,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            new_tokens=int(usage.get("completion_tokens") or 0),
            truncated=choice.get("finish_reason") == "length",
        )

    # -- the loop --------------------------------------------------------------------------------
    def run(self, pull: Pull, deliver: Deliver) -> None:
        pool = ThreadPoolExecutor(max_workers=self.opt.concurrency, thread_name_prefix="eyas-regen")
        inflight: dict[Future, Request] = {}
        try:
            while True:
                room = self.opt.concurrency - len(inflight)
                if room > 0:
                    for req in pull(room):
                        inflight[pool.submit(self.call, req)] = req
                if not inflight:
                    return
                finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for fut in finished:
                    inflight.pop(fut)
                    try:
                        res = fut.result()
                    except ServersGone as exc:
                        raise EyasError(
                            f"the server(s) stopped answering ({exc}); rerun the same command to resume once "
                            f"{', '.join(self.opt.urls)} answer again"
                        ) from None
                    deliver(res)
        finally:
            self.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "server",
            "urls": self.opt.urls,
            "served_model": self.model,
            "concurrency": self.opt.concurrency,
            "retries": self.opt.retries,
        }
