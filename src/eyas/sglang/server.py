"""An SGLang server with the eyas plugin: HTTP, its info, and the preflight that refuses a server that cannot capture.

`preflight` reads `/server_info` (older servers: `/get_server_info`) and refuses, with the reason and the flags that
fix it, when the plugin is missing or inactive, its layer ids differ from the ones asked for, a speculative draft is
loaded, or a prompt prefix could be served from the radix cache with no per-request bypass.

Per-request radix-cache bypass (`cache_bypass`): `plugin` sends nothing extra: the plugin (version 3,
status `prefix_cap`) caps an eyas request's prefix match at 0 inside the server, as SGLang caps one
asking for every prompt token's logprob, and nothing extra is computed; `salt` sends a unique
`cache_salt` (SGLang >= 0.5.22 namespaces the radix tree by it: no prefix can match, but each
finished prompt is cached under its own key); `logprob` sends return_logprob with logprob_start_len 0
(caps the prefix match at 0 on every 0.5.x, but computes and returns every prompt token's logprob, which
slows the server's prefill); `none` requires --disable-radix-cache on the server.
`auto`: none when the radix cache is off, else the first of plugin, salt, logprob the server offers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import HTTPFailure, http_body_excerpt, http_request
from eyas.errors import EyasError
from eyas.sglang.core import CONVENTION, REPLAY_FLAG, sglang_layer_ids

CACHE_BYPASS = ("auto", "plugin", "salt", "logprob", "none")


REJECTED_LISTED = 1000  # rejected samples listed in the summary (all are counted and logged on stderr)
PLUGIN_FLAGS = (
    "install eyas into the server's Python environment (`pip install eyas`: it registers the "
    "`sglang.srt.plugins` entry point `eyas_capture`), start the server with EYAS_CAPTURE=1 "
    "EYAS_CAPTURE_LAYERS=<ids> in its environment, and do not leave it out of SGLANG_PLUGINS"
)


class TransientHTTPError(Exception):
    """Connection failures, timeouts, 5xx and 429: worth retrying."""


class PermanentHTTPError(Exception):
    """A 4xx answer (bad request, prompt too long): retrying will not help."""

    def __init__(self, message: str, *, code: int = 0):
        super().__init__(message)
        self.code = code


def http_json(method: str, url: str, body: dict | None = None, *, timeout: float = 60.0, parse=json.loads) -> Any:
    """One JSON request; an HTTP error's body is cut to a one-line excerpt (a wrong port may serve a whole page).
    `parse` reads the answer's bytes (`parse_answer` for /generate)."""
    try:
        raw = http_request(method, url, body, timeout=timeout)
    except HTTPFailure as exc:
        if exc.code is None or exc.code >= 500 or exc.code == 429:
            raise TransientHTTPError(str(exc)) from None
        raise PermanentHTTPError(str(exc), code=exc.code) from None
    try:
        return parse(raw or b"null")
    except ValueError:
        raise PermanentHTTPError(
            f"{url} answered with something that is not JSON: {http_body_excerpt(raw)!r}", code=200
        ) from None


_LOGPROB_KEYS = (b'"input_token_logprobs":', b'"output_token_logprobs":')


def parse_answer(raw: bytes) -> Any:
    """/generate's JSON answer without its per-token logprob lists, which the logprob bypass makes the server
    send (one [logprob, id, null] per prompt token) and the capture never reads: parsing them whole was the
    largest share of the client's GIL. A list is cut (to null) only when it holds nothing but numbers and
    nulls, so any other answer is parsed whole, as json.loads would."""
    for key in _LOGPROB_KEYS:
        i = raw.find(key)
        if i < 0 or raw.find(key, i + 1) >= 0:
            continue  # absent, or named twice (inside a string?): parsed as it is
        a = i + len(key)
        while raw[a : a + 1] in (b" ", b"\n"):  # json.dumps writes ": ", orjson ":"
            a += 1
        if raw[a : a + 2] == b"[]":
            continue
        end = raw.find(b"]]", a) + 2  # [[...],...,[...]]: its first "]]" closes it
        cut = raw[a:end]
        if end < 2 or cut[:2] != b"[[" or b'"' in cut or cut.count(b"[") != cut.count(b"]"):
            continue
        raw = raw[:a] + b"null" + raw[end:]
    return json.loads(raw)


def generate(url: str, body: dict[str, Any], *, timeout: float) -> Any:
    """POST /generate, the answer read by `parse_answer`."""
    return http_json("POST", f"{url}/generate", body, timeout=timeout, parse=parse_answer)


def get_server_info(url: str, *, timeout: float = 30.0) -> dict[str, Any]:
    """`GET /server_info`, falling back to the older `/get_server_info` when the first is absent."""
    url = url.rstrip("/")
    for path in ("/server_info", "/get_server_info"):
        try:
            return http_json("GET", f"{url}{path}", timeout=timeout)
        except PermanentHTTPError as exc:
            if exc.code != 404:
                raise
    raise PermanentHTTPError("HTTP 404 from /server_info and /get_server_info", code=404)


