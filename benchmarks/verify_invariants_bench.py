"""Cost and reach of `eyas verify`'s every-sample invariants (eyas/store/invariants.py).

One run: prepares ShareGPT chats with the target's template and captures them (or reuses --store),
then
  1. runs the invariants over the correct store: seconds per check, microseconds per token, the
     store's calibrated rates, the worst prefix / tail errors (must pass: a false alarm is a bug);
  2. injects each single-sample fault of issue 14 into one copy of the store (checksums rewritten to
     match) and reports which invariants caught it: rows of one layer rolled by one token, two
     samples swapped, 5% noise, the final slot holding the pre-norm state, a sample computed in a
     left-padded batch without an attention mask;
  3. (--numbers-too) times the full unbatched reference recompute per token for comparison.

CPU, the embedded SmolLM2-135M (fp32), 60 chats of <= 256 tokens, about 3 minutes on 2 cores:

    PYTHONPATH=src python benchmarks/verify_invariants_bench.py --work /tmp/vib

GPU (bf16 target, bf16 store), a converted model directory:

    PYTHONPATH=src python benchmarks/verify_invariants_bench.py --target /path/to/smollm2 --device cuda \
        --model-dtype bf16 --samples 400 --max-length 1024 --work /tmp/vib --numbers-too --compare-tail-paths

--compare-tail-paths reruns the invariants in the same process with the other tail path (on a GPU
one Hugging Face tail forward per sample, the path before batching); --profile prints
torch.profiler tables of both tails on 8 samples.

Progress on stderr; a table, then as the LAST stdout line one JSON document.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_store(args, work: Path) -> Path:
    from eyas.capture.run import CaptureSettings, run_capture
    from eyas.data.prepare import PrepareConfig, prepare

    prep, store = work / "prep", work / "store"
    if not (prep / "meta.json").is_file():
        log(f"preparing {args.samples} chats -> {prep}")
        try:
            prepare(
                PrepareConfig(
                    target=args.target,
                    out=prep,
                    limit=int(args.samples * 1.6),
                    max_length=args.max_length,
                    eval_fraction=0.0,
                    overwrite=True,
                    **({"source": args.source} if args.source else {}),
                )
            )
        except Exception as exc:  # no ShareGPT wheel on this machine: chat-shaped random data instead
            log(f"ShareGPT unavailable ({type(exc).__name__}: {exc}); using the chat template's prefix + random tokens")
            synthetic_prepared(args, prep)
    log(f"capturing -> {store}")
    run_capture(
        CaptureSettings(
            target=args.target,
            data=prep,
            out=store,
            device=args.device,
            model_dtype=args.model_dtype,
            store_dtype=args.dtype,
            token_budget=8192,
            shard_bytes=4 << 20,
            limit=args.samples,
        )
    )
    return store


def synthetic_prepared(args, prep: Path) -> None:
    """`args.samples` samples: the target's chat-template prefix, then random tokens (up to --max-length)."""
    from eyas.data.prepared import write_prepared
    from eyas.target import load_tokenizer, tokenizer_hash

    tok = load_tokenizer(args.target)
    prefix = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, return_dict=True)["input_ids"]
    prefix = prefix[: max(1, len(prefix) - 3)]
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.samples):
        n = int(
            torch.randint(
                args.max_length // 4, max(args.max_length - len(prefix), args.max_length // 4 + 1), (1,), generator=g
            )
        )
        ids = prefix + torch.randint(3, len(tok), (n,), generator=g).tolist()
        rows.append((f"r{i:05d}", ids, [k >= len(prefix) for k in range(len(ids))]))
    write_prepared(prep, {"train": rows}, {"tokenizer_hash": tokenizer_hash(tok)}, overwrite=True)


def rewrite(src: Path, dst: Path, mutate) -> Path:
    """Copy a store sample by sample through mutate(sid, hidden_TLD, reader) -> hidden_TLD (checksums recomputed)."""
    from eyas.store import StoreReader, StoreSpec, StoreWriter

    r = StoreReader(src)
    m = r.manifest
    if dst.exists():
        shutil.rmtree(dst)
    spec = StoreSpec(
        **{
            k: m[k]
            for k in (
                "aux_layer_ids",
                "hidden_size",
                "dtype",
                "convention",
                "target",
                "tokenizer_hash",
                "prepared",
                "model_dtype",
                "producer",
            )
        }
    )
    with StoreWriter(dst, spec, shard_bytes=4 << 20) as w:
        for sid in r.sample_ids:
            h = mutate(sid, r.get_hidden(sid, torch.float32), r)
            w.add(sid, h[:, :-1], h[:, -1])
        w.close(complete=True)
    return dst


