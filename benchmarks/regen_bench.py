"""Regeneration benchmark: the two-turn workload end to end, and greedy parity with `generate` in fp32.

Parts (each runs on its own; a part that fails prints the reason and the others still run):

  fp32   `regen_fp32_identical`: the same P first-turn ShareGPT prompts answered greedily in fp32
         by Hugging Face `generate` (one left-padded batch of P) and by StaticEngine at batch P
         (the engine's default attention: the per-row Triton kernel on CUDA); the fraction of
         answers with identical token ids (and the mean matching prefix). Runs first: it is short.
  2turn  `regen_2turn_tok_s`: `eyas regenerate` (the real code path, `eyas.regen.run.regenerate`)
         over N chats, --max-turns 2 --max-new-tokens 512, every other option at its default
         (dtype of the target, auto batch, auto attention). Answer tokens / wall seconds of the
         whole call (source count, model load, graph capture included), plus the summary's own
         rate (driver only), engine_stats (occupancy, attention efficiency, time per phase,
         prefill and decode tokens/s) and the engine description (which kernels ran).
  sdpa   the same command with `--attention sdpa` (masked attention over a span covering every
         row, the previous decode path) on the first M chats, for comparison.
  batch  the 2turn command with --batch-size 1024 (the default caps the batch at 512): whether a
         larger batch is faster on this workload.
  sdpa and batch are skipped when their estimated time would take the whole run past --budget.

GPU (H200: ~4 min at the 40K tok/s target, at most ~--budget 330 s plus one part's overrun; --chats from lab/scripts/stage_chats.py):
    PYTHONPATH=src python benchmarks/regen_bench.py --target DIR --chats chats.jsonl.gz
CPU proxy (tiny random llama on the target's tokenizer, a few minutes on one core):
    PYTHONPATH=src python benchmarks/regen_bench.py --small
Progress goes to stderr; stdout ends with a short table and one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from eyas.regen.local import GenerateEngine, StaticEngine, _Prepared, render_prompt
from eyas.regen.requests import Request
from eyas.regen.sampling import Sampling
from eyas.target import load_target, load_tokenizer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def plain_source(chats: str | None, tmp: Path) -> str:
    """A path `eyas regenerate --source` reads: .gz files are unpacked to tmp (sources read plain files)."""
    if not chats:
        return "sharegpt"
    if chats.endswith(".gz"):
        out = tmp / "chats.jsonl"
        with gzip.open(chats, "rb") as f, open(out, "wb") as g:
            shutil.copyfileobj(f, g)
        return str(out)
    return chats


def first_turns(source: str, n: int, tok, max_prompt_tokens: int) -> list[list[dict]]:
    """First-turn prompts ([system?, user]) of up to n conversations that fit max_prompt_tokens."""
    from eyas.data.sources import Conversation, iter_conversations

    out: list[list[dict]] = []
    for item in iter_conversations(source):
        if not isinstance(item, Conversation):
            continue
        msgs = []
        for m in item.messages:
            msgs.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "user":
                break
        if len(render_prompt(tok, msgs)) <= max_prompt_tokens:
            out.append(msgs)
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"no usable first turns in {source}")
    return out


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, got))
    prefix = []
    for a, b in zip(ref, got):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k / max(len(a), len(b), 1))
    return {
        "identical": same,
        "compared": len(ref),
        "fraction_identical": round(same / max(len(ref), 1), 4),
        "mean_matching_prefix": round(sum(prefix) / max(len(prefix), 1), 4),
    }


def part_fp32(args, target: str, source: str, device: str) -> dict:
    """Greedy token ids of `generate` and StaticEngine, fp32, same prompts, same batch of P."""
    tok = load_tokenizer(target)
    model = load_target(target, device=device, dtype=torch.float32)
    prompts = first_turns(source, args.fp32_prompts, tok, args.max_prompt_tokens)
    P, max_new = len(prompts), args.fp32_new_tokens
    max_len = args.max_prompt_tokens + max_new
    reqs = [Request((i, 0), m, max_new, i) for i, m in enumerate(prompts)]
    log(f"bench fp32: {P} prompts x {max_new} new tokens, generate vs StaticEngine, batch {P}")
    gen = GenerateEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=P)
    items = [_Prepared(r, render_prompt(tok, r.messages), max_new) for r in reqs]
    sync(device)
    t0 = time.perf_counter()
    ref = gen.generate_batch(items)
    sync(device)
    t_gen = time.perf_counter() - t0
    eng = StaticEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=P, max_new_tokens=max_new)
    results: dict = {}
    queue = list(reqs)

    def pull(n):
        nonlocal queue
        out, queue = queue[:n], queue[n:]
        return out

    sync(device)
    t0 = time.perf_counter()
    eng.run(pull, lambda r: results.__setitem__(r.key[0], r))
    sync(device)
    t_eng = time.perf_counter() - t0
    got = [results[i].token_ids for i in range(P)]
    ref = [r[:-1] if r and r[-1] in eng.stop else r for r in ref]  # both without the stop token
    out = {
        "prompts": P,
        "max_new_tokens": max_new,
        "generate_s": round(t_gen, 2),
        "static_s": round(t_eng, 2),
        **compare(ref, got),
        "engine": eng.describe(),
    }
    log(
        f"  identical {out['identical']}/{P} (mean matching prefix {out['mean_matching_prefix']}); "
        f"decode attention {out['engine']['decode_attention']}, prefill {out['engine']['prefill_attention']}"
    )
    del eng, gen, model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def part_regenerate(
    args, target: str, source: str, device: str, tmp: Path, *, limit: int, name: str, **overrides
) -> dict:
    """`eyas regenerate` through its Python entry point, default options except `overrides`."""
    from eyas.regen.run import RegenConfig, regenerate

    cfg = RegenConfig(
        out=tmp / f"out_{name}",
        source=source,
        target=target,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        limit=limit,
        overwrite=True,
        device=device,
        **overrides,
    )
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items())
    log(
        f"bench {name}: eyas regenerate --source {source} --limit {limit} --max-turns {args.max_turns} "
        f"--max-new-tokens {args.max_new_tokens} {flags}"
    )
    sync(device)
    t0 = time.perf_counter()
    summary = regenerate(cfg)
    sync(device)
    wall = time.perf_counter() - t0
    meta = json.loads((tmp / f"out_{name}" / "meta.json").read_text())
    tokens = summary["tokens_this_run"]
    out = {
        "conversations": summary["conversations"],
        "written": summary["written"],
        "assistant_turns": summary["assistant_turns"],
        "truncated_turns": summary["truncated_turns"],
        "failed_turns": summary["failed_turns"],
        "answer_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s_wall": round(tokens / wall, 1),
        "driver_s": summary["elapsed_s"],
        "tok_s_driver": summary["tokens_per_s"],
        "engine_stats": summary["engine_stats"],
        "engine": meta.get("engine"),
    }
    log(
        f"  {tokens:,} answer tokens in {wall:.1f} s wall = {tokens / wall:,.0f} tok/s "
        f"(driver only {summary['tokens_per_s']:,.0f} tok/s)"
    )
    log("  engine_stats " + json.dumps(summary["engine_stats"]))
    if name == "2turn" and getattr(args, "keep", None):
        shutil.move(str(tmp / f"out_{name}"), args.keep)  # the regenerated chats, for `eyas prepare`
        out["kept"] = args.keep
    else:
        shutil.rmtree(tmp / f"out_{name}", ignore_errors=True)
    return out


def tiny_target(tok, out: Path) -> str:
    """A tiny random llama on the target's tokenizer (the CPU proxy: schedule and code paths, not speed)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="model directory (default: embedded SmolLM2)")
    ap.add_argument("--keep", default=None, help="move the 2turn part's `eyas regenerate` output here (else deleted)")
    ap.add_argument(
        "--chats", default=None, help="JSONL(.gz) chats (lab/scripts/stage_chats.py; default: embedded ShareGPT)"
    )
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--small", action="store_true", help="CPU proxy: a tiny random llama, small sizes")
    ap.add_argument("--parts", default="fp32,2turn,sdpa,batch", help="comma-separated subset of fp32,2turn,sdpa,batch")
    ap.add_argument("--conversations", type=int, default=None, help="2turn chats (GPU 6000, small 24)")
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="2turn answer limit (GPU 512, small 32)")
    ap.add_argument("--fp32-prompts", type=int, default=None, help="fp32 prompts = batch (GPU 64, small 4)")
    ap.add_argument("--fp32-new-tokens", type=int, default=None, help="fp32 answer limit (GPU 128, small 16)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="fp32 prompts longer than this are skipped")
    ap.add_argument("--compare-chats", type=int, default=None, help="sdpa part chats (GPU 1000, small 8)")
    ap.add_argument("--extra-batch", type=int, default=None, help="batch part: --batch-size (GPU 1024, small 16)")
    ap.add_argument(
        "--budget",
        type=float,
        default=330.0,
        help="seconds for the whole benchmark: an optional part (sdpa, batch) whose estimate would pass it is skipped",
    )
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    gpu = torch.device(device).type == "cuda"
    small = args.small or not gpu
    args.conversations = args.conversations or (24 if small else 6000)
    args.max_new_tokens = args.max_new_tokens or (32 if small else 512)
    args.fp32_prompts = args.fp32_prompts or (4 if small else 64)
    args.fp32_new_tokens = args.fp32_new_tokens or (16 if small else 128)
    args.compare_chats = args.compare_chats or (8 if small else 1000)
    args.extra_batch = args.extra_batch or (16 if small else 1024)
    t_start = time.perf_counter()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    import transformers

    res: dict = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": args.target,
        "chats": args.chats,
        "small": args.small,
        "errors": {},
    }
    try:
        import triton

        res["triton"] = triton.__version__
    except Exception as exc:
        res["triton"] = f"unavailable ({type(exc).__name__})"
    log(f"bench: device {res['device']}; torch {res['torch']}; triton {res['triton']}; parts {parts}")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        source = plain_source(args.chats, tmp)
        target = tiny_target(load_tokenizer(args.target), tmp / "tiny") if args.small else args.target

        def attempt(part, fn, *a, **kw):
            try:
                res[part] = fn(*a, **kw)
            except Exception as exc:  # report and go on with the other parts
                res["errors"][part] = f"{type(exc).__name__}: {exc}"
                log(f"bench {part}: FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")

        if "fp32" in parts:
            attempt("fp32", part_fp32, args, target, source, device)
        if "2turn" in parts:
            attempt("2turn", part_regenerate, args, target, source, device, tmp, limit=args.conversations, name="2turn")
        # Optional parts run only when their estimated time still fits --budget (whole benchmark).
        two_wall = res.get("2turn", {}).get("wall_s")
        per_chat = two_wall / args.conversations if two_wall else None

        def fits(part: str, estimate_s: float | None) -> bool:
            spent = time.perf_counter() - t_start
            if estimate_s is not None and spent + estimate_s > args.budget:
                res["errors"][part] = f"skipped: ~{estimate_s:.0f} s more would pass --budget {args.budget:.0f} s"
                log(f"bench {part}: {res['errors'][part]}")
                return False
            return True

        if "sdpa" in parts and fits("sdpa", per_chat and 5 * per_chat * args.compare_chats):
            attempt(
                "sdpa",
                part_regenerate,
                args,
                target,
                source,
                device,
                tmp,
                limit=args.compare_chats,
                name="sdpa",
                attention="sdpa",
            )
        if "batch" in parts and args.extra_batch and fits("batch", two_wall):
            attempt(
                "batch",
                part_regenerate,
                args,
                target,
                source,
                device,
                tmp,
                limit=args.conversations,
                name="batch",
                batch_size=args.extra_batch,
            )

    two, fp = res.get("2turn"), res.get("fp32")
    res["regen_2turn_tok_s"] = two["tok_s_wall"] if two else None
    res["regen_fp32_identical"] = fp["fraction_identical"] if fp else None
    print(
        f"{'part':<8}{'answers':>9}{'tokens':>11}{'wall s':>9}{'tok/s':>10}{'occup.':>8}{'attn eff':>9}"
        f"{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/step':>9}"
    )
    for name in ("2turn", "sdpa", "batch"):
        r = res.get(name)
        if not r:
            print(f"{name:<8}  -- {res['errors'].get(name, 'not run')}")
            continue
        s = r["engine_stats"] or {}
        print(
            f"{name:<8}{r['assistant_turns']:>9,}{r['answer_tokens']:>11,}{r['wall_s']:>9.1f}{r['tok_s_wall']:>10,.0f}"
            f"{s.get('occupancy') or 0:>8.2f}{s.get('attention_efficiency') or 0:>9.2f}"
            f"{s.get('prefill_tok_s') or 0:>15,.0f}{s.get('decode_tok_s') or 0:>14,.0f}{s.get('decode_ms_per_step') or 0:>9.2f}"
        )
    print(
        "fp32 greedy identical to generate: "
        + (
            f"{fp['identical']}/{fp['compared']} ({fp['fraction_identical']})"
            if fp
            else res["errors"].get("fp32", "not run")
        )
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
