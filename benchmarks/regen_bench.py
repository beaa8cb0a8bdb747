"""Regeneration throughput: eyas's static-cache engine vs transformers `generate`, same run.

Phase A, per dtype: the same B first-turn prompts (ShareGPT) answered greedily by stock `generate`
(one left-padded batch of B) and by StaticEngine at batch B; tokens/s of each and the fraction of
answers whose token ids are identical (plus the mean fraction of each answer that matches before the
first difference). Phase B: StaticEngine alone at a larger batch over more prompts, with continuous
refill: the rate a real `eyas regenerate` run gets.

Tokens = generated tokens up to and including the end-of-turn token (what the model computed for
the answer); time excludes model loading and CUDA-graph capture (reported separately).

Phase C (--multi-turn): the whole driver (Regenerator + ChatsWriter) over multi-turn chats, the
way `eyas regenerate --max-turns 2` runs, with every answer allowed to continue after truncation so a
random target still asks its second turns; reports the engine's occupancy, attention efficiency and
prefill/decode/host time split (`StaticEngine.stats`). `--tiny` uses a tiny random llama on the
target's tokenizer, the CPU proxy for the schedule (its answers always run to max_new_tokens).

GPU (~2 min):  PYTHONPATH=src python benchmarks/regen_bench.py --target DIR [--chats FILE.jsonl[.gz]]
CPU:           PYTHONPATH=src python benchmarks/regen_bench.py --small
Schedule:      PYTHONPATH=src python benchmarks/regen_bench.py --simulate   (batch 512, 3000 chats, ~1 min CPU)
CPU proxy:     PYTHONPATH=src python benchmarks/regen_bench.py --multi-turn --tiny --big-batch 16 \
                   --conversations 96 --max-new-tokens 512 --max-len 2048
The last stdout line is one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

from eyas.regen.local import GenerateEngine, StaticEngine, _Prepared, render_prompt
from eyas.regen.requests import Request
from eyas.regen.sampling import Sampling
from eyas.target import load_target, load_tokenizer

SYNTHETIC = [
    "Explain how {} works to a ten-year-old.", "Write a short story about {}.", "What are the pros and cons of {}?",
    "Give me a step-by-step plan to learn {}.", "Summarise the history of {} in a paragraph.",
    "Write a Python function related to {} and explain it.",
]
TOPICS = ["photosynthesis", "the stock market", "a lighthouse keeper", "remote work", "chess", "volcanoes",
          "electric cars", "the French revolution", "sorting algorithms", "coffee", "black holes", "gardening"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_turns(chats: str | None, n: int, tok, max_prompt_tokens: int) -> list[list[dict]]:
    """First-turn prompts ([system?, user]) of up to n conversations that fit max_prompt_tokens."""
    from eyas.data.sources import Conversation, iter_conversations, normalise

    def records():
        if chats and chats.endswith(".gz"):
            with gzip.open(chats, "rt", encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        yield normalise(json.loads(line), f"gz:{i}")
        else:
            yield from iter_conversations(chats or "sharegpt")

    out: list[list[dict]] = []
    try:
        for item in records():
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
    except Exception as exc:  # no ShareGPT wheel on this machine: synthetic prompts instead
        log(f"bench: chats unavailable ({type(exc).__name__}: {exc}); using synthetic prompts")
    k = 0
    while len(out) < n:
        out.append([{"role": "user", "content": SYNTHETIC[k % len(SYNTHETIC)].format(TOPICS[(k // len(SYNTHETIC)) % len(TOPICS)]) + (f" (variant {k})" if k >= 72 else "")}])
        k += 1
    return out


def requests(prompts, max_new) -> list[Request]:
    return [Request((i, 0), m, max_new, i) for i, m in enumerate(prompts)]


def run_engine(engine, reqs) -> tuple[dict, float]:
    queue, results = list(reqs), {}

    def pull(n):
        nonlocal queue
        out, queue = queue[:n], queue[n:]
        return out

    sync(engine.device)
    t0 = time.perf_counter()
    engine.run(pull, lambda r: results.__setitem__(r.key[0], r))
    sync(engine.device)
    return results, time.perf_counter() - t0


def time_generate(model, tok, prompts, *, batch, max_new, max_len) -> tuple[list[list[int]], float, int]:
    """Stock generate over `prompts` in batches of `batch` (ids incl. stop token, seconds, tokens)."""
    eng = GenerateEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=batch)
    items = [_Prepared(r, render_prompt(tok, r.messages), max_new) for r in requests(prompts, max_new)]
    eng.generate_batch([_Prepared(items[0].req, items[0].ids, 4)])  # warm-up
    sync(eng.device)
    t0 = time.perf_counter()
    outs: list[list[int]] = []
    for s in range(0, len(items), batch):
        outs += eng.generate_batch(items[s : s + batch])
    sync(eng.device)
    return outs, time.perf_counter() - t0, sum(len(o) for o in outs)


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, got))
    prefix = []
    for a, b in zip(ref, got):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k / max(len(a), len(b), 1))
    return {"identical": same, "compared": len(ref), "fraction_identical": round(same / max(len(ref), 1), 4),
            "mean_matching_prefix": round(sum(prefix) / max(len(prefix), 1), 4)}


def phase_a(model, tok, prompts, *, batch, max_new, max_len, dtype_name, self_check: bool) -> dict:
    log(f"bench A [{dtype_name}]: generate, batch {batch}, {len(prompts)} prompts, {max_new} new tokens max")
    ref, t_gen, n_gen = time_generate(model, tok, prompts, batch=batch, max_new=max_new, max_len=max_len)
    log(f"  generate: {n_gen} tokens in {t_gen:.2f} s = {n_gen / t_gen:,.0f} tok/s")
    eng = StaticEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=batch, max_new_tokens=max_new)
    run_engine(eng, requests(prompts[:2], 4))  # warm-up (allocator, kernels)
    res, t_st = run_engine(eng, requests(prompts, max_new))
    got = [res[i].token_ids for i in range(len(prompts))]
    ref = [r[:-1] if r and r[-1] in eng.stop else r for r in ref]  # both without the stop token
    n_st = sum(res[i].new_tokens for i in range(len(prompts)))
    log(f"  static:   {n_st} tokens in {t_st:.2f} s = {n_st / t_st:,.0f} tok/s ({eng.steps} decode steps; graphs {eng.use_graphs}, capture {eng.capture_s:.1f} s)")
    cmp_ = compare(ref, got)
    log(f"  greedy outputs identical: {cmp_['identical']}/{cmp_['compared']}, mean matching prefix {cmp_['mean_matching_prefix']:.3f}")
    noise = None
    if self_check and batch >= 8:
        # The noise floor: generate against itself at batch B/4 on the first B/4 prompts.
        q = batch // 4
        ref_q, _, _ = time_generate(model, tok, prompts[:q], batch=q, max_new=max_new, max_len=max_len)
        ref_q = [r[:-1] if r and r[-1] in eng.stop else r for r in ref_q]
        noise = {"batch": q, **compare(ref[:q], ref_q)}
        log(f"  generate at batch {q} vs batch {batch}: identical {noise['identical']}/{noise['compared']}, "
            f"mean matching prefix {noise['mean_matching_prefix']:.3f}")
    out = {"dtype": dtype_name, "batch": batch, "prompts": len(prompts), "max_new_tokens": max_new,
           "generate_tokens": n_gen, "generate_s": round(t_gen, 3), "generate_tok_s": round(n_gen / t_gen, 1),
           "static_tokens": n_st, "static_s": round(t_st, 3), "static_tok_s": round(n_st / t_st, 1),
           "speedup": round((n_st / t_st) / (n_gen / t_gen), 2), "graph_capture_s": round(eng.capture_s, 2),
           "cuda_graphs": eng.use_graphs, "capture_error": eng.capture_error, **cmp_, "generate_vs_itself": noise}
    del eng
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def phase_b(model, tok, prompts, *, batch, max_new, max_len, dtype_name) -> dict:
    log(f"bench B [{dtype_name}]: static engine, batch {batch}, {len(prompts)} prompts, continuous refill")
    eng = StaticEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=batch, max_new_tokens=max_new)
    run_engine(eng, requests(prompts[:2], 4))
    res, t = run_engine(eng, requests(prompts, max_new))
    n = sum(r.new_tokens for r in res.values())
    trunc = sum(r.truncated for r in res.values())
    log(f"  static:   {n} tokens in {t:.2f} s = {n / t:,.0f} tok/s ({trunc} answers hit the limit)")
    out = {"dtype": dtype_name, "batch": batch, "prompts": len(prompts), "max_new_tokens": max_new,
           "tokens": n, "seconds": round(t, 3), "tok_s": round(n / t, 1), "truncated_answers": trunc,
           "graph_capture_s": round(eng.capture_s, 2), "kv_cache_gib": round(eng.lm.cache_bytes / 2**30, 2)}
    del eng
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def tiny_target(tok, out: str) -> str:
    """A tiny random llama on `tok` (the schedule, not the arithmetic, is what phase C measures)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def phase_c(model, tok, *, chats, conversations, batch, max_new, max_len, engine_kwargs) -> dict:
    import tempfile

    from eyas.data.sources import iter_conversations
    from eyas.regen.driver import RegenOptions, Regenerator
    from eyas.regen.output import ChatsWriter

    log(f"bench C: driver + static engine, batch {batch}, {conversations} conversations x 2 turns, "
        f"max_new_tokens {max_new}, max_len {max_len}, {engine_kwargs or 'default engine options'}")
    eng = StaticEngine(model, tok, sampling=Sampling(), max_len=max_len, batch=batch, max_new_tokens=max_new,
                       **engine_kwargs)
    opts = RegenOptions(max_new_tokens=max_new, max_turns=2, continue_after_truncated=True, log_seconds=1e9)
    opts.max_in_flight = max(opts.max_in_flight, 4 * batch)  # as run.py sets it
    with tempfile.TemporaryDirectory() as out:
        writer = ChatsWriter(Path(out), settings={"bench": True}, extra_meta={})
        items = enumerate(iter_conversations(chats or "sharegpt", limit=conversations))
        drv = Regenerator(items, writer, sampling=Sampling(), options=opts, total=conversations)
        sync(eng.device)
        t0 = time.perf_counter()
        drv.run(eng)
        sync(eng.device)
        dt = time.perf_counter() - t0
        counts = writer.counts()
    stats = eng.stats()
    out = {"batch": batch, "conversations": conversations, "max_new_tokens": max_new, "max_len": max_len,
           "engine_options": engine_kwargs, "assistant_turns": counts.get("assistant_turns"), "tokens": drv.tokens,
           "seconds": round(dt, 2), "tok_s": round(drv.tokens / dt, 1), "graph_capture_s": round(eng.capture_s, 2),
           **stats}
    log("  " + json.dumps(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="model directory (default: embedded SmolLM2)")
    ap.add_argument("--chats", default=None, help="JSONL(.gz)/JSON chats for prompts (default: embedded ShareGPT)")
    ap.add_argument("--small", action="store_true", help="CPU-sized run")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtypes", default=None, help="phase A dtypes, comma-separated (GPU: bfloat16,float32)")
    ap.add_argument("--batch", type=int, default=None, help="phase A batch (GPU 256, small 4)")
    ap.add_argument("--big-batch", type=int, default=None, help="phase B batch (GPU 512, small 8)")
    ap.add_argument("--prompts-b", type=int, default=None, help="phase B prompts (GPU 2048, small 16)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="GPU 256, small 24")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="GPU 512, small 160")
    ap.add_argument("--no-self-check", action="store_true", help="skip generate vs itself at batch B/4 (the noise floor)")
    ap.add_argument("--multi-turn", action="store_true", help="phase C only: the driver over 2-turn chats")
    ap.add_argument("--simulate", action="store_true", help="phase S only: the refill schedule without a model")
    ap.add_argument("--p-limit", type=float, default=0.54, help="phase S: fraction of answers cut at the limit")
    ap.add_argument("--tiny", action="store_true", help="phase C on a tiny random llama with the target's tokenizer")
    ap.add_argument("--conversations", type=int, default=None, help="phase C conversations (GPU 3000, small 96)")
    ap.add_argument("--max-len", type=int, default=2048, help="phase C context")
    ap.add_argument("--engine-options", default="{}", help='phase C StaticEngine options as JSON, e.g. \'{"lanes": 1}\'')
    args = ap.parse_args()
    if args.simulate:
        simulate(args)
        return
    if args.multi_turn:
        multi_turn(args)
        return

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    gpu = device.type == "cuda"
    dtypes = (args.dtypes or ("bfloat16,float32" if gpu else "float32")).split(",")
    batch = args.batch or (256 if gpu else 4)
    big = args.big_batch or (512 if gpu else 8)
    n_b = args.prompts_b or (2048 if gpu else 16)
    max_new = args.max_new_tokens or (256 if gpu else 24)
    max_prompt = args.max_prompt_tokens or (512 if gpu else 160)
    max_len = max_prompt + max_new

    tok = load_tokenizer(args.target)
    prompts = first_turns(args.chats, max(batch, n_b), tok, max_prompt)
    log(f"bench: {len(prompts)} prompts; device {device}; "
        f"{torch.cuda.get_device_name(device) if gpu else 'cpu'}; torch {torch.__version__}")
    results: dict = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
                     "target": str(args.target), "max_len": max_len, "phase_a": [], "phase_b": None}
    import transformers

    results["transformers"] = transformers.__version__
    for name in dtypes:
        model = load_target(args.target, device=device, dtype=getattr(torch, name))
        results["phase_a"].append(phase_a(model, tok, prompts[:batch], batch=batch, max_new=max_new, max_len=max_len,
                                          dtype_name=name, self_check=not args.no_self_check))
        if results["phase_b"] is None:
            results["phase_b"] = phase_b(model, tok, prompts[:n_b], batch=big, max_new=max_new, max_len=max_len,
                                         dtype_name=name)
        del model
        if gpu:
            torch.cuda.empty_cache()

    print(f"{'phase':<6}{'dtype':<10}{'batch':>6}{'generate tok/s':>16}{'eyas tok/s':>12}{'speedup':>9}"
          f"{'eyas=gen':>11}{'gen(B/4)=gen':>14}")
    for a in results["phase_a"]:
        noise = a["generate_vs_itself"]
        noise_s = f"{noise['identical']}/{noise['compared']}" if noise else "-"
        print(f"{'A':<6}{a['dtype']:<10}{a['batch']:>6}{a['generate_tok_s']:>16,.0f}{a['static_tok_s']:>12,.0f}"
              f"{a['speedup']:>9.1f}{str(a['identical']) + '/' + str(a['compared']):>11}{noise_s:>14}")
    b = results["phase_b"]
    print(f"{'B':<6}{b['dtype']:<10}{b['batch']:>6}{'-':>16}{b['tok_s']:>12,.0f}{'':>9}{'':>11}")
    print(json.dumps(results))


def simulate(args) -> None:
    """Phase S (--simulate): the refill schedule at GPU scale without a model, using the engine's own
    placement (`_place`) and span choice (`_spans_for`): ShareGPT prompt lengths (target tokenizer),
    2 user turns, answers of max_new_tokens with probability --p-limit (else uniform below; a second
    turn follows only an answer that was not cut, as `eyas regenerate` does by default). Reports
    occupancy and attention efficiency per (lanes, lookahead): what `engine_stats` shows on GPU."""
    import random
    import types
    from collections import deque

    from eyas.data.sources import iter_conversations

    tok = load_tokenizer(args.target)
    convs = []
    for c in iter_conversations(args.chats or "sharegpt", limit=args.conversations or 3000):
        users = [m["content"] for m in getattr(c, "messages", []) if m["role"] == "user"][:2]
        if users:
            convs.append((len(render_prompt(tok, [{"role": "user", "content": users[0]}])),
                          len(tok(users[1])["input_ids"]) + 10 if len(users) > 1 else None))
    batch, max_new, max_len, sync_every = args.big_batch or 512, args.max_new_tokens or 512, args.max_len, 8
    results = []
    for lanes, lookahead in ((1, 1), (2, 1), (4, 1), (4, 512)):
        rng = random.Random(0)
        eng = types.SimpleNamespace(sync_every=sync_every, spans=StaticEngine._spans(-(-max_len // 64) * 64, 256))
        eng.lanes = [(k * batch // lanes, (k + 1) * batch // lanes) for k in range(lanes)]
        eng.lane_of = [k for k, (lo, hi) in enumerate(eng.lanes) for _ in range(lo, hi)]
        eng._ngen = [1] * batch
        src, window, pending, host, ngen = iter(range(len(convs))), [], deque(), {}, [0] * batch
        steps = active = needed = attended = 0

        def ask(ci, turn, plen):
            p = types.SimpleNamespace(ids=range(plen), limit=min(max_new, max_len - plen), conv=ci, turn=turn)
            if p.limit >= 1:
                p.answer = p.limit if rng.random() < args.p_limit else rng.randint(min(30, p.limit), p.limit)
                pending.append(p)

        while True:
            free = [r for r in range(batch) if r not in host]
            if free and (len(free) >= batch // 8 or not host):
                while len(pending) < len(free):
                    while len(window) < lookahead and (nx := next(src, None)) is not None:
                        window.append(nx)
                    if not window:
                        break
                    ci = next((c for c in window if convs[c][1] is not None), window[0])
                    window.remove(ci)
                    ask(ci, 0, convs[ci][0])
                take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
                for r, p in zip(StaticEngine._place(eng, free, take), take):
                    host[r], ngen[r], eng._ngen[r] = p, 1, 1
            if not host:
                if not pending and not window:
                    break
                continue
            key = StaticEngine._spans_for(eng, host)
            for _ in range(sync_every):
                steps += 1
                attended += sum((hi - lo) * s for (lo, hi), s in zip(eng.lanes, key))
                for r, p in host.items():
                    if ngen[r] < p.answer:
                        active, needed, ngen[r] = active + 1, needed + len(p.ids) + ngen[r], ngen[r] + 1
            for r in list(host):
                eng._ngen[r] = ngen[r]
                p = host[r]
                if ngen[r] >= p.answer:
                    del host[r]
                    if p.turn == 0 and convs[p.conv][1] is not None and p.answer < p.limit:
                        ask(p.conv, 1, len(p.ids) + p.answer + convs[p.conv][1])
        res = {"lanes": lanes, "lookahead": lookahead, "decode_steps": steps, "tokens": active,
               "occupancy": round(active / (steps * batch), 4), "attention_efficiency": round(needed / attended, 4),
               "keys_attended_per_token": round(attended / active, 1)}
        log("  " + json.dumps(res))
        results.append(res)
    print(json.dumps({"simulate": {"batch": batch, "conversations": len(convs), "max_new_tokens": max_new,
                                   "max_len": max_len, "p_limit": args.p_limit, "runs": results}}))


def multi_turn(args) -> None:
    import tempfile

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    gpu = device.type == "cuda"
    tok = load_tokenizer(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_target(tok, tmp) if args.tiny else args.target
        model = load_target(target, device=device, dtype=torch.bfloat16 if gpu else torch.float32)
        res = phase_c(model, tok, chats=args.chats, conversations=args.conversations or (3000 if gpu else 96),
                      batch=args.big_batch or (512 if gpu else 16), max_new=args.max_new_tokens or 512,
                      max_len=args.max_len, engine_kwargs=json.loads(args.engine_options))
    print(json.dumps({"device": torch.cuda.get_device_name(device) if gpu else "cpu", "tiny": args.tiny,
                      "phase_c": res}))


if __name__ == "__main__":
    main()
