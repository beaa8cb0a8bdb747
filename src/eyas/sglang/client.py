"""Capture from running SGLang servers: preflight, send prompts, verify every dump, ingest.

The server side is the eyas plugin (plugin.py) writing one dump per request into a directory this
process can read (default /dev/shm/eyas-dumps on the server host). The client:

1. preflight, per URL: reads `/server_info` (older servers: `/get_server_info`) and refuses, with
   the reason and the flags that fix it, when the plugin is missing or inactive, its layer ids
   differ from the ones asked for, a speculative draft is loaded, or a prompt prefix could be served
   from the radix cache with no per-request bypass; then one probe request proves that dumps
   appear in the dump directory this process reads.
2. sends each sample as `input_ids` with max_new_tokens 1 (concurrency bounded per URL; several
   URLs = data parallel), with a rid `eyas.<L>.<tag>` that tells the plugin the prompt length;
3. checks every sample: cached_tokens == 0, prompt_tokens == L, dump status complete, dumped
   token count == L, positions 0..L-1 all present, dumped token ids == the sample's ids, layer ids;
4. ingests verified samples into the store (eyas.store.StoreWriter, the same store as the
   transformers backend) and deletes each dump once read, so /dev/shm holds only in-flight samples;
   resumes from the store's committed ids; retries transient HTTP errors with exponential backoff;
   counts and lists rejected samples (a rerun of the same command retries them).

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

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import queue
import random
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.common import HTTPFailure, http_body_excerpt, http_request, log, progress
from eyas.errors import EyasError
from eyas.sglang.core import (
    CONVENTION,
    META_FILE,
    REPLAY_FLAG,
    Dump,
    all_finite,
    make_rid,
    parse_rid,
    read_dump,
    sglang_layer_ids,
)

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


# ----------------------------------------------------------------------------- preflight


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


# ----------------------------------------------------------------------------- one request


def build_request(input_ids: Sequence[int], rid: str, bypass: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    }
    if bypass == "salt":
        body["cache_salt"] = rid
    elif bypass == "logprob":
        body.update(return_logprob=True, logprob_start_len=0)
    return body


DUMP_POLL_S = (0.0005, 0.005)
"""wait_for_dump's first and longest pause between looks for a dump: a dump lands milliseconds after the
answer, and a long pause would add itself to the time every sample spends in flight."""


def dump_appeared(dump_dir: Path, rid: str, *, timeout: float, sleep=time.sleep) -> bool:
    """Whether the dump of `rid` is there (its meta.json is written last) within `timeout` seconds."""
    meta = str(dump_dir / rid / META_FILE)
    deadline = time.monotonic() + timeout
    delay, longest = DUMP_POLL_S
    while True:
        if os.path.isfile(meta):
            return True
        if time.monotonic() > deadline:
            return False
        sleep(delay)
        delay = min(delay * 1.5, longest)


def wait_for_dump(dump_dir: Path, rid: str, *, timeout: float, sleep=time.sleep) -> Dump | None:
    """The dump of `rid`, read whole, or None if it did not appear within `timeout` seconds."""
    return read_dump(dump_dir / rid) if dump_appeared(dump_dir, rid, timeout=timeout, sleep=sleep) else None


NO_DUMP = "no dump appeared"
"""How `check_sample`'s reason for a request without a dump begins (`missing_dump_cause` explains it)."""


def check_sample(
    input_ids: torch.Tensor,
    meta_info: dict[str, Any],
    dump: Dump | None,
    *,
    layer_ids: Sequence[int],
    hidden_size: int | None = None,
) -> str | None:
    """Why this sample cannot be trusted, or None when every check passes."""
    L = int(input_ids.shape[0])
    cached = int(meta_info.get("cached_tokens", 0) or 0)
    if cached != 0:
        return f"cached_tokens = {cached}: a prefix was served from the radix cache"
    prompt = meta_info.get("prompt_tokens")
    if prompt is None or int(prompt) != L:
        return f"prompt_tokens = {prompt}, sent {L} input ids"
    if dump is None:
        return f"{NO_DUMP} (plugin writer behind or dump dir not shared?)"
    m = dump.meta
    if m.get("status") != "complete":
        return f"plugin rejected it: {m.get('reason') or m.get('status')}"
    if int(m.get("num_tokens", -1)) != L:
        return f"dump holds {m.get('num_tokens')} tokens, expected {L}"
    if list(m.get("layer_ids", [])) != list(layer_ids) or m.get("convention") != CONVENTION:
        return (
            f"dump has layers {m.get('layer_ids')} ({m.get('convention')}), expected {list(layer_ids)} ({CONVENTION})"
        )
    covered = sorted((int(a), int(b)) for a, b in m.get("positions_covered", []))
    end = 0
    for a, b in covered:
        if a != end:
            return f"positions {end}..{a - 1} missing from the dump"
        end = b
    if end != L:
        return f"dump covers positions 0..{end - 1}, expected 0..{L - 1}"
    if dump.positions_L is not None and not torch.equal(dump.positions_L.to(torch.int64), torch.arange(L)):
        return "dumped positions are not 0..L-1"
    A = len(layer_ids)
    if dump.aux_LAD is None or dump.aux_LAD.shape[:2] != (L, A) or dump.final_LD.shape[0] != L:
        return (
            f"dump shapes aux {tuple(dump.aux_LAD.shape) if dump.aux_LAD is not None else None}, final "
            f"{tuple(dump.final_LD.shape) if dump.final_LD is not None else None}, expected [{L}, {A}, H], [{L}, H]"
        )
    if hidden_size and dump.aux_LAD.shape[2] != hidden_size:
        return f"dump hidden size {dump.aux_LAD.shape[2]}, the server's model has {hidden_size}"
    if dump.input_ids_L is not None and not torch.equal(dump.input_ids_L.to(torch.int64), input_ids.to(torch.int64)):
        return "dumped token ids differ from the sample's input ids"
    if not (all_finite(dump.aux_LAD) and all_finite(dump.final_LD)):
        return "non-finite values (NaN/Inf) in the dump"
    return None