def plugin_state(info: dict[str, Any]) -> dict[str, Any] | None:
    """The eyas plugin's status inside a server-info answer (None: the plugin is not loaded)."""
    for st in info.get("internal_states") or []:
        if isinstance(st, dict) and isinstance(st.get("eyas_capture"), dict):
            return st["eyas_capture"]
    got = info.get("eyas_capture")
    return got if isinstance(got, dict) else None


def _version_tuple(v: Any) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(v).split(".post")[0].split(".")[:3])
    except ValueError:
        return (0,)


@dataclass(kw_only=True)
class ServerPlan:
    """One server, checked: how to talk to it and where its dumps appear."""

    url: str
    version: str
    bypass: str
    """Per-request radix-cache bypass in use: salt, logprob or none (radix cache disabled)."""
    dump_dir: Path
    status: dict[str, Any]
    info: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.status.get("model", {}).get("hidden_size") or 0)


def prefill_graph_backend(info: dict[str, Any]) -> str | None:
    """The prefill CUDA-graph backend a server runs, from its /server_info: the resolved
    `cuda_graph_config.prefill.backend` (SGLang reports the resolved ServerArgs: dataclasses.asdict up
    to 0.5.18, resolved_dict() from 0.5.19); None when the info has no such entry (the stand-in)."""
    cfg = info.get("cuda_graph_config")
    prefill = cfg.get("prefill") if isinstance(cfg, dict) else None
    backend = prefill.get("backend") if isinstance(prefill, dict) else None
    return None if backend is None else str(backend)


def prefill_graph_on(info: dict[str, Any]) -> bool:
    """Whether prefill forwards can take the prefill CUDA graph, whose replay batches carry no request ids.
    The resolved backend says it; without one, only `disable_prefill_cuda_graph` can say no (CUDA's
    default, breakable, is on; off CUDA SGLang's default is tc_piecewise up to 0.5.21, usually turned
    off by its compatibility cascade, and disabled from 0.5.22)."""
    backend = prefill_graph_backend(info)
    if backend is not None:
        return backend != "disabled"
    return not info.get("disable_prefill_cuda_graph")


def choose_bypass(info: dict[str, Any], requested: str) -> str:
    """The radix-cache bypass to use, or an EyasError naming the flags when none is safe."""
    if requested not in CACHE_BYPASS:
        raise EyasError(f"--sglang-cache-bypass: {requested!r}, expected one of {', '.join(CACHE_BYPASS)}")
    radix_off = bool(info.get("disable_radix_cache", False))
    capped = bool((plugin_state(info) or {}).get("prefix_cap"))
    if requested == "plugin" and not capped:
        raise EyasError(
            "--sglang-cache-bypass plugin: the server's eyas plugin does not cap prefix matches (plugin version "
            f"{(plugin_state(info) or {}).get('plugin_version')}, 3 needed): install this eyas into the server's "
            "environment, or choose salt (SGLang >= 0.5.22) or logprob"
        )
    if requested == "none":
        if not radix_off:
            raise EyasError(
                "the server's radix cache is on (disable_radix_cache = false) and --sglang-cache-bypass none was "
                "given: a prompt sharing a prefix with an earlier one would be captured without that prefix. "
                "Restart the server with --disable-radix-cache, or use --sglang-cache-bypass plugin, salt "
                "(SGLang >= 0.5.22) or logprob"
            )
        return "none"
    if requested == "auto":
        if radix_off:
            return "none"
        if capped:
            return "plugin"
        return "salt" if _version_tuple(info.get("version")) >= (0, 5, 22) else "logprob"
    return requested


