"""Eval speed and acceptance: MT-bench (80 questions x 2 turns) on SmolLM2, generation vs replay time.

One run does what `eyas eval` does and reports where the time goes:
  generation_s       the target's greedy answers (eval's path: the static-cache engine where it supports the
                     target, else batched Hugging Face generate; 2 turns)
  target_features_s  one target forward over every (prompt + answer) for the aux features
  replay_chain_s     replayed chain drafting (k tokens per round), all sequences in lock step
  replay_tree_s      replayed EAGLE-2 tree drafting (top-k / depth / tokens)
  total_s            wall time of the whole evaluation, loading included
plus tau (acceptance length, counting the bonus token) for chain and tree. Without --drafter a
randomly initialised drafter is used (embedding, lm_head rows and final norm copied from the target):
its tau is ~1, which makes every sequence take the maximum number of rounds, the replay's worst case.

GPU (about 1 minute on one H200; the goal is < 2 minutes for all 160 sequences at 256 new tokens):

    PYTHONPATH=src python benchmarks/eval_bench.py [--drafter DIR] [--target DIR|default]

CPU check (a few sequences, short answers):

    PYTHONPATH=src python benchmarks/eval_bench.py --limit 2 --max-new-tokens 32

With --compare-generate the same prompts (every turn's, as eval rendered them) are answered again through
Hugging Face `generate` (eval's fallback, one batch of --gen-batch-size), and the drafter replayed on those
answers too: hf_generation_s, the fraction of answers with identical ids, the mean share of each answer that
matches before the first difference, and tau on the fallback's answers (hf_tau_chain, hf_tau_tree).

Progress goes to stderr; a table and, as the LAST stdout line, one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def random_drafter(target_dir: str, out: Path, *, seed: int) -> Path:
    import torch

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target, model_identity

    target = load_target(target_dir)
    cfg = DrafterConfig.from_target_config(target.config)
    model = Eagle3Drafter(cfg)
    model.reset_parameters(seed=seed)
    head = target.get_output_embeddings().weight.detach()
    model.init_from_target(target.get_input_embeddings().weight.detach(), head, target.model.norm.weight.detach())
    model.save(out, target=model_identity(target_dir))
    del target
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def reference_check(cfg, records, report, n: int) -> dict:
    """Replay vs the real loop on the first n sequences, at the eval's device and dtype."""
    from eyas.dtypes import resolve_device_dtype
    from eyas.specdec.generate import eos_ids_of
    from eyas.specdec.reference import reference_decode
    from eyas.specdec.run import load_drafter_for
    from eyas.target import load_target, load_tokenizer

    device, dtype = resolve_device_dtype(cfg.device, cfg.model_dtype)
    target = load_target(cfg.target, device=device, dtype=dtype)
    _, drafter = load_drafter_for(target, Path(cfg.drafter), device=device, dtype=dtype)
    eos = eos_ids_of(target, load_tokenizer(cfg.target))
    out = {}
    for name, tree in cfg.modes().items():
        same_seq = same_rounds = 0
        t0 = time.perf_counter()
        for rec in records[:n]:
            print(f"eval_bench: reference loop ({name}) on {rec['id']} turn {rec['turn']}", file=sys.stderr, flush=True)
            gen, rounds = reference_decode(
                target,
                drafter,
                rec["prompt_ids"],
                layer_ids=report["drafter"]["aux_layer_ids"],
                max_new_tokens=cfg.max_new_tokens,
                tree=tree,
                eos_ids=eos,
            )
            same_seq += gen == rec["generated_ids"]
            same_rounds += rounds == rec[f"accepted_{name}"]
        out[name] = {
            "sequences": min(n, len(records)),
            "same_output": same_seq,
            "same_accepted_counts": same_rounds,
            "seconds": round(time.perf_counter() - t0, 2),
        }
    return out