@dataclass(kw_only=True)
class Outcome:
    sample_id: str
    tokens: int
    hidden_LSD: torch.Tensor | None = None
    """The verified states stacked as the store keeps them: [L, A+1, H], aux slots then the final state (None once
    `encoded` holds them)."""
    encoded: Any = None
    """The same in the stored dtype with its checksum (StoreWriter.encode), when the sender asked for it."""
    reason: str | None = None
    retries: int = 0
    dump_dtype: str | None = None
    pieces: int = 0
    """EXTEND forwards the prompt took on the server (> 1: chunked prefill was stitched)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where this sample's time went: `request` (at the server), `dump` (waiting for and reading the
    dump after the answer), `check` (checking and stacking it), `encode` (stored rows, checksum)."""


def remove_dump(dump_dir: Path, rid: str) -> None:
    shutil.rmtree(dump_dir / rid, ignore_errors=True)


def capture_one(
    plan: ServerPlan,
    sample_id: str,
    input_ids: torch.Tensor,
    tag: str,
    *,
    layer_ids: Sequence[int],
    max_retries: int = 5,
    backoff_s: float = 1.0,
    request_timeout_s: float = 600.0,
    dump_wait_s: float = 60.0,
    sleep=time.sleep,
    gate=None,
    encode=None,
) -> Outcome:
    """Send one sample (retrying transient HTTP errors), then read, check and delete its dump.

    `gate` (a semaphore) is held only while the request is at the server: waiting for the dump,
    reading and checking it leave the slot to the next sample. `encode` (the store writer's) turns a
    verified sample into the stored rows and their checksum (`check_and_encode`)."""
    L = int(input_ids.shape[0])
    retries = 0
    seconds = {"gate": 0.0, "request": 0.0, "dump": 0.0, "check": 0.0}
    while True:
        rid = make_rid(L, f"{tag}-{retries}")
        remove_dump(plan.dump_dir, rid)
        try:
            t_gate = time.perf_counter()
            with gate if gate is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                seconds["gate"] += t0 - t_gate
                try:
                    out = generate(
                        plan.url, build_request(input_ids.tolist(), rid, plan.bypass), timeout=request_timeout_s
                    )
                finally:
                    seconds["request"] += time.perf_counter() - t0
            break
        except TransientHTTPError as exc:
            remove_dump(plan.dump_dir, rid)
            if retries >= max_retries:
                return Outcome(
                    sample_id=sample_id, tokens=L, reason=f"HTTP failed {retries + 1} times: {exc}", retries=retries
                )
            sleep(min(backoff_s * 2**retries, 30.0) * (0.5 + random.random() / 2))
            retries += 1
        except PermanentHTTPError as exc:
            remove_dump(plan.dump_dir, rid)
            return Outcome(sample_id=sample_id, tokens=L, reason=str(exc), retries=retries)
    if isinstance(out, list):
        out = out[0] if out else {}
    if isinstance(out, dict) and out.get("error") and not out.get("meta_info"):
        remove_dump(plan.dump_dir, rid)
        return Outcome(
            sample_id=sample_id, tokens=L, reason=f"server error: {str(out['error'])[:300]}", retries=retries
        )
    meta_info = (out or {}).get("meta_info", {})
    t0 = time.perf_counter()
    try:
        there = int(meta_info.get("cached_tokens", 0) or 0) == 0 and dump_appeared(
            plan.dump_dir, rid, timeout=dump_wait_s
        )
        checked = check_and_encode(
            plan.dump_dir / rid if there else None,
            sample_id,
            input_ids,
            meta_info,
            layer_ids=layer_ids,
            hidden_size=plan.hidden_size,
            encode=encode,
        )
    finally:
        remove_dump(plan.dump_dir, rid)
    checked.seconds["dump"] += time.perf_counter() - t0 - sum(checked.seconds.values())  # the wait for it too
    return replace(checked, retries=retries, seconds={**seconds, **checked.seconds})


def check_and_encode(
    path: Path | None,
    sample_id: str,
    input_ids: torch.Tensor,
    meta_info: dict[str, Any],
    *,
    layer_ids,
    hidden_size,
    encode,
) -> Outcome:
    """Read a sample's dump (`path` None: none appeared), check it, stack its states as the store keeps them and
    encode them (`encode` None: left stacked), on the request thread that sent it."""
    L = int(input_ids.shape[0])
    t0 = time.perf_counter()
    dump = read_dump(path) if path is not None else None
    t1 = time.perf_counter()
    reason = check_sample(input_ids, meta_info, dump, layer_ids=layer_ids, hidden_size=hidden_size)
    hidden = (
        None
        if reason is not None
        else torch.cat([dump.aux_LAD, dump.final_LD.unsqueeze(1).to(dump.aux_LAD.dtype)], dim=1)
    )
    t2 = time.perf_counter()
    seconds = {"dump": t1 - t0, "check": t2 - t1}
    if reason is not None:
        return Outcome(sample_id=sample_id, tokens=L, reason=reason, seconds=seconds)
    encoded = encode(sample_id, hidden) if encode is not None else None
    seconds["encode"] = time.perf_counter() - t2
    return Outcome(
        sample_id=sample_id,
        tokens=L,
        hidden_LSD=hidden if encoded is None else None,  # the encoded rows alone wait in the ingest queue
        encoded=encoded,
        seconds=seconds,
        dump_dtype=dump.meta.get("dtype"),
        pieces=int(dump.meta.get("pieces", 0)),
    )


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


