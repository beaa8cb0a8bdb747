"""`eyas verify-server`: prove that an SGLang server with the eyas plugin captures whole prompts.

Checks, in order (each a real request through the same path as `eyas capture --backend sglang`):
1. unique_prompt: a never-seen prompt of known length L (crossing a chunk boundary when chunked
   prefill is on) comes back with cached_tokens == 0 and a dump of exactly L tokens, positions
   0..L-1, the same token ids, the configured layers;
2. shared_prefix: two prompts sharing a long prefix, sent one after the other (the second would hit
   the radix cache without a bypass), both dump every token;
3. batched: four prompts of different lengths sent at once (so the server packs them into shared
   EXTEND forwards, through the prefill CUDA graph when it is on) all dump every token;
4. plugin_counters: after those requests the plugin reports no hook or write errors and no forward
   whose request ids it could not find: a prefill CUDA-graph replay batch it could not match to the
   scheduler's batch (`unmatched_forwards`), or one with no scheduler batch on its thread to take
   them from (`rid_less_forwards`, dropped without a dump); the fix for both is
   --disable-prefill-cuda-graph. It also reports how many forwards took their request ids from the
   scheduler's batch (`rids_from_live_batch` > 0: the graph path ran);
5. numbers (with --target, when the model fits here): the unique prompt's dumped aux and final
   states match `eyas.target.reference_hidden_states` of the local copy of the model.
"""

from __future__ import annotations

from pathlib import Path

import typer


