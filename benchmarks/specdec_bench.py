"""Speculative decoding speed at batch 1 (and --batch-sizes): `eyas generate` (chain and EAGLE-2 tree) vs target-only decoding.

For each drafting mode and each engine (--engine: `plain`, specdec/speculative.py, the reference loop;
`static`, specdec/speculative_static.py, static shapes + CUDA graphs), every MT-bench turn is decoded
twice in the same process through the same loop: with the drafter, then target-only. Reported per mode
and engine: tokens/s of both, the speed-up, tau (acceptance length, counting the bonus token),
per-position acceptance, the time split (prefill / draft / verify / overhead) and whether the greedy
outputs were identical; with --predict, also the speed-up `eyas eval` predicts from measured step costs
(specdec/speculative.py: predict_for_modes; the static engine's rounds on CUDA, the plain engine's elsewhere).

Headline figures (tree mode, from the engine with the higher speculative tokens/s, named in
specdec_engine_bs1): specdec_speedup_bs1 (against that engine's own target-only run),
specdec_speedup_vs_fastest_target_bs1 (against the fastest target-only run of any engine),
specdec_tau_bs1, specdec_predicted_speedup_bs1.

--batch-sizes 1,4,16: for each batch size B > 1, each mode is also decoded by the batched engine
(specdec/speculative_batched.py, `eyas generate --batch-size B`: each turn's prompts in groups of B,
greedy), speculative and target-only in the same process; tree mode's figures become
specdec_speedup_bsB, specdec_tau_bsB, specdec_tokens_per_s_bsB (all rows' tokens) and
specdec_target_tokens_per_s_bsB, and specdec_same_as_bs1_bsB says whether every output equals the
batch-1 run's (float32: must; bf16 may flip a near-tie). A batch holds at most as many prompts as a
turn has (--limit 10: 10 per turn), reported as rows_bsB.

GPU (one H200; a trained drafter for the target; without the MT-bench package, pass a JSONL of
{"turns": [...]} with --prompts):

    PYTHONPATH=src python benchmarks/specdec_bench.py --drafter DIR [--target DIR|default] [--limit 20] [--prompts FILE]

CPU check (a random drafter, two conversations, short answers; tau ~1, so the speed-up is < 1):

    PYTHONPATH=src python benchmarks/specdec_bench.py --limit 2 --max-new-tokens 24 --device cpu
    PYTHONPATH=src python benchmarks/specdec_bench.py --limit 4 --max-new-tokens 24 --device cpu --batch-sizes 1,4

Progress goes to stderr; a table and, as the LAST stdout line, one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path


def log(msg: str) -> None:
    print(f"specdec_bench: {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--drafter", default=None, help="drafter directory (eyas, SGLang or speculators layout); default: random"
    )
    ap.add_argument("--target", default="default", help="target directory or 'default' (SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default="mtbench", help="'mtbench' or a JSONL prompts file")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations only")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--modes", default="tree,chain", help="comma-separated: tree, chain")
    ap.add_argument(
        "--engine", default="plain,static", help="comma-separated: plain, static (each one's own table rows)"
    )
    ap.add_argument("--chain-k", type=int, default=7)
    ap.add_argument("--tree-topk", type=int, default=10)
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--tree-tokens", type=int, default=60)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random drafter")
    ap.add_argument(
        "--batch-sizes",
        default="1",
        help="comma-separated batch sizes, e.g. 1,4,16 (> 1: the batched engine, speculative and target-only)",
    )
    ap.add_argument(
        "--predict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure draft/verify step costs and the speed-up they predict from tau",
    )
    args = ap.parse_args()
    try:
        batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not batch_sizes or batch_sizes[0] < 1:
        ap.error(f"--batch-sizes: every batch size must be >= 1, got {args.batch_sizes!r}")

    import torch

    from eyas.defaults import resolve_target
    from eyas.specdec.generate_run import GenerateConfig, run_generate

    t_start = time.perf_counter()
    target_dir = str(resolve_target(args.target))
    figures: dict = {
        "drafter": args.drafter or "random",
        "target": args.target,
        "prompts": args.prompts,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": 1,
        "batch_sizes": batch_sizes,
        "temperature": 0,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    engines = [e.strip() for e in args.engine.split(",") if e.strip()] if 1 in batch_sizes else []
    figures["engines"] = engines
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.drafter:
            drafter = Path(args.drafter)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from eval_bench import random_drafter

            drafter = random_drafter(target_dir, Path(tmp) / "drafter", seed=args.seed)
            log("no --drafter: a random drafter (tau ~1): the speed-up below is the loop's overhead, not a result")

        def config(mode: str, **kw) -> GenerateConfig:
            return GenerateConfig(
                drafter=drafter,
                target=target_dir,
                prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                mode=mode,
                chain_k=args.chain_k,
                tree_topk=args.tree_topk,
                tree_depth=args.tree_depth,
                tree_tokens=args.tree_tokens,
                device=args.device,
                model_dtype=args.dtype,
                limit=args.limit,
                **kw,
            )

        def timed_run(key: str, cfg: GenerateConfig) -> dict:
            """One `eyas generate` run's summary (+ wall_s, outputs), or {"error": ...}: one run failing
            must not lose the others' figures."""
            try:
                t0 = time.perf_counter()
                summary, records = run_generate(cfg)
                summary["wall_s"] = round(time.perf_counter() - t0, 2)
                summary["outputs"] = [r["generated_ids"] for r in records]
                return summary
            except Exception as exc:
                log(f"{key} failed: {type(exc).__name__}: {exc}")
                traceback.print_exc(file=sys.stderr)
                return {"error": f"{type(exc).__name__}: {exc}"}

        for mode in modes:
            cfg = None
            for engine in engines:
                key = f"{mode}/{engine}"
                log(f"mode {mode}, engine {engine}: decoding with the drafter and target-only")
                cfg = config(mode, engine=engine)
                runs[key] = timed_run(key, cfg)
            bs1_outputs = next(
                (runs[f"{mode}/{e}"]["outputs"] for e in engines if "outputs" in runs[f"{mode}/{e}"]), None
            )
            for bs in batch_sizes:
                if bs == 1:
                    continue
                key = f"{mode}/batched/bs{bs}"
                log(f"mode {mode}, batch size {bs}: decoding with the drafter and target-only (batched engine)")
                summary = runs[key] = timed_run(key, config(mode, batch_size=bs))
                if "outputs" in summary:
                    summary["rows"] = round(summary["sequences"] / summary["batches"], 2)  # mean prompts a batch
                    outs_b = summary.pop("outputs")
                    summary["same_as_bs1"] = (outs_b == bs1_outputs) if bs1_outputs is not None else None
            ok = {e: runs[f"{mode}/{e}"] for e in engines if "error" not in runs[f"{mode}/{e}"]}
            if not ok:
                if engines:
                    figures[mode] = {"error": "every engine failed"}
                continue
            outs = [s.pop("outputs") for s in ok.values()]
            best = max(ok, key=lambda e: ok[e]["tokens_per_s"] or 0)
            figures[mode] = dict(ok[best], engine=best)
            # greedy: every engine must give the same tokens (fp32 exactly; bf16 may flip a near-tie)
            figures[mode]["engines_agree"] = all(o == outs[0] for o in outs)
            base = [s.get("baseline_tokens_per_s") for s in ok.values() if s.get("baseline_tokens_per_s")]
            figures[mode]["speedup_vs_fastest_target"] = (ok[best]["tokens_per_s"] / max(base)) if base else None
            if args.predict and cfg is not None:
                try:
                    figures[mode]["predicted"] = predict(target_dir, drafter, cfg, figures[mode])
                except Exception as exc:
                    log(f"prediction for {mode} failed: {type(exc).__name__}: {exc}")
                    figures[mode]["predicted"] = {"error": f"{type(exc).__name__}: {exc}"}
    for s_ in runs.values():
        s_.pop("outputs", None)
    figures["runs"] = runs

    tree = figures.get("tree", {})
    figures["specdec_engine_bs1"] = tree.get("engine")
    figures["specdec_speedup_bs1"] = tree.get("speedup")
    figures["specdec_speedup_vs_fastest_target_bs1"] = tree.get("speedup_vs_fastest_target")
    figures["specdec_tau_bs1"] = tree.get("acceptance_length")
    figures["specdec_predicted_speedup_bs1"] = (tree.get("predicted") or {}).get("predicted_speedup")
    for bs in batch_sizes:
        if bs == 1:
            continue
        tb = runs.get(f"tree/batched/bs{bs}", {})
        figures[f"specdec_speedup_bs{bs}"] = tb.get("speedup")
        figures[f"specdec_tau_bs{bs}"] = tb.get("acceptance_length")
        figures[f"specdec_tokens_per_s_bs{bs}"] = tb.get("tokens_per_s")
        figures[f"specdec_target_tokens_per_s_bs{bs}"] = tb.get("baseline_tokens_per_s")
        figures[f"specdec_same_as_bs1_bs{bs}"] = tb.get("same_as_bs1")
        figures[f"rows_bs{bs}"] = tb.get("rows")
    figures["total_s"] = round(time.perf_counter() - t_start, 2)

    print(
        f"{'mode':<6}{'engine':<8}{'bs':>4}{'rows':>6}{'tok/s':>9}{'target':>9}{'speedup':>9}{'tau':>7}{'draft_s':>9}"
        f"{'verify_s':>9}{'over_s':>8}  same  =bs1  graphs"
    )
    f = lambda v, w, d: f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    for key, s in runs.items():
        mode, engine, *rest = key.split("/")
        bs = rest[0][2:] if rest else "1"
        if "error" in s:
            print(f"{mode:<6}{engine:<8}{bs:>4} failed: {s['error']}")
            continue
        t = s["time_s"]
        graphs = ",".join(s.get("cuda_graphs") or []) or "-"
        same1 = "-" if s.get("same_as_bs1") is None else str(s["same_as_bs1"])
        print(
            f"{mode:<6}{engine:<8}{bs:>4}{f(s.get('rows', 1), 6, 1)}{f(s['tokens_per_s'], 9, 1)}"
            f"{f(s.get('baseline_tokens_per_s'), 9, 1)}{f(s.get('speedup'), 9, 3)}{f(s['acceptance_length'], 7, 3)}"
            f"{f(t['draft_s'], 9, 2)}{f(t['verify_s'], 9, 2)}{f(t['overhead_s'], 8, 2)}  "
            f"{str(s.get('greedy_mismatches', '-') == 0):<5} {same1:<5} {graphs}"
        )
    for mode in modes:
        s = figures.get(mode, {})
        if "engine" in s:
            pred = (s.get("predicted") or {}).get("predicted_speedup")
            print(
                f"{mode}: fastest engine {s['engine']}, speed-up {f(s.get('speedup'), 0, 3)} (vs fastest target-only "
                f"{f(s.get('speedup_vs_fastest_target'), 0, 3)}), predicted ({(s.get('predicted') or {}).get('engine')} costs) {f(pred, 0, 3)}, "
                f"engines agree {s.get('engines_agree')}"
            )
    print(json.dumps(figures, default=str))


def predict(target_dir: str, drafter: Path, cfg, summary: dict) -> dict:
    """Step costs measured on this device by `eyas eval`'s prediction (the static engine's rounds on CUDA,
    the plain engine's elsewhere), and the speed-up they predict from the measured tau."""
    from eyas.dtypes import resolve_device_dtype
    from eyas.specdec.replay import TreeConfig
    from eyas.specdec.run import load_drafter_for
    from eyas.specdec.speculative import predict_for_modes
    from eyas.target import load_target

    device, dtype = resolve_device_dtype(cfg.device, cfg.model_dtype)
    target = load_target(target_dir, device=device, dtype=dtype)
    ckpt, d = load_drafter_for(target, drafter, device=device, dtype=dtype)
    tree: TreeConfig = cfg.tree()
    out = predict_for_modes(
        target, d, {"m": tree}, {"m": summary["acceptance_length"]}, layer_ids=ckpt.config.aux_layer_ids, context=512
    )["m"]
    if "skipped" in out:
        return {"error": out["skipped"]}
    return out["step_costs_s"] | {
        "predicted_speedup": out["predicted_speedup_bs1"],
        "static_error": out.get("static_error"),
    }


if __name__ == "__main__":
    main()
