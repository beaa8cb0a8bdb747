"""One sample's way through a server: the request, its dump, every check, the stored rows.

A sample goes as `input_ids` with max_new_tokens 1 and a rid `eyas.<L>.<tag>` that tells the plugin the prompt
length. Its answer and dump must show: cached_tokens == 0, prompt_tokens == L, dump status complete, dumped token
count == L, positions 0..L-1 all present, dumped token ids == the sample's ids, the layer ids asked for, finite
values. The dump is deleted once read, so /dev/shm holds only the samples in flight. `probe` sends one such request
before a capture, to prove the whole path.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.sglang.core import CONVENTION, META_FILE, Dump, all_finite, make_rid, read_dump
from eyas.sglang.server import (
    PermanentHTTPError,
    ServerPlan,
    TransientHTTPError,
    generate,
    get_server_info,
    missing_dump_cause,
    plugin_state,
)


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