def probe(
    plan: ServerPlan,
    input_ids: torch.Tensor,
    *,
    layer_ids: Sequence[int],
    tag: str,
    dump_wait_s: float = 60.0,
    request_timeout_s: float = 120.0,
    max_retries: int = 5,
    backoff_s: float = 1.0,
) -> Outcome:
    """One real request through the whole path; an EyasError explains what is wrong."""
    res = capture_one(
        plan,
        "probe",
        input_ids,
        tag,
        layer_ids=layer_ids,
        max_retries=max_retries,
        backoff_s=backoff_s,
        request_timeout_s=request_timeout_s,
        dump_wait_s=dump_wait_s,
    )
    if res.reason is not None:
        hint = ""
        if res.reason.startswith(NO_DUMP):
            try:
                stats = (plugin_state(get_server_info(plan.url)) or {}).get("stats", {})
            except (TransientHTTPError, PermanentHTTPError):
                stats = {}
            cause = missing_dump_cause(plan, stats)
            hint = (
                f" The {cause}"
                if cause
                else f" The server answered but no dump appeared in {plan.dump_dir}: run the client on the host "
                "where the writing rank runs (attention-TP rank 0 of the last pipeline stage), or share "
                "EYAS_DUMP_DIR"
            )
        raise EyasError(f"--url {plan.url}: the probe request failed: {res.reason}.{hint}")
    if plan.bypass == "plugin" and not plan.info.get("disable_radix_cache"):
        _check_prefix_cap(plan)
    return res


def _check_prefix_cap(plan: ServerPlan) -> None:
    """The plugin's cap on eyas requests' prefix match took the probe (its counter grew): else SGLang does not run
    the hooked method, and prompts sharing a prefix would come back rejected."""
    before = int((plan.status.get("stats") or {}).get("prefix_caps", 0) or 0)
    try:
        after = int(((plugin_state(get_server_info(plan.url)) or {}).get("stats") or {}).get("prefix_caps", 0) or 0)
    except (TransientHTTPError, PermanentHTTPError) as exc:
        raise EyasError(f"--url {plan.url}: cannot read the server's info after the probe ({exc})") from None
    if after <= before:
        raise EyasError(
            f"--url {plan.url}: the eyas plugin reports a prefix cap, but the probe request did not pass through it "
            "(its hook on Req._compute_max_prefix_len is not in effect: look for 'Failed to apply hooks' in the server "
            "log); pass --sglang-cache-bypass logprob (or salt on SGLang >= 0.5.22), or restart the server with "
            "--disable-radix-cache"
        )


# ----------------------------------------------------------------------------- the store


def _job_tag(out_store: Path, split: str) -> str:
    return hashlib.sha256(f"{Path(out_store).resolve()}|{split}".encode()).hexdigest()[:10]


def remove_stale_dumps(dump_dir: Path, job: str) -> int:
    """Delete dumps a crashed run of this job left behind (their samples are re-sent)."""
    n = 0
    for p in list(dump_dir.iterdir()) if dump_dir.is_dir() else []:
        if parse_rid(p.name) is not None and p.name.split(".", 2)[2].startswith(job + "-"):
            shutil.rmtree(p, ignore_errors=True)
            n += 1
    return n