def preflight(
    url: str,
    layer_ids: Sequence[int] | None,
    *,
    cache_bypass: str = "auto",
    dump_dir: str | Path | None = None,
    timeout: float = 30.0,
) -> ServerPlan:
    """Read the server's info and refuse with the reason and the fix (see the module docstring)."""
    url = url.rstrip("/")
    try:
        info = get_server_info(url, timeout=timeout)
    except PermanentHTTPError as exc:
        raise EyasError(f"--url {url}: {exc} (not an SGLang server with the eyas plugin?)") from None
    except TransientHTTPError as exc:
        raise EyasError(f"--url {url}: cannot read the server's info ({exc}); is the SGLang server up?") from None
    if not isinstance(info, dict):
        raise EyasError(f"--url {url}: /server_info returned {type(info).__name__}, expected a JSON object")
    version = str(info.get("version", "?"))
    status = plugin_state(info)
    if status is None:
        raise EyasError(
            f"--url {url}: the eyas capture plugin is not loaded in this server (SGLang {version}: no "
            f"`eyas_capture` in /server_info internal_states). To fix: {PLUGIN_FLAGS}"
        )
    if not status.get("enabled", False):
        raise EyasError(
            f"--url {url}: the eyas plugin is loaded but capture is not active on the model "
            f"(last error: {status.get('last_error') or 'none'}); check the server log for `eyas capture`"
        )
    if info.get("speculative_algorithm"):
        raise EyasError(
            f"--url {url}: the server runs speculative decoding ({info['speculative_algorithm']}); "
            "start a capture server without --speculative-algorithm"
        )
    if info.get("enable_dp_attention") or int(info.get("attn_dp_size") or 1) > 1:
        raise EyasError(
            f"--url {url}: the server runs DP attention (enable_dp_attention / attn_dp_size > 1): one "
            "batch's rows are spread over ranks. Restart it without --enable-dp-attention (plain TP, or "
            "--dp-size replicas)"
        )
    for flag in ("enable_two_batch_overlap", "enable_single_batch_overlap"):
        if info.get(flag):
            raise EyasError(
                f"--url {url}: the server has {flag} on: DeepSeek-family models skip aux capture for "
                f"overlapped micro-batches. Restart it without --{flag.replace('_', '-')}"
            )
    if info.get("enable_prefill_cp"):
        raise EyasError(
            f"--url {url}: the server has enable_prefill_cp on: prefill context parallelism splits a "
            "prompt's tokens across ranks, so the writing rank would see only part of each sequence. "
            "Restart it without --enable-prefill-cp"
        )
    if prefill_graph_backend(info) == "tc_piecewise":
        raise EyasError(
            f"--url {url}: the server's prefill CUDA graph backend is tc_piecewise (SGLang's default off "
            "CUDA up to 0.5.21): it compiles the logits step the plugin hooks. Restart it with "
            f"{REPLAY_FLAG}, or --cuda-graph-backend-prefill breakable or full where the platform "
            "supports them"
        )
    if int(status.get("plugin_version") or 0) < 2 and prefill_graph_on(info):
        raise EyasError(
            f"--url {url}: the server's eyas plugin (version {status.get('plugin_version')}) cannot find "
            "request ids under the prefill CUDA graph, which this server runs (SGLang's default on "
            "CUDA). Install this eyas into the server's environment, or restart it with " + REPLAY_FLAG
        )
    have = [int(i) for i in status.get("layer_ids", [])]
    if layer_ids is not None and list(layer_ids) != have:
        raise EyasError(
            f"--url {url}: the server captures layers {have} ({CONVENTION}; SGLang ids {sglang_layer_ids(have)}) but "
            f"{list(layer_ids)} were asked for. Restart the server with EYAS_CAPTURE_LAYERS="
            f"{','.join(map(str, layer_ids))}, or pass --aux-layers {','.join(map(str, have))}"
        )
    bypass = choose_bypass(info, cache_bypass)
    ddir = Path(dump_dir) if dump_dir is not None else Path(status.get("dump_dir", ""))
    if not ddir.is_dir():
        raise EyasError(
            f"--url {url}: the dump directory {ddir} (reported by the plugin: {status.get('dump_dir')}) is "
            "not visible here. Run the client on the server's host, or point EYAS_DUMP_DIR on the server "
            "and --sglang-dump-dir here at one shared directory"
        )
    return ServerPlan(url=url, version=version, bypass=bypass, dump_dir=ddir, status=status, info=info)


def request_ids_lost(before: dict[str, Any], after: dict[str, Any], info: dict[str, Any]) -> bool:
    """Whether the plugin dropped forwards between two readings of its stats because it found no request
    ids for them (`rid_less_forwards` grew). A plugin without that counter: it saw scheduler batches
    but took no ids from them, although the prefill CUDA graph is on."""

    def grew(key: str) -> int:
        return int(after.get(key, 0) or 0) - int(before.get(key, 0) or 0)

    if "rid_less_forwards" in after:
        return grew("rid_less_forwards") > 0
    return grew("live_batches") > 0 and grew("rids_from_live_batch") <= 0 and prefill_graph_on(info)


def missing_dump_cause(plan: ServerPlan, stats: dict[str, Any]) -> str | None:
    """Why dumps are missing, from the plugin's counters read after the requests (`stats`; {} when unread),
    as a sentence with its fix; None when the counters show nothing (then the dump directory is the suspect)."""
    if not int(stats.get("live_batches", 1) or 0):
        return (
            "plugin saw no scheduler batch (its ModelRunner.forward hook is not active: look for 'Failed to "
            f"apply hooks' in the server log); until that is fixed, restart the server with {REPLAY_FLAG}"
        )
    if request_ids_lost(plan.status.get("stats") or {}, stats, plan.info):
        n = stats.get("rid_less_forwards")
        return (
            "plugin dropped forwards whose request ids it could not find (prefill CUDA-graph replay batches "
            "without rids, and no scheduler batch on the same thread to take them from"
            + (f": rid_less_forwards = {n}" if n is not None else "")
            + f"); restart the server with {REPLAY_FLAG}"
        )
    return None