def faults(model, split, reader, victim: str, other: str):
    """name -> mutate function, each touching `victim` only (and `other` for the swap)."""
    from eyas.target import _decoder_parts, reference_hidden_states

    layers = reader.aux_layer_ids
    device = next(model.parameters()).device
    ids = split[split.index_of(victim)].input_ids

    def only(fn):
        return lambda sid, h, r: fn(h, r) if sid == victim else h

    def swap(sid, h, r):
        if sid not in (victim, other):
            return h
        src = r.get_hidden(other if sid == victim else victim, torch.float32)
        t = h.shape[0]
        return src[:t] if src.shape[0] >= t else torch.cat([src, src[-1:].expand(t - src.shape[0], -1, -1)])

    def roll(h, r):
        h[:, 1] = torch.roll(h[:, 1], -1, dims=0)  # the middle aux layer, one token early
        return h

    def noise(h, r):
        g = torch.Generator().manual_seed(1)
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        return h + 0.05 * rms * torch.randn(h.shape, generator=g)

    def prenorm(h, r):
        _base, _layers, norm = _decoder_parts(model)
        seen = {}
        handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
        try:
            with torch.no_grad():
                model(input_ids=ids[None].to(device), use_cache=False)
        finally:
            handle.remove()
        h[:, -1] = seen["x"][0].float().cpu()
        return h

    def left_pad(h, r):
        pad = torch.full((5,), int(split[split.index_of(other)].input_ids[-1]))
        aux, final = reference_hidden_states(model, torch.cat([pad, ids]).to(device), layer_ids=layers)
        return torch.cat([aux, final.unsqueeze(1)], dim=1)[5:].float().cpu()

    return {
        "swap": swap,
        "roll_mid_layer": only(roll),
        "noise_5pct": only(noise),
        "final_prenorm": only(prenorm),
        "left_pad_no_mask": only(left_pad),
    }