def _model_dtype(name: str | None) -> str | None:
    """The store's model_dtype (bf16 | fp32: what `eyas verify` recomputes in) for a dump's dtype.

    An fp16 server is recorded as bf16 (the closest dtype the numbers check runs in, with the
    16-bit tolerance); the exact dtype goes into the producer record."""
    return {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32"}.get(name or "", name)


def open_store(
    out_store: Path,
    *,
    prepared,
    split: str,
    layer_ids: Sequence[int],
    hidden_size: int,
    dtype: str,
    target: str | Path | None,
    model_dtype: str | None,
    limit: int | None,
    producer: dict[str, Any],
    laps: _Laps | None = None,
):
    from eyas.store.writer import StoreSpec, StoreWriter

    lap = laps.lap if laps is not None else (lambda name: None)
    identity = None
    if target is not None:
        from eyas.target import load_tokenizer, model_identity, tokenizer_hash

        identity = model_identity(target)
        lap("target_identity")
        tok_hash = tokenizer_hash(load_tokenizer(target))
        lap("tokenizer")
        if prepared.tokenizer_hash is not None and prepared.tokenizer_hash != tok_hash:
            raise EyasError(
                f"--data {prepared.root} was tokenised with another tokenizer (hash {prepared.tokenizer_hash[:12]}) "
                f"than the target {target} (hash {tok_hash[:12]}); prepare the data with this target's tokenizer"
            )
    else:
        log(
            "eyas: no --target: the store will not record the model's identity, and `eyas verify` cannot check its "
            "numbers; pass --target with the served model's directory (the server's model_path is used when it exists here)"
        )
    sp = prepared.split(split)
    spec = StoreSpec(
        aux_layer_ids=list(layer_ids),
        hidden_size=hidden_size,
        dtype=dtype,
        convention=CONVENTION,
        target=identity,
        tokenizer_hash=prepared.tokenizer_hash,
        prepared={
            "path": str(Path(prepared.root).resolve()),
            "split": split,
            "fingerprint": sp.fingerprint,
            "limit": limit,
            "samples": len(sp) if limit is None else min(limit, len(sp)),
        },
        model_dtype=model_dtype,
        producer=producer,
    )
    writer = StoreWriter(out_store, spec)
    lap("open_store")
    return writer


def capture_from_sglang(
    urls: Sequence[str],
    prepared: str | Path,
    split: str,
    out_store: str | Path,
    layer_ids: Sequence[int] | None,
    *,
    target: str | Path | None = None,
    dump_dir: str | Path | None = None,
    concurrency: int = 16,
    cache_bypass: str = "auto",
    dtype: str = "bf16",
    limit: int | None = None,
    max_retries: int = 5,
    backoff_s: float = 1.0,
    request_timeout_s: float = 600.0,
    dump_wait_s: float = 60.0,
    mark_complete_with_rejections: bool = False,
    calibrate: int = 8,
    device: str = "cpu",
    memory_bytes: int | None = None,
    procs: int = 0,
) -> dict[str, Any]:
    """Capture `split` of a prepared dataset from SGLang servers into the store at `out_store`.

    `layer_ids` are eyas ids (hf-input); None = whatever the servers capture (they must agree).
    `target` (a local HF directory of the served model) records its identity in the store, which
    `eyas verify` needs for its numbers check; with it, `calibrate` stored samples are then recomputed
    with verify's reference on `device` and the engine's errors recorded in the manifest
    (`engine_numerics`, eyas.store.numerics), which set verify's limits for this store; a calibration
    that verify would refuse raises CheckFailed once the store is closed. `memory_bytes` bounds the states
    held (StateBudget; default: an eighth of this machine's memory). `procs`: see _capture_loop."""
    from eyas.data.prepared import PreparedDataset

    _check_capture_options(
        urls,
        concurrency=concurrency,
        max_retries=max_retries,
        dump_wait_s=dump_wait_s,
        request_timeout_s=request_timeout_s,
        memory_bytes=memory_bytes,
        procs=procs,
    )
    t0 = time.time()
    setup = _Laps(t0)
    ds = PreparedDataset(prepared)
    sp = ds.split(split)
    n_total = len(sp) if limit is None else min(limit, len(sp))
    setup.lap("data")
    job = _job_tag(Path(out_store), split)
    run = os.urandom(3).hex()  # rids differ between runs: a rerun never meets a server's memory of an earlier one
    plans, layer_ids, probes = _reach_servers(
        urls,
        layer_ids,
        sp[0].input_ids if n_total else torch.arange(100, 116),
        job=job,
        laps=setup,
        cache_bypass=cache_bypass,
        dump_dir=dump_dir,
        probe_kw={"dump_wait_s": dump_wait_s, "max_retries": max_retries, "backoff_s": backoff_s},
    )
    budget = StateBudget(memory_bytes if memory_bytes is not None else default_memory_bytes())
    row_bytes = probes[0].hidden_LSD[0].nbytes  # one token's states as the servers send them
    # started now, the workers' imports pass beside the store's opening; a failure before the loop ends them
    workers = _Workers.start(procs, concurrency, len(plans), budget, row_bytes, sp.lengths)
    with _closed_on_error(workers):
        writer, target = _open_capture_store(
            Path(out_store),
            ds,
            plans,
            probes,
            split=split,
            layer_ids=layer_ids,
            dtype=dtype,
            target=target,
            limit=limit,
            laps=setup,
        )
        todo = _samples_to_capture(sp, n_total, writer, plans, layer_ids)

    tally = _Tally(retries=sum(p.retries for p in probes))
    bar = progress(sum(int(sp.lengths[i]) for i in todo), "capture (sglang)", unit="tok")
    ok = False
    loop_t0, loop_cpu0 = time.time(), time.process_time()
    phases = {"setup": loop_t0 - t0}
    intra_op = torch.get_num_threads()
    try:
        _capture_loop(
            plans,
            sp,
            todo,
            writer,
            tally,
            bar,
            concurrency=concurrency,
            budget=budget,
            row_bytes=row_bytes,
            rid_tag=f"{job}-{run}",
            layer_ids=layer_ids,
            max_retries=max_retries,
            backoff_s=backoff_s,
            request_timeout_s=request_timeout_s,
            dump_wait_s=dump_wait_s,
            workers=workers,
        )
        loop_s = time.time() - loop_t0
        phases["loop"], phases["loop_cpu"] = loop_s, time.process_time() - loop_cpu0
        # ok only after the calibration: one that fails leaves the store unfinished, and the same command retries it
        calibration = _calibrate(
            writer,
            Path(out_store),
            sp,
            target,
            calibrate=calibrate,
            device=device,
            engine={"backend": "sglang", "sglang_version": plans[0].version, "server_dtype": probes[0].dump_dtype},
        )
        phases["calibrate"] = time.time() - loop_t0 - loop_s
        ok = True
    finally:
        torch.set_num_threads(intra_op)  # the request threads' setting is process-wide for new threads
        bar.close()
        if workers is not None:
            workers.close()
        t_close = time.time()
        _remove_job_dumps(plans, job)  # late dumps of timed-out attempts: keep /dev/shm bounded
        complete = ok and (not tally.rejected or mark_complete_with_rejections)
        manifest = writer.close(complete=complete)  # commits verified samples even after an error
        phases["close"] = time.time() - t_close
    summary = _capture_summary(
        tally,
        plans,
        out_store=out_store,
        split=split,
        layer_ids=layer_ids,
        n_total=n_total,
        n_todo=len(todo),
        store_complete=manifest.get("status") == "complete",
        elapsed=time.time() - t0,
        loop_s=loop_s,
        phases=phases,
        setup_seconds=setup.seconds,
        store_seconds=writer.seconds,
        calibration=calibration,
        memory={"limit_bytes": budget.limit, "peak_bytes": budget.peak},
        procs=0 if workers is None else len(workers.procs),
    )
    _refuse_disagreeing_engine(calibration, out_store, plans[0].url, summary)
    return summary


def _samples_to_capture(split, n_total: int, writer, plans: Sequence[ServerPlan], layer_ids) -> list[int]:
    """The indices of the samples of `split` (its first `n_total`) the store does not hold yet, said in the log."""
    done_ids = writer.committed_ids
    todo = [i for i in range(n_total) if split.ids[i] not in done_ids]
    log(
        f"eyas capture (sglang): {len(todo)} of {n_total} samples to capture from {len(plans)} server(s) "
        f"({n_total - len(todo)} already in {writer.path}); layers {layer_ids} ({CONVENTION}), "
        f"bypass {[p.bypass for p in plans]}"
    )
    return todo


def _refuse_disagreeing_engine(calibration: dict[str, Any], out_store, url: str, summary: dict[str, Any]) -> None:
    """CheckFailed (with the summary) when the calibration found the engine's numbers off the reference."""
    if calibration.get("problem"):
        from eyas.errors import CheckFailed

        raise CheckFailed(
            f"store {out_store}: the engine's numbers disagree with the reference: {calibration['problem']}; "
            f"check the server (`eyas verify-server --url {url} --target ...`)",
            summary,
        )


def _capture_loop(plans, split, todo, writer, tally, bar, *, workers, **sender_kw):
    """Send every sample of `todo` and store each verified one. `concurrency` requests at each server (its
    gate); as many more samples again are being read and checked, or wait for a slot, so that a server
    never waits for this process to read a dump. With `workers` (_Workers, --sglang-procs), they share the
    samples and the slots, and this process only stores. `sender_kw`: `concurrency`, then _Sender's fields."""
    send = _send_all if workers is None else workers.run
    send(plans, split, todo, writer, tally, bar, encode=writer.encoder(), **sender_kw)


def _send_all(plans, split, todo, writer, tally, bar, *, concurrency: int, **sender_kw) -> None:
    """The request threads on `todo`: `concurrency` slots at each server, as many samples again being read and
    checked; each outcome to `tally.ingest(outcome, writer)`. `sender_kw`: the rest of _Sender's fields."""
    queued = 2 * concurrency * len(plans)
    # one intra-op thread per request thread: each checks and encodes a sample at a time, and torch's own
    # thread team per thread would oversubscribe the cores many times over
    with cf.ThreadPoolExecutor(max_workers=queued, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        sender = _Sender(
            pool=pool,
            plans=plans,
            gates=[threading.BoundedSemaphore(concurrency) for _ in plans],
            split=split,
            todo=iter(todo),
            **sender_kw,
        )
        _send_and_ingest(sender, writer, tally, bar, queued=queued)


@dataclass(frozen=True)
class _WorkerEnd:
    """A capture worker's last message: None, or the error that ended it; the most bytes of states it held."""

    worker: int
    error: str | None
    peak_bytes: int = 0


class _Spooler:
    """A capture worker's tally: each outcome goes to the parent, its rows in a file (`EncodedSample.spool`: a
    pipe would take the parent's GIL once per pipe buffer). The bounded queue holds the worker back when the
    parent's store is slower than the servers."""

    def __init__(self, results, spool_dir: str):
        self.results, self.spool_dir, self.n = results, spool_dir, 0

    def ingest(self, res: Outcome, writer) -> None:
        if res.encoded is not None:
            self.n += 1
            res = replace(res, encoded=res.encoded.spool(os.path.join(self.spool_dir, f"{os.getpid()}-{self.n}")))
        self.results.put(res)

    def update(self, n: int) -> None:  # the progress bar's part: the parent counts
        pass


def _capture_worker(k: int, tasks, results, spool_dir: str) -> None:
    """One of --sglang-procs processes: for each task (`_Workers.run`), sends its share of the samples through its
    share of each server's slots, reads, checks and encodes their dumps, and hands every outcome to the parent
    (`_Spooler`); then a `_WorkerEnd`. None ends it, and so does the parent's end (killed, it cannot say so)."""
    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    while (task := tasks.get()) is not None:
        budget = StateBudget(task.pop("memory_bytes"))
        try:
            _worker_task(task, budget, _Spooler(results, spool_dir))
            results.put(_WorkerEnd(k, None, budget.peak))
        except BaseException as exc:  # the parent raises it
            results.put(_WorkerEnd(k, f"{type(exc).__name__}: {exc}", budget.peak))


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _worker_task(task: dict[str, Any], budget: StateBudget, spooler: _Spooler) -> None:
    from eyas.data.prepared import PreparedDataset

    path, split_name = task.pop("source")
    split = PreparedDataset(path, check=False).split(split_name)  # the parent checked its fingerprint
    _send_all(task.pop("plans"), split, task.pop("todo"), None, spooler, spooler, budget=budget, **task)


class _Workers:
    """The --sglang-procs worker processes (`_capture_worker`), started before the store is opened: each imports
    torch and eyas, seconds that then pass beside the set-up. `run` gives each an equal share of the samples, of
    each server's slots and of the memory budget, and stores what they hand over; `close` ends them and removes
    the spool (a directory of this run's own on /dev/shm, else the temp dir)."""

    def __init__(self, n: int, slots: int, budget: StateBudget, row_bytes: int, lengths):
        """`n` workers for `slots` requests in flight in all; half of `budget` bounds the samples waiting in the
        spool (of the mean of `lengths` tokens, `row_bytes` each: a store slower than the servers then holds
        the workers back), the other half the states the workers hold."""
        import multiprocessing
        import tempfile

        ctx = multiprocessing.get_context("spawn")  # a forked copy of a threaded process can deadlock
        sample_bytes = row_bytes * (float(lengths.mean()) if len(lengths) else 1.0)
        self.spooled = int(min(max(budget.limit // 2 // max(sample_bytes, 1), 1), 2 * slots))
        self.results = ctx.Queue(maxsize=self.spooled)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_dead_spools(shm)
        self.spool_dir = tempfile.mkdtemp(prefix=f"eyas-spool-{os.getpid()}-", dir=shm)
        self.tasks = [ctx.SimpleQueue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_capture_worker,
                args=(k, self.tasks[k], self.results, self.spool_dir),
                daemon=True,
                name=f"eyas-capture-{k}",
            )
            for k in range(n)
        ]
        for w in self.procs:
            w.start()

    def run(self, plans, split, todo, writer, tally, bar, *, concurrency: int, budget, **task) -> None:
        n = len(self.procs)
        for k, q in enumerate(self.tasks):
            q.put(
                {
                    **task,
                    "plans": plans,
                    "source": (str(split.root), split.name),
                    "todo": todo[k::n],
                    "concurrency": concurrency // n + (k < concurrency % n),
                    "memory_bytes": max(budget.limit // 2 // n, 1),
                }
            )
        running = set(range(n))
        while running:
            try:
                item = self.results.get(timeout=5.0)
            except queue.Empty:
                if dead := [k for k in running if not self.procs[k].is_alive() and self.results.empty()]:
                    raise RuntimeError(
                        f"capture worker {dead[0]} ended without a word (exit {self.procs[dead[0]].exitcode})"
                    ) from None
                continue
            if isinstance(item, _WorkerEnd):
                if item.error is not None:
                    raise RuntimeError(f"capture worker {item.worker}: {item.error}")
                running.discard(item.worker)
                budget.peak += item.peak_bytes  # the workers' peaks summed: at least what was held at once
                continue
            if item.encoded is not None:
                spooled = item.encoded
                item = replace(item, encoded=spooled.load())
                os.unlink(spooled.path)
            tally.ingest(item, writer)
            bar.update(item.tokens)

    @classmethod
    def start(cls, procs: int, concurrency: int, servers: int, budget, row_bytes: int, lengths) -> _Workers | None:
        """`procs` workers (at most `concurrency`, each server's slots), or None for none."""
        return cls(min(procs, concurrency), concurrency * servers, budget, row_bytes, lengths) if procs else None

    def close(self) -> None:
        for w, q in zip(self.procs, self.tasks):
            if w.is_alive():
                q.put(None)
        for w in self.procs:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()  # mid-task after an error: its requests end with it, its dumps are removed as stale
                w.join(timeout=30)
        shutil.rmtree(self.spool_dir, ignore_errors=True)


def remove_dead_spools(where: str) -> None:
    """Remove the spool directories of captures whose process is gone (killed before it could clean up)."""
    for d in Path(where).glob("eyas-spool-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def _closed_on_error(workers: _Workers | None):
    """Ends `workers` when the block raises (the capture's own clean-up comes after it)."""
    try:
        yield
    except BaseException:
        if workers is not None:
            workers.close()
        raise


def _check_capture_options(
    urls: Sequence[str],
    *,
    concurrency: int,
    max_retries: int,
    dump_wait_s: float,
    request_timeout_s: float,
    memory_bytes: int | None = None,
    procs: int = 0,
) -> None:
    """Refuse capture_from_sglang's options that cannot work, before anything is read or sent."""
    if not urls:
        raise EyasError("--url: give at least one SGLang server URL")
    if concurrency < 1:
        raise EyasError(f"--sglang-concurrency: {concurrency}, expected >= 1")
    if max_retries < 0:
        raise EyasError(f"--sglang-max-retries: {max_retries}, expected >= 0")
    if dump_wait_s <= 0 or request_timeout_s <= 0:
        raise EyasError(
            f"--sglang-dump-wait {dump_wait_s} / --sglang-request-timeout {request_timeout_s}: expected > 0"
        )
    if memory_bytes is not None and memory_bytes <= 0:
        raise EyasError(f"--sglang-memory-gb: {memory_bytes / 2**30:g} GiB, expected > 0")
    if procs < 0:
        raise EyasError(f"--sglang-procs: {procs}, expected >= 0")


def _preflight_servers(
    urls: Sequence[str], layer_ids: Sequence[int] | None, *, cache_bypass: str, dump_dir: str | Path | None
) -> tuple[list[ServerPlan], list[int]]:
    """Every server preflighted, and the layer ids they all capture (the first server's when none are asked for)."""
    plans = [preflight(u, layer_ids, cache_bypass=cache_bypass, dump_dir=dump_dir) for u in urls]
    layer_ids = [int(i) for i in plans[0].status["layer_ids"]] if layer_ids is None else list(layer_ids)
    for p in plans[1:]:
        if p.status["layer_ids"] != layer_ids or p.hidden_size != plans[0].hidden_size:
            raise EyasError(
                f"--url {p.url} captures layers {p.status['layer_ids']} of a model with hidden size "
                f"{p.hidden_size}; {plans[0].url} captures {layer_ids} with {plans[0].hidden_size}: "
                "all servers must serve the same model with the same EYAS_CAPTURE_LAYERS"
            )
    return plans, layer_ids


def _reach_servers(
    urls: Sequence[str],
    layer_ids: Sequence[int] | None,
    first: torch.Tensor,
    *,
    job: str,
    laps: _Laps,
    cache_bypass: str,
    dump_dir: str | Path | None,
    probe_kw: dict[str, Any],
) -> tuple[list[ServerPlan], list[int], list[Outcome]]:
    """(plans, layer ids, one probe per server): every server preflighted, the dumps an interrupted run of this
    job left behind removed, then one probe each (`_probe_servers`; `probe_kw`: its retry and wait options)."""
    plans, layer_ids = _preflight_servers(urls, layer_ids, cache_bypass=cache_bypass, dump_dir=dump_dir)
    laps.lap("preflight")
    for ddir in _dump_dirs(plans):
        if n := remove_stale_dumps(ddir, job):
            log(f"eyas: removed {n} dumps left in {ddir} by an interrupted run")
    probes = _probe_servers(plans, first, layer_ids=layer_ids, job=job, **probe_kw)
    laps.lap("probe")
    return plans, layer_ids, probes


def _remove_job_dumps(plans: Sequence[ServerPlan], job: str) -> None:
    for ddir in _dump_dirs(plans):
        remove_stale_dumps(ddir, job)


def _dump_dirs(plans: Sequence[ServerPlan]) -> list[Path]:
    """The servers' dump directories, each once (servers on one host may share one)."""
    return [p.dump_dir for p in {str(p.dump_dir): p for p in plans}.values()]


def _probe_servers(
    plans: Sequence[ServerPlan],
    first: torch.Tensor,
    *,
    layer_ids: Sequence[int],
    job: str,
    dump_wait_s: float,
    max_retries: int,
    backoff_s: float,
) -> list[Outcome]:
    """One probe per server: proves the dump path end to end and gives the hidden size and dtype.

    Random ids within the range `first` (the first sample's ids) uses, valid for the vocabulary, so
    that the probe does not leave a prefix of a real sample in a server's radix cache."""
    probe_ids = torch.randint(
        int(first.min()),
        int(first.max()) + 1,
        (16,),
        generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")),
    )
    return [
        probe(
            p,
            probe_ids,
            layer_ids=layer_ids,
            tag=f"{job}-probe{i}",
            dump_wait_s=dump_wait_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        for i, p in enumerate(plans)
    ]


def _open_capture_store(
    out_store: Path,
    prepared,
    plans: Sequence[ServerPlan],
    probes: Sequence[Outcome],
    *,
    split: str,
    layer_ids: Sequence[int],
    dtype: str,
    target: str | Path | None,
    limit: int | None,
    laps: _Laps,
):
    """(the store's writer, the target it records): the served model's directory stands in for a missing target."""
    hidden = int(probes[0].hidden_LSD.shape[2])
    server_dtype = _model_dtype(probes[0].dump_dtype)
    if target is None:
        served = plans[0].info.get("model_path")
        if served and (Path(served) / "config.json").is_file():
            target = served  # the server loads its model from a directory this host can read
    writer = open_store(
        out_store,
        prepared=prepared,
        split=split,
        layer_ids=layer_ids,
        hidden_size=hidden,
        dtype=dtype,
        target=target,
        model_dtype=server_dtype,
        limit=limit,
        producer={
            "backend": "sglang",
            "urls": [p.url for p in plans],
            "sglang_version": plans[0].version,
            "cache_bypass": [p.bypass for p in plans],
            "plugin": plans[0].status.get("plugin_version"),
            "server_dtype": probes[0].dump_dtype,
            "num_layers": plans[0].status.get("model", {}).get("num_layers"),
            "model_class": plans[0].status.get("model", {}).get("class"),
        },
        laps=laps,
    )
    return writer, target


class _Laps:
    """Seconds between successive `lap` calls, by name (where the capture's set-up goes)."""

    def __init__(self, t0: float):
        self.last, self.seconds = t0, {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.seconds[name], self.last = now - self.last, now


@dataclass(kw_only=True)
class _Tally:
    """What the send/ingest loop counts, for the summary."""

    retries: int
    rejected: list[dict[str, Any]] = field(default_factory=list)
    captured: int = 0
    tokens: int = 0
    spent: dict[str, float] = field(
        default_factory=lambda: {
            "gate": 0.0,
            "request": 0.0,
            "dump": 0.0,
            "check": 0.0,
            "encode": 0.0,
            "ingest": 0.0,
        }
    )
    """Seconds summed over samples, per part of a sample's way (`gate`: waiting for a slot at a server)."""

    def ingest(self, res: Outcome, writer) -> None:
        """Count one sample's outcome; store it when it passed every check."""
        self.retries += res.retries
        for part, secs in res.seconds.items():
            self.spent[part] += secs
        if res.reason is not None:
            self.rejected.append({"id": res.sample_id, "tokens": res.tokens, "reason": res.reason})
            log(f"eyas: rejected {res.sample_id}: {res.reason}")
        else:
            t_add = time.perf_counter()
            writer.add_encoded(res.encoded)
            self.spent["ingest"] += time.perf_counter() - t_add
            self.captured += 1
            self.tokens += res.tokens


@dataclass(kw_only=True)
class _Sender:
    """Hands the samples still to capture to the servers, each to the least loaded one."""

    pool: cf.ThreadPoolExecutor
    plans: Sequence[ServerPlan]
    gates: Sequence[threading.BoundedSemaphore]
    split: Any
    todo: Any
    """Iterator over the indices of the samples still to send."""
    rid_tag: str
    layer_ids: Sequence[int]
    max_retries: int
    backoff_s: float
    request_timeout_s: float
    dump_wait_s: float
    budget: StateBudget
    """Bytes of states held at once, taken when a sample is sent and given back once it is stored."""
    row_bytes: int
    """A token's states in bytes (the budget's unit)."""
    encode: Any = None
    """The store writer's SampleEncoder, run on the request threads."""
    futures: dict[cf.Future, tuple[int, int]] = field(default_factory=dict)
    """Future -> (index of its server, the bytes it took from the budget)."""
    load: list[int] = field(init=False)
    """Samples taken per server: the least loaded gets the next one."""
    done: bool = False
    """Every sample has been sent."""
    held_back_bytes: int = 0
    """The states of the sample waiting for room in the budget."""
    _held_back: int | None = None

    def __post_init__(self):
        self.load = [0] * len(self.plans)

    def submit_next(self) -> bool:
        """Send the next sample; False when none is left or its states do not fit the budget yet."""
        i, self._held_back = (self._held_back, None) if self._held_back is not None else (next(self.todo, None), None)
        if i is None:
            self.done = True
            return False
        s = self.split[i]
        nbytes = int(s.input_ids.shape[0]) * self.row_bytes
        if not self.budget.take(nbytes):
            self._held_back, self.held_back_bytes = i, nbytes
            return False
        k = min(range(len(self.plans)), key=self.load.__getitem__)
        self.futures[
            self.pool.submit(
                capture_one,
                self.plans[k],
                s.id,
                s.input_ids,
                f"{self.rid_tag}-{i}",
                layer_ids=self.layer_ids,
                max_retries=self.max_retries,
                backoff_s=self.backoff_s,
                request_timeout_s=self.request_timeout_s,
                dump_wait_s=self.dump_wait_s,
                gate=self.gates[k],
                encode=self.encode,
            )
        ] = (k, nbytes)
        self.load[k] += 1
        return True

    def retire(self, f: cf.Future) -> int:
        """Forget a finished future and send the next sample in its place; the bytes it holds."""
        k, nbytes = self.futures.pop(f)
        self.load[k] -= 1
        self.submit_next()
        return nbytes


class StateBudget:
    """The bytes of states the client holds at once, from a sample's request to its write into the store.

    A sample is sent only when its states fit beside those held (or when none are held, so a sample larger
    than the budget still goes, alone): a disk slower than the servers then bounds the client's memory
    instead of filling it. The request threads hold up to a few transient copies of the sample they check."""

    def __init__(self, limit_bytes: int):
        self.limit, self.held, self.peak = int(limit_bytes), 0, 0
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> bool:
        with self._cv:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give(self, nbytes: int) -> None:
        with self._cv:
            self.held -= nbytes
            self._cv.notify_all()

    def wait_for_room(self, nbytes: int, timeout: float) -> None:
        """Until `nbytes` more would fit (or `timeout` seconds)."""
        with self._cv:
            self._cv.wait_for(lambda: not self.held or self.held + nbytes <= self.limit, timeout)


def default_memory_bytes() -> int:
    """An eighth of this machine's memory: what the capture client's states may take by default."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): a fixed 4 GiB
        return 4 << 30


def _send_and_ingest(sender: _Sender, writer, tally: _Tally, bar, *, queued: int) -> None:
    """Keep `queued` samples in flight until none is left, storing each verified one as it comes back.

    This thread only sends: a finished sample's slot is refilled at once and the sample handed to one
    ingesting thread, so a slow store write (a shard's fsync) never leaves the servers without work."""
    futures = sender.futures
    done_q: queue.Queue = queue.Queue(maxsize=queued)  # a disk slower than the servers holds the sender back
    failed: list[BaseException] = []

    def ingest_all() -> None:
        while (item := done_q.get()) is not None:
            res, nbytes = item
            if failed:
                continue  # drain: the sender stops at the first failure
            try:
                tally.ingest(res, writer)
                bar.update(res.tokens)
            except BaseException as exc:  # re-raised by the sending thread
                failed.append(exc)
            finally:
                sender.budget.give(nbytes)  # stored (or rejected): its states are no longer held

    def fill() -> None:
        while len(futures) < queued and sender.submit_next():
            pass

    ingester = threading.Thread(target=ingest_all, name="eyas-capture-ingest", daemon=True)
    ingester.start()
    try:
        fill()
        while not failed:
            if not futures:
                if sender.done:
                    break
                sender.budget.wait_for_room(sender.held_back_bytes, 1.0)  # the disk has the rest: wait for it
                fill()
                continue
            finished, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED, timeout=1.0)
            for f in finished:
                nbytes = sender.retire(f)  # the next sample goes out before this one is stored
                done_q.put((f.result(), nbytes))
            fill()
        if failed:
            raise failed[0]
    except BaseException:
        for f in futures:
            f.cancel()  # requests not started yet; running ones end within their timeouts
        raise
    finally:
        done_q.put(None)
        ingester.join()


def _capture_summary(
    tally: _Tally,
    plans: Sequence[ServerPlan],
    *,
    out_store: str | Path,
    split: str,
    layer_ids: list[int],
    n_total: int,
    n_todo: int,
    store_complete: bool,
    elapsed: float,
    loop_s: float,
    phases: dict[str, float],
    setup_seconds: dict[str, float],
    store_seconds: dict[str, float],
    calibration: dict[str, Any],
    memory: dict[str, int],
    procs: int,
) -> dict[str, Any]:
    """capture_from_sglang's summary (rejected samples listed up to REJECTED_LISTED)."""
    tokens = tally.tokens
    return {
        "backend": "sglang",
        "store": str(out_store),
        "split": split,
        "urls": [p.url for p in plans],
        "layer_ids": layer_ids,
        "convention": CONVENTION,
        "sglang_layer_ids": sglang_layer_ids(layer_ids),
        "samples": n_total,
        "already_committed": n_total - n_todo,
        "captured": tally.captured,
        "tokens": tokens,
        "rejected_count": len(tally.rejected),
        "rejected": tally.rejected[:REJECTED_LISTED],
        "retries": tally.retries,
        "cache_bypass": [p.bypass for p in plans],
        "store_complete": store_complete,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "loop_s": round(loop_s, 3),
        "loop_tokens_per_s": round(tokens / loop_s, 1) if loop_s > 0 else None,
        "seconds_summed": {k: round(v, 3) for k, v in tally.spent.items()},
        # requests at the servers on average during the loop: below the slots, the servers waited for this client
        "in_flight_mean": round(tally.spent["request"] / loop_s, 2) if loop_s > 0 else None,
        "phase_seconds": {k: round(v, 3) for k, v in phases.items()},
        "setup_seconds": {k: round(v, 3) for k, v in setup_seconds.items()},
        "store_seconds": {k: round(v, 3) for k, v in store_seconds.items()},
        "memory": memory,
        "procs": procs,  # worker processes that sent and checked (--sglang-procs; 0: this one)
        "engine_numerics": calibration,
    }


def _calibrate(
    writer, out_store: Path, split, target, *, calibrate: int, device: str, engine: dict[str, Any]
) -> dict[str, Any]:
    """Record the engine's numerics in the store (see capture_from_sglang); returns what the summary shows."""
    from eyas.store.numerics import calibrate_store, calibration_problem

    manifest = writer.manifest
    old = manifest.get("engine_numerics")
    if not calibrate:
        return {"skipped": "--sglang-calibrate 0: `eyas verify` holds this store to fixed limits for a bf16 engine"}
    if target is None:
        return {"skipped": "no --target: `eyas verify` holds this store to fixed limits for a bf16 engine"}
    if isinstance(old, dict) and old.get("engine") == engine:
        return {"kept": f"recorded earlier on {old.get('n_samples')} samples with the same engine"}
    writer.commit()  # the reference reads what the store holds, as verify will
    if not manifest["samples"]:
        return {"skipped": "no committed samples"}
    log(
        f"eyas capture (sglang): calibrating the engine's numbers on {min(calibrate, len(manifest['samples']))} stored "
        f"samples against the reference on {device} (--sglang-calibrate 0 skips it)"
    )
    rec = calibrate_store(out_store, split, str(target), device=device, samples=calibrate, engine=engine)
    writer.set_field("engine_numerics", rec)
    problem = calibration_problem(manifest, rec)
    high = rec["per_layer"][str(max(manifest["aux_layer_ids"]))]
    log(
        f"eyas capture (sglang): engine numerics on {rec['n_samples']} samples ({rec['tokens']} tokens), highest aux "
        f"layer: rms max {high['rms']['max']:.3g}, p99.9 max {high['p999']['max']:.3g}, worst token {high['max']['max']:.3g}"
        + (f"; REFUSED: {problem}" if problem else "")
    )
    return {
        "n_samples": rec["n_samples"],
        "tokens": rec["tokens"],
        "per_layer": rec["per_layer"],
        **({"problem": problem} if problem else {}),
    }