def verify_server(
    url: str = typer.Option(..., "--url", help="SGLang server URL, e.g. http://127.0.0.1:30000."),
    layers: str | None = typer.Option(
        None,
        "--aux-layers",
        help="Aux layer ids the server must capture, comma-separated, eyas convention (hf-input: id i = input to decoder layer i); default: accept what the plugin reports.",
    ),
    dump_dir: Path | None = typer.Option(
        None,
        "--sglang-dump-dir",
        help="Directory where the plugin's dumps appear on this machine; default: the one the plugin reports (EYAS_DUMP_DIR on the server).",
    ),
    cache_bypass: str = typer.Option(
        "auto",
        "--sglang-cache-bypass",
        help="Per-request radix-cache bypass: auto, plugin (the eyas plugin caps the match, plugin version 3), salt "
        "(unique cache_salt, SGLang >= 0.5.22), logprob (return_logprob from 0), none (needs --disable-radix-cache).",
    ),
    target: str | None = typer.Option(
        None,
        "--target",
        help="Local copy of the served model (Hugging Face directory): compare one sample's numbers with the transformers reference.",
    ),
    prompt_tokens: int | None = typer.Option(
        None,
        "--prompt-tokens",
        help="Length L of the test prompts; default crosses a chunk boundary (1.5 x chunked_prefill_size + 3, within the context length) or 300.",
    ),
    tolerance: float | None = typer.Option(
        None,
        "--tolerance",
        help="Largest mean relative L2 error per slot in the numbers check; default 0.05 for bf16/fp16 servers, 1e-3 for fp32.",
    ),
    device: str = typer.Option("auto", "--device", help="Device for the local reference forward: auto, cpu, cuda."),
    seed: int = typer.Option(0, "--seed", help="Seed of the test prompts (a random nonce keeps them unique per run)."),
    dump_wait_s: float = typer.Option(60.0, "--dump-wait", help="Seconds to wait for a dump after the server answers."),
) -> dict:
    """Check that a plugin-equipped SGLang server dumps every prompt token, and (with --target) the right numbers."""
    import os

    import torch

    from eyas.config_checks import check_device, check_in, check_url, check_value, parse_int_list
    from eyas.errors import CheckFailed, EyasError
    from eyas.sglang.request import capture_one
    from eyas.sglang.server import preflight

    # every option is checked before the first request
    url = check_url(url, option="--url")
    layer_ids = parse_int_list(layers, option="--aux-layers", min_value=0)
    check_in(cache_bypass, "--sglang-cache-bypass", ("auto", "plugin", "salt", "logprob", "none"))
    check_value(prompt_tokens, "--prompt-tokens", ge=8, optional=True)
    check_value(tolerance, "--tolerance", gt=0, optional=True)
    check_value(dump_wait_s, "--dump-wait", ge=0)
    check_device(device)
    plan = preflight(url, layer_ids, cache_bypass=cache_bypass, dump_dir=dump_dir)
    layer_ids = [int(i) for i in plan.status["layer_ids"]]
    model_info = plan.status.get("model", {})
    vocab = int(model_info.get("vocab_size") or 0) or 32000
    chunk = int(plan.info.get("chunked_prefill_size") or -1)
    # --context-length as the server was started with, else the model's own limit (SGLang's default context
    # length; /server_info reports None for it when the flag was not given)
    context = (
        int(plan.info.get("context_length") or 0) or int(model_info.get("max_position_embeddings") or 0) or (1 << 30)
    )
    L = prompt_tokens or min(chunk + chunk // 2 + 3 if chunk > 0 else 300, context - 8)
    if L < 8:
        raise EyasError(f"--prompt-tokens: {L}, expected >= 8")
    nonce = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed * 1_000_003 + nonce)
    low = min(1000, vocab // 4)

    def rand_ids(n: int) -> torch.Tensor:
        return torch.randint(low, vocab, (n,), generator=g, dtype=torch.int64)

    tag = f"verify{nonce:08x}"
    checks: dict[str, dict] = {}

    def run(name: str, ids: torch.Tensor, k: int):
        return capture_one(
            plan,
            name,
            ids,
            f"{tag}-{k}",
            layer_ids=layer_ids,
            max_retries=3,
            backoff_s=0.5,
            request_timeout_s=600.0,
            dump_wait_s=dump_wait_s,
        )

    # 1. a unique prompt of known length
    unique = rand_ids(L)
    r1 = run("unique_prompt", unique, 0)
    checks["unique_prompt"] = {"ok": r1.reason is None, "tokens": L, "reason": r1.reason, "pieces": r1.pieces}

    # 2. two prompts sharing a long prefix, one after the other
    shared = rand_ids(L - max(4, L // 8))
    a = torch.cat([shared, rand_ids(L - shared.shape[0])])
    b = torch.cat([shared, rand_ids(L - shared.shape[0])])
    ra, rb = run("shared_prefix_a", a, 1), run("shared_prefix_b", b, 2)
    checks["shared_prefix"] = {
        "ok": ra.reason is None and rb.reason is None,
        "tokens": L,
        "shared_tokens": int(shared.shape[0]),
        "reason_a": ra.reason,
        "reason_b": rb.reason,
    }

    # 3. several prompts at once, packed into shared forwards
    import concurrent.futures as cf

    lens = [max(8, L // d) for d in (1, 2, 3, 5)]
    with cf.ThreadPoolExecutor(len(lens)) as pool:
        futs = [pool.submit(run, f"batched_{k}", rand_ids(n), 10 + k) for k, n in enumerate(lens)]
        rs = [f.result() for f in futs]
    checks["batched"] = {
        "ok": all(r.reason is None for r in rs),
        "tokens": lens,
        "reasons": [r.reason for r in rs if r.reason is not None],
    }

    # 4. what the plugin counted while serving them
    checks["plugin_counters"] = _plugin_counters(plan, (r1, ra, rb, *rs))

    # 5. the numbers, against the transformers reference on a local copy of the model
    if target is not None:
        checks["numbers"] = _compare_numbers(
            target, unique, r1, layer_ids, tolerance=tolerance, device=device, server_dtype=r1.dump_dtype
        )
    ok = all(c["ok"] for c in checks.values())
    summary = {
        "ok": ok,
        "url": plan.url,
        "sglang_version": plan.version,
        "cache_bypass": plan.bypass,
        "layer_ids": layer_ids,
        "convention": "hf-input",
        "dump_dir": str(plan.dump_dir),
        "model": model_info,
        "checks": checks,
    }
    if not ok:
        failed = [k for k, c in checks.items() if not c["ok"]]
        fix = checks["plugin_counters"]["fix"]  # the counters say why dumps are missing better than the dump checks
        raise CheckFailed(f"server {plan.url} failed: {', '.join(failed)}" + (f"; fix: {fix}" if fix else ""), summary)
    return summary


def _plugin_counters(plan, results) -> dict:
    """Check 4: the plugin's counters after the requests of `results` (the earlier checks' captures), and the fix
    when they or a missing dump point to one."""
    from eyas.sglang.core import REPLAY_FLAG
    from eyas.sglang.request import NO_DUMP
    from eyas.sglang.server import get_server_info, missing_dump_cause, plugin_state

    after = plugin_state(get_server_info(plan.url)) or {}
    stats = after.get("stats", {})
    ids_lost = ("unmatched_forwards", "rid_less_forwards")
    counters = {k: int(stats.get(k, 0)) for k in ("live_batches", "rids_from_live_batch", *ids_lost)}
    counters.update(hook_errors=int(after.get("hook_errors", 0)), write_errors=int(after.get("write_errors", 0)))
    bad = {k: v for k, v in counters.items() if k in (*ids_lost, "hook_errors", "write_errors") and v}
    # missing dumps: the counters may say why (also for an older plugin without rid_less_forwards)
    missing = any((r.reason or "").startswith(NO_DUMP) for r in results)
    cause = missing_dump_cause(plan, stats) if missing else None
    if cause is None and any(k in bad for k in ids_lost):
        cause = (
            "plugin could not find the request ids of prefill CUDA-graph replay batches; restart the server "
            f"with {REPLAY_FLAG}"
        )
    fix = f"the {cause}" if cause else "see the server log for `eyas capture`" if bad else ""
    return {"ok": not bad and cause is None, **counters, "last_error": after.get("last_error", ""), "fix": fix}


def _compare_numbers(target, ids, res, layer_ids, *, tolerance, device, server_dtype) -> dict:
    import torch

    from eyas.target import load_target, reference_hidden_states

    if res.reason is not None:
        return {"ok": False, "reason": f"no sample to compare: {res.reason}"}
    from eyas.dtypes import is_low_precision, resolve_device

    dev = resolve_device(device)
    model = load_target(target, device=dev, dtype=torch.float32)
    ref_aux, ref_final = reference_hidden_states(model, ids.to(dev), layer_ids=layer_ids)
    ref = torch.cat([ref_aux, ref_final[:, None]], dim=1).float().cpu()  # [L, A+1, H]
    got = res.hidden_LSD.float()
    if got.shape != ref.shape:
        return {"ok": False, "reason": f"dump shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"}
    low_precision = is_low_precision(server_dtype)
    tol = tolerance if tolerance is not None else (0.05 if low_precision else 1e-3)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [L, A+1]
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    per_slot = rel.mean(dim=0).tolist()
    names = [f"aux{i}" for i in layer_ids] + ["final"]
    return {
        "ok": bool(max(per_slot) <= tol),
        "tolerance": tol,
        "server_dtype": server_dtype,
        "mean_rel_l2": dict(zip(names, [round(x, 6) for x in per_slot])),
        "min_cosine": dict(zip(names, [round(x, 6) for x in cos.min(dim=0).values.tolist()])),
    }