def profile_tail(parts, reader, split, sids, device: str) -> None:
    """torch.profiler tables (stderr) of the tail on the same 8 samples: one Hugging Face forward
    per sample, then one packed forward; shows where a per-sample tail spends its time."""
    try:
        from torch.profiler import ProfilerActivity, profile

        from eyas.store.invariants import packed_tail_kernel, tail_final, tail_final_packed
    except Exception as exc:  # noqa: BLE001  (a diagnostic only)
        log(f"profile skipped ({type(exc).__name__}: {exc})")
        return
    dev = torch.device(device)
    layer_ids = reader.aux_layer_ids
    high, slot = max(layer_ids), layer_ids.index(max(layer_ids))
    some = sids[:8]
    ids = [split[split.index_of(s)].input_ids for s in some]
    highs = [reader.get_hidden(s, torch.float32)[:, slot].to(dev) for s in some]
    kernel, why = packed_tail_kernel(parts)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    runs = {"per_sample": lambda: [tail_final(parts, i.to(dev), x, first_layer=high) for i, x in zip(ids, highs)]}
    if kernel is not None:
        runs["packed"] = lambda: tail_final_packed(
            parts, torch.cat(highs), [i.shape[0] for i in ids], first_layer=high, kernel=kernel
        )
    else:
        log(f"profile: no packed tail ({why})")
    for name, fn in runs.items():
        fn()  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        log(f"--- tail profile: {name}, {len(some)} samples, {sum(i.shape[0] for i in ids)} tokens")
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument(
        "--source", default=None, help="chats to prepare (a .json/.jsonl file); default: the embedded ShareGPT"
    )
    ap.add_argument("--store", type=Path, default=None, help="reuse a store (its prepared data must exist)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/verify_invariants_bench"))
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "fp32"])
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--numbers-too", action="store_true", help="also time the full reference recompute")
    ap.add_argument(
        "--compare-tail-paths",
        action="store_true",
        help="also run the invariants with the other tail path (GPU: per-sample Hugging Face, the pre-batching "
        "path; CPU: packed)",
    )
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of the per-sample and packed tail")
    args = ap.parse_args()

    from eyas.data.prepared import PreparedDataset
    from eyas.store import StoreReader
    from eyas.store.invariants import run_invariants, tail_tolerance, target_parts
    from eyas.store.verify import default_tolerance
    from eyas.target import load_target

    args.work.mkdir(parents=True, exist_ok=True)
    store = args.store or build_store(args, args.work)
    reader = StoreReader(store)
    m = reader.manifest
    split = PreparedDataset(m["prepared"]["path"]).split(m["prepared"]["split"])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[m.get("model_dtype") or "fp32"]
    model = load_target(m["target"]["path"], device=args.device, dtype=dtype)
    parts = target_parts(model, reader.aux_layer_ids)
    tol = dict(
        prefix_tol=default_tolerance(reader.dtype, m.get("model_dtype")),
        tail_tol=tail_tolerance(reader.dtype, m.get("model_dtype")),
    )
    sids = reader.sample_ids
    result: dict = {
        "store": str(store),
        "samples": len(sids),
        "dtype": reader.dtype,
        "model_dtype": m.get("model_dtype"),
        "device": args.device,
        "aux_layers": reader.aux_layer_ids,
        "tolerances": tol,
    }

    log("invariants on the correct store")
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    good = run_invariants(reader, split, parts, sample_ids=sids, **tol)
    wall = time.perf_counter() - t0
    tokens = good["tokens"]
    result["correct_store"] = {
        "ok": good["ok"],
        "failing": good["failures"],
        "tokens": tokens,
        "seconds": round(wall, 3),
        "us_per_token": round(1e6 * wall / tokens, 2),
        "us_per_token_by_check": {k: round(1e6 * v / tokens, 2) for k, v in good["seconds"].items()},
        "prefix": good["prefix"],
        "tail": good["tail"],
        "final_norm": good["final_norm"],
        "rates": good["rates"],
    }
    result["correct_store"]["tail_path"] = good["tail_path"]
    if args.compare_tail_paths and not parts.tail_ok:
        # The other tail path in the same run: on a GPU one Hugging Face tail forward per sample (the
        # pre-batching tail), on a CPU the packed row (which the CPU does not use by default).
        packed_now = good["tail_path"].startswith("packed")
        log(f"invariants again with the {'per-sample' if packed_now else 'packed'} tail")
        t0 = time.perf_counter()
        try:
            ref = run_invariants(reader, split, parts, sample_ids=sids, packed_tail=not packed_now, **tol)
        except ValueError as exc:  # no packed tail for this model or device
            log(f"other tail path skipped: {exc}")
        else:
            wall_ref = time.perf_counter() - t0
            result["other_tail_path"] = {
                "tail_path": ref["tail_path"],
                "us_per_token": round(1e6 * wall_ref / tokens, 2),
                "us_per_token_by_check": {k: round(1e6 * v / tokens, 2) for k, v in ref["seconds"].items()},
                "tail_worst_rel_err": ref["tail"].get("worst_rel_err"),
                "same_failing_samples": ref["failing_samples"] == good["failing_samples"],
            }
    if args.profile:
        profile_tail(parts, reader, split, sids, args.device)
    if args.numbers_too:
        from eyas.target import reference_hidden_states

        # Evenly spaced samples, so their lengths (and the per-token launch overhead) are the store's.
        subset = sids[:: max(1, len(sids) // 16)][:16]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_tok = 0
        for sid in subset:
            ids = split[split.index_of(sid)].input_ids
            reference_hidden_states(model, ids.to(args.device), layer_ids=reader.aux_layer_ids)
            n_tok += ids.shape[0]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        result["reference_recompute_us_per_token"] = round(1e6 * (time.perf_counter() - t0) / n_tok, 2)
        result["reference_recompute_tokens"] = n_tok

    if not args.no_faults:
        by_shard: dict[int, list[str]] = {}
        for rec in m["samples"]:
            by_shard.setdefault(rec["shard"], []).append(rec["id"])
        shards = sorted(by_shard)
        victim = by_shard[shards[len(shards) // 2]][len(by_shard[shards[len(shards) // 2]]) // 2]
        lengths = {rec["id"]: rec["tokens"] for rec in m["samples"]}
        others = [s for s in sids if reader.record(s)["shard"] != reader.record(victim)["shard"]]
        other = min(others, key=lambda s: abs(lengths[s] - lengths[victim]))
        result["faults"] = {}
        for name, mutate in faults(model, split, reader, victim, other).items():
            log(f"fault {name} in {victim}")
            bad = rewrite(store, args.work / f"fault_{name}", mutate)
            out = run_invariants(StoreReader(bad), split, parts, sample_ids=sids, **tol)
            caught = out["failures"].get(victim, [])
            result["faults"][name] = {
                "victim": victim,
                "caught": bool(caught),
                "by": caught,
                "false_alarms": sorted(set(out["failing_samples"]) - {victim, other}),
            }
            shutil.rmtree(bad)

    print(f"{'check':<12} {'us/token':>9}", file=sys.stdout)
    for k, v in result["correct_store"]["us_per_token_by_check"].items():
        print(f"{k:<12} {v:>9}")
    print(f"{'all':<12} {result['correct_store']['us_per_token']:>9}   (tail: {result['correct_store']['tail_path']})")
    if "other_tail_path" in result:
        o = result["other_tail_path"]
        print(f"with tail {o['tail_path']}: all {o['us_per_token']} us/token, by check {o['us_per_token_by_check']}")
    if "reference_recompute_us_per_token" in result:
        print(f"full reference recompute: {result['reference_recompute_us_per_token']} us/token")
    for name, f in result.get("faults", {}).items():
        print(f"fault {name:<18} caught={f['caught']} by={[b.split(':')[0] for b in f['by']]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