def compare_generate(cfg, records, report) -> dict:
    """The fallback's greedy answers to eval's own prompts, against eval's, and the replay on them."""
    import torch

    from eyas.dtypes import resolve_device_dtype
    from eyas.specdec.generate import Sequence, eos_ids_of, hf_greedy_generate
    from eyas.specdec.run import load_drafter_for, mode_summary, replay_sequences
    from eyas.target import load_target, load_tokenizer

    device, dtype = resolve_device_dtype(cfg.device, cfg.model_dtype)
    target = load_target(cfg.target, device=device, dtype=dtype)
    tokenizer = load_tokenizer(cfg.target)
    eos = eos_ids_of(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    prompts = [r["prompt_ids"] for r in records]
    t0 = time.perf_counter()
    hf = hf_greedy_generate(
        target, prompts, max_new_tokens=cfg.max_new_tokens, eos_ids=eos, pad_id=pad, batch_size=cfg.gen_batch_size
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    ours = [r["generated_ids"] for r in records]

    def matching(a: list[int], b: list[int]) -> float:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(a), len(b), 1)

    _, drafter = load_drafter_for(target, Path(cfg.drafter), device=device, dtype=dtype)
    seqs = [
        Sequence(id=str(r["id"]), turn=r["turn"], prompt_ids=r["prompt_ids"], generated_ids=g)
        for r, g in zip(records, hf)
    ]
    modes = cfg.modes()
    rounds = replay_sequences(
        target,
        drafter,
        seqs,
        layer_ids=report["drafter"]["aux_layer_ids"],
        modes=modes,
        replay_tokens=cfg.replay_tokens,
        timings={},
    )
    out = {
        "hf_generation_s": round(seconds, 3),
        "hf_generated_tokens": sum(map(len, hf)),
        "answers_identical": round(sum(a == b for a, b in zip(hf, ours)) / len(ours), 4),
        "answers_matching_share": round(sum(matching(a, b) for a, b in zip(hf, ours)) / len(ours), 4),
    }
    for name, tree in modes.items():
        out[f"hf_tau_{name}"] = mode_summary(name, tree, rounds[name], seqs)["acceptance_length"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--drafter", default=None, help="drafter directory (eyas, SGLang or speculators layout); default: random"
    )
    ap.add_argument("--target", default="default", help="target directory or 'default' (SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default="mtbench", help="'mtbench' or a JSONL prompts file")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations only")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--chain-k", type=int, default=7)
    ap.add_argument("--tree-topk", type=int, default=10)
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--tree-tokens", type=int, default=60)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gen-batch-size", type=int, default=160)
    ap.add_argument("--replay-tokens", type=int, default=131072)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random drafter")
    ap.add_argument("--out", default=None, help="also write the eval report here")
    ap.add_argument(
        "--compare-generate",
        action="store_true",
        help="answer the same prompts through Hugging Face generate too and replay on those answers (see above)",
    )
    ap.add_argument(
        "--reference-check",
        type=int,
        default=0,
        help="re-decode the first N sequences with the real speculative decoding loop (specdec/reference.py) "
        "and count those whose output and accepted counts equal the replay's (slow: ~10-30 s each)",
    )
    args = ap.parse_args()

    import torch

    from eyas.defaults import resolve_target
    from eyas.specdec.run import EvalConfig, run_eval

    t_start = time.perf_counter()
    target_dir = str(resolve_target(args.target))
    with tempfile.TemporaryDirectory() as tmp:
        drafter = (
            Path(args.drafter) if args.drafter else random_drafter(target_dir, Path(tmp) / "drafter", seed=args.seed)
        )
        print(f"eval_bench: drafter {drafter}{' (random)' if not args.drafter else ''}", file=sys.stderr, flush=True)
        cfg = EvalConfig(
            drafter=drafter,
            target=target_dir,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            chain_k=args.chain_k,
            tree_topk=args.tree_topk,
            tree_depth=args.tree_depth,
            tree_tokens=args.tree_tokens,
            device=args.device,
            model_dtype=args.dtype,
            limit=args.limit,
            gen_batch_size=args.gen_batch_size,
            replay_tokens=args.replay_tokens,
        )
        t0 = time.perf_counter()
        report, records = run_eval(cfg)
        total = time.perf_counter() - t0
        check = reference_check(cfg, records, report, args.reference_check) if args.reference_check else None
        versus = compare_generate(cfg, records, report) if args.compare_generate else {}
        if args.out:
            from eyas.common import atomic_directory
            from eyas.specdec.report import write_report

            with atomic_directory(Path(args.out), overwrite=True) as d:
                write_report(d, report, records)

    t = report["timings"]
    modes = report["modes"]
    gen = report["generation"]
    figures = {
        "device": report["settings"]["device"],
        "gpu": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and "cuda" in report["settings"]["device"]
        else None,
        "dtype": report["settings"]["dtype"],
        "drafter": "random" if not args.drafter else str(args.drafter),
        "conversations": report["prompts"]["conversations"],
        "sequences": gen["sequences"],
        "prompt_tokens": gen["prompt_tokens"],
        "generated_tokens": gen["generated_tokens"],
        "max_new_tokens": args.max_new_tokens,
        "load_s": t.get("load_s"),
        "generation_s": t.get("generation_s"),
        "generation_tokens_per_s": round(gen["generated_tokens"] / t["generation_s"], 1)
        if t.get("generation_s")
        else None,
        "target_features_s": t.get("target_features_s"),
        "replay_chain_s": t.get("replay_chain_s"),
        "replay_tree_s": t.get("replay_tree_s"),
        "eval_s": round(total, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
        "tau_chain": modes.get("chain", {}).get("acceptance_length"),
        "tau_tree": modes.get("tree", {}).get("acceptance_length"),
        "rounds_chain": modes.get("chain", {}).get("rounds"),
        "rounds_tree": modes.get("tree", {}).get("rounds"),
        "chain": modes.get("chain", {}).get("settings"),
        "tree": modes.get("tree", {}).get("settings"),
        "reference_check": check,
        **versus,
    }
    print(f"{'stage':<22}{'seconds':>10}")
    for key in ("load_s", "generation_s", "target_features_s", "replay_chain_s", "replay_tree_s", "eval_s", "total_s"):
        v = figures[key]
        print(f"{key:<22}{'-' if v is None else f'{v:10.2f}':>10}")
    for name in ("chain", "tree"):
        if figures[f"tau_{name}"] is not None:
            print(
                f"tau {name:<18}{figures[f'tau_{name}']:10.3f}   ({figures[name]}, {figures[f'rounds_{name}']} rounds)"
            )
    print(f"{figures['sequences']} sequences, {figures['generated_tokens']} generated tokens")
    if versus:
        print(
            f"generate (fallback): {versus['hf_generation_s']:.2f} s, answers identical {versus['answers_identical']}, "
            f"matching share {versus['answers_matching_share']}, tau chain {versus.get('hf_tau_chain')} / tree "
            f"{versus.get('hf_tau_tree')}"
        )
    if check:
        for name, c in check.items():
            print(
                f"reference check {name}: {c['same_accepted_counts']}/{c['sequences']} same accepted counts, "
                f"{c['same_output']}/{c['sequences']} same output"
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
