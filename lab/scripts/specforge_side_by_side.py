"""eyas vs SpecForge 0.2.0 on the same data and budget, both evaluated by the same `eyas eval` run settings.

Order of work (each step resumes or is skipped when its output is already there):
  1. capture   the prepared train split (e.g. a pipeline's <workdir>/prepared: the target's own answers)
               into a bf16 eyas store, --samples conversations
  2. eyas      `eyas train` OFFLINE from that store: --steps x --batch-size samples, --draft-vocab, TTT
  3. convert   the store into SpecForge's offline files (lab/scripts/specforge_convert.py) plus
               vocab_mapping.pt from eyas's drafter: ONE draft vocabulary for both
  4. specforge `specforge train` offline (data.hidden_states_path): the same steps, samples per step,
               lr, TTT length, max length and grad clip; its draft config is the one eyas exports for
               SGLang (same shape). Then its own exporter writes an SGLang directory.
  5. eval      `eyas eval` on both drafters (SGLang layout for both), identical settings
  6. variants  (--eyas-variant) each trained, exported and evaluated in turn, after the two above: a run
               cut short keeps the ratios it reached (each eval's taus are logged as it ends)
Both trainers see the same samples (all of the store) with the same batch size in samples, so the
same tokens per step on average (the orders differ: each trainer shuffles with its own seed).
What stays each trainer's own: its loss, its optimizer at the shared --lr (eyas: its default, Muon for drafters
under hidden size 2048 since 2026-12-02, AdamW before; SpecForge: AdamW), schedule details (eyas: cosine to 10% of
lr, 2% warmup; SpecForge: cosine, --warmup-ratio), data order and alignment of the mask (SpecForge shifts ids and
teacher by one and keeps the mask unshifted; eyas follows docs/ttt.md).

SpecForge on the GPU machine (no SGLang needed for offline training):
    pip install --no-deps specforge==0.2.0 pydantic pydantic_core annotated-types typing-inspection \
        datasets dill multiprocess
(what `specforge train` imports beyond the device image: lab/scripts/stage.sh stages these wheels;
or --specforge-path DIR: an unpacked wheel).
Its TargetHead reads `*.index.json` + the lm_head key from the target directory: a shadow directory
of symlinks with a generated index is made when the target has a single safetensors file, and the
tied embedding is named as the head when the target has no lm_head.weight (SmolLM2).

GPU, one H200 (~9 min at the defaults: capture ~1 min, eyas train ~2-4 min, SpecForge train ~3-5 min,
2 evals ~2.5 min); run the recipe first so <workdir>/prepared exists, and repeat the command if a
device call ends early: every step resumes.

    PYTHONPATH=src python lab/scripts/specforge_side_by_side.py --prepared runs/smollm2-gpu/prepared \
        --root runs/sbs --samples 3000 --steps 600 --batch-size 16 --draft-vocab 32000

Method ablations against the same SpecForge drafter: `--eyas-variant NAME:KEY=VALUE[,KEY=VALUE]` (repeatable; keys
from VARIANT_FIELDS: learning-rate schedule, weight decay, clipping, TTT decay, head init, dtype, teacher
temperature, the reachability mask align_topk, the feature loss, the optimizer; or a kernel of eyas.kernels
kernels.NAME=true|false, e.g. kernels.teacher_stats=false, set while the variant trains)
trains one more eyas drafter per variant on the same store with the same steps and samples per step, exports and
evaluates it with the same settings, and reports its ratios under `variants` (each variant about 1.5 GPU minutes at
the defaults: training and one eval, measured 91-101 s on 2026-12-01).

SpecForge saves every 200 steps (and at the end); a repeated call resumes its training from the newest
checkpoint, skips it when the last step's checkpoint exists, and exports that one.

CPU check, no GPU time (tests/test_specforge_side_by_side.py, ~30 s): a tiny target and a few chats with
--device cpu, e.g. --samples 8 --steps 4 --batch-size 2 --max-length 128 --draft-vocab 32 --eval-limit 1
--eval-max-new-tokens 12 --eval-tree-topk 4 --eval-tree-depth 3 --eval-tree-tokens 8. SpecForge then runs
through lab/scripts/specforge_cpu.py (its Triton loss kernel replaced by its own reference loss, torch.compile
off), and two config keys differ from the GPU run: training.fsdp_sharding NO_SHARD (FSDP needs an
accelerator; at world size 1 DDP is the same math) and training.attention_backend sdpa (FlexAttention has no
backward on the CPU). FSDP, FlexAttention, the Triton kernel and SpecForge's compiled helpers run on the GPU only.

Progress on stderr (SpecForge's own output too, also kept in <root>/specforge-run/train.log and export.log);
a table, then one JSON line on stdout: tau chain/tree of each, eyas/SpecForge ratios (of the rounded taus),
the evals' common settings (`eval_settings`; the run stops if the two evals' differ) and SpecForge's last
logged step, loss and accuracy (`specforge_train`). An eval's report is reused only when it was made with
the same settings.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
SF_RUN_ID = "sbs"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "lab" / "scripts"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step(name: str, done: bool) -> bool:
    log(
        f"\n== side by side: {name}: {'SKIPPED (output present)' if done else 'running'} ({time.strftime('%H:%M:%S')}) =="
    )
    return not done


def shadow_target(target_dir: Path, out: Path) -> tuple[Path, str]:
    """(a directory SpecForge's TargetHead can read, the lm_head key to name)."""
    from safetensors import safe_open

    files = sorted(target_dir.glob("*.safetensors"))
    keys: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            keys.update({k: f.name for k in h.keys()})  # noqa: SIM118 (safe_open has keys(), no iteration)
    head = "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"  # tied embeddings
    if list(target_dir.glob("*.index.json")):
        return target_dir, head
    out.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keys}))
    return out, head


def same_eval(report: Path, cfg) -> bool:
    """An earlier report of this very eval (every EvalConfig setting equal): it is reused."""
    import dataclasses

    if not report.is_file():
        return False
    done = json.loads(report.read_text()).get("settings", {})
    want = {f.name: str(v) if isinstance(v := getattr(cfg, f.name), Path) else v for f in dataclasses.fields(cfg)}
    if "drafter" in done:  # the same drafter reached through a link (a run reusing another root's drafter)
        done["drafter"] = str(Path(done["drafter"]).resolve())
        want["drafter"] = str(Path(want["drafter"]).resolve())
    return all(done.get(k, v) == v for k, v in want.items())


def specforge_env(args) -> dict | None:
    env = dict(os.environ)
    if args.specforge_path:
        env["PYTHONPATH"] = str(args.specforge_path) + os.pathsep + env.get("PYTHONPATH", "")
        sys.path.insert(0, str(args.specforge_path))
    if importlib.util.find_spec("specforge") is None:
        return None
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_logged(cmd: list[str], env: dict, log_path: Path) -> None:
    """Run `cmd`, its stdout and stderr streamed to our stderr (our stdout carries only the JSON line), each
    line after the seconds since the start (SpecForge's step lines carry no time), and appended as written to
    `log_path`; CalledProcessError when it fails."""
    log("    " + " ".join(cmd))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (
        open(log_path, "a") as fh,
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc,
    ):
        for line in proc.stdout:
            sys.stderr.write(f"[{time.perf_counter() - t0:7.1f}s] {line}")
            fh.write(line)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def specforge_cmd(args, *cli_args: str) -> list[str]:
    if args.device == "cpu":  # SpecForge's Triton loss kernel cannot run on the CPU: see specforge_cpu.py
        return [sys.executable, str(ROOT / "lab" / "scripts" / "specforge_cpu.py"), *cli_args]
    return [sys.executable, "-c", "import sys; from specforge.cli import main; sys.exit(main())", *cli_args]


def specforge_config(
    args, *, features: Path, vocab_mapping: Path, draft_config: Path, target: Path, head_key: str, out: Path
) -> dict:
    """SpecForge 0.2.0's `specforge train` config (config/schema.py: unknown keys are refused)."""
    cfg = {
        "run_id": SF_RUN_ID,
        "output_dir": str(out),
        "model": {
            "target_model_path": str(target),
            "draft_model_config": str(draft_config),
            "vocab_mapping_path": str(vocab_mapping),
            "lm_head_key": head_key,
            "embedding_key": "model.embed_tokens.weight",
            "torch_dtype": "bfloat16",
        },
        "data": {"hidden_states_path": str(features), "max_length": args.max_length, "cache_dir": str(out / "cache")},
        "training": {
            "max_steps": args.steps,
            "num_epochs": 1000,
            "batch_size": args.batch_size,
            "learning_rate": args.lr,
            "warmup_ratio": args.warmup_ratio,
            "max_grad_norm": 0.5,
            "ttt_length": args.ttt_steps,
            "save_interval": 200,
            "log_interval": max(1, min(20, args.steps)),
            "seed": args.seed,
        },
    }
    if args.device == "cpu":
        # FSDP needs an accelerator: NO_SHARD wraps in DDP instead (the same math in one process), and
        # FlexAttention (SpecForge's default) has no backward on the CPU: its SDPA backend instead
        cfg["training"].update(fsdp_sharding="NO_SHARD", attention_backend="sdpa")
    if any(out.glob(f"{SF_RUN_ID}-step*/training_state.pt")):
        cfg["training"]["resume_from"] = str(out)  # an earlier call's periodic checkpoint: its *-latest
    return cfg


def run_specforge(args, cfg: dict, out: Path, env: dict) -> float:
    """`specforge train` with `cfg` (written to out/specforge.yaml), its output in out/train.log; seconds."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    path = out / "specforge.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    run_logged(specforge_cmd(args, "train", "--config", str(path)), env, out / "train.log")
    return round(time.perf_counter() - t0, 1)


def specforge_last_log(log_path: Path) -> dict:
    """The metrics of SpecForge's last console log line (`step 20: {'loss': ..., 'acc': ...}`) in `log_path`."""
    last = {}
    for line in log_path.read_text().splitlines() if log_path.is_file() else []:
        head, sep, body = line.partition(": ")
        if sep and head.startswith("step ") and head[5:].isdigit():
            with contextlib.suppress(ValueError, SyntaxError):
                last = {"step": int(head[5:]), **ast.literal_eval(body)}
    return {k: last[k] for k in ("step", "loss", "acc", "grad_norm", "lr") if k in last}


VARIANT_FIELDS = frozenset(
    {
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "ttt_decay",
        "init_head",
        "model_dtype",
        "teacher_temperature",
        "align_topk",
        "feature_loss",
        "optimizer",
    }
)


def parse_variants(specs: list[str]) -> dict[str, dict]:
    """--eyas-variant NAME:KEY=VALUE[,KEY=VALUE] -> {NAME: {field: value}}; values as in `eyas pipeline --set`
    (TOML: numbers, booleans, quoted strings); keys: the TrainConfig settings of the training method
    (VARIANT_FIELDS), never the data, the budget (steps, samples per step) or the drafter's shape, which
    keep the comparison with the SpecForge drafter fair."""
    from eyas.pipeline import parse_value

    fields = VARIANT_FIELDS
    out: dict[str, dict] = {}
    for spec in specs:
        name, sep, body = spec.partition(":")
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum() or name in out:
            raise SystemExit(
                f"--eyas-variant {spec!r}: expected a new NAME (letters, digits, - and _), a colon, then "
                "KEY=VALUE pairs separated by commas"
            )
        sets = {}
        for pair in body.split(","):
            key, eq, value = pair.partition("=")
            key = key.strip()
            if eq and "." in key:  # a kernel of eyas.kernels forced on or off
                value = parse_value(value.strip())
                if not isinstance(value, bool):
                    raise SystemExit(f"--eyas-variant {spec!r}: {key} takes true or false")
                module_flag(key)
                sets[key] = value
                continue
            if not eq or key not in fields:
                raise SystemExit(
                    f"--eyas-variant {spec!r}: {key!r} is not a TrainConfig setting a variant may "
                    f"change ({', '.join(sorted(fields))}) nor a kernels.NAME setting"
                )
            sets[key] = parse_value(value.strip())
        out[name] = sets
    return out


def module_flag(name: str) -> str:
    """The kernel of eyas.kernels that kernels.NAME names."""
    from eyas import kernels

    prefix, _, kernel = name.partition(".")
    if prefix != "kernels" or kernel not in kernels.names():
        raise SystemExit(
            f"{name!r}: expected kernels.NAME, NAME one of {', '.join(kernels.names())} (eyas has no "
            "module settings: lab/LOG.md)"
        )
    return kernel


def module_flags(sets: dict):
    """A context in which the variant's kernels.NAME settings hold (EYAS_KERNELS)."""
    from eyas import kernels

    forced = [f"{module_flag(k)}:{'on' if v else 'off'}" for k, v in sets.items() if "." in k]
    if not forced:
        return contextlib.nullcontext()
    value = ",".join(filter(None, [os.environ.get(kernels.ENV, ""), *forced]))
    return mock.patch.dict(os.environ, {kernels.ENV: value})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--prepared", type=Path, required=True, help="prepared dataset (`eyas prepare` / a pipeline's prepared/)"
    )
    ap.add_argument("--target", default="default")
    ap.add_argument("--root", type=Path, default=Path("runs/sbs"))
    ap.add_argument("--samples", type=int, default=3000, help="train-split conversations captured and used by both")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step, both trainers")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.02, help="SpecForge warmup (eyas: 2%% of steps)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--eval-prompts", default="mtbench", help="eval prompts: mtbench (the embedded copy) or a question.jsonl"
    )
    ap.add_argument("--eval-limit", type=int, default=None, help="MT-bench questions (default all 80)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-chain-k", type=int, default=7, help="eval chain: draft tokens per round")
    ap.add_argument("--eval-tree-topk", type=int, default=10, help="eval tree: children per node (<= --draft-vocab)")
    ap.add_argument("--eval-tree-depth", type=int, default=6, help="eval tree: draft steps per round")
    ap.add_argument("--eval-tree-tokens", type=int, default=60, help="eval tree: draft tokens per round")
    ap.add_argument("--specforge-path", type=Path, default=None, help="directory holding an unpacked specforge package")
    ap.add_argument(
        "--eyas-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also train and evaluate an eyas drafter with these TrainConfig settings changed (same data, "
        "steps and samples per step), compared with the same SpecForge drafter: a method ablation "
        "against one SpecForge run, e.g. decay1:ttt_decay=1.0 (repeatable)",
    )
    args = ap.parse_args()
    variants = parse_variants(args.eyas_variant)

    from specforge_convert import convert

    from eyas.capture.run import CaptureSettings, run_capture
    from eyas.defaults import resolve_target
    from eyas.export.formats import export_drafter
    from eyas.specdec.run import EvalConfig, evaluate_to
    from eyas.train.loop import TrainConfig, run as train

    root = args.root
    root.mkdir(parents=True, exist_ok=True)
    store, eyas_run, features = root / "store", root / "eyas-train", root / "specforge-features"
    seconds: dict[str, float] = {}
    result: dict = {
        "benchmark": "specforge_side_by_side",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    # -- 1. capture ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    cap = run_capture(
        CaptureSettings(
            target=args.target,
            data=args.prepared,
            split="train",
            out=store,
            device=args.device,
            store_dtype="bf16",
            limit=args.samples,
        )
    )
    seconds["capture"] = round(time.perf_counter() - t0, 1)
    result["data"] = {"samples": cap.get("samples"), "tokens": cap.get("tokens")}

    # -- 2. eyas, offline ------------------------------------------------------------------------
    drafter = eyas_run / "drafter"
    base_train = dict(
        target=args.target,
        store=store,
        eval_store=store,
        eval_samples=16,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        draft_vocab=args.draft_vocab,
        max_length=args.max_length,
        save_every=200,
        resume="auto",
        device=args.device,
        seed=args.seed,
    )
    if step("eyas train", (drafter / "config.json").is_file()):
        t0 = time.perf_counter()
        s = train(TrainConfig(**base_train, out=eyas_run))
        seconds["eyas_train"] = round(time.perf_counter() - t0, 1)
        result["eyas_train"] = {"tokens_per_s": s.get("tokens_per_s"), "final_loss": s.get("final_loss")}
    eyas_sglang = root / "eyas-sglang"
    if step("eyas export", (eyas_sglang / "config.json").is_file()):
        export_drafter(drafter, "sglang", eyas_sglang, overwrite=False)
    # -- 3. convert --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    man = convert(store, features, max_length=args.max_length, drafter=drafter)
    seconds["convert"] = round(time.perf_counter() - t0, 1)
    result["data"]["specforge_files"] = man["samples"]

    # -- 4. SpecForge --------------------------------------------------------------------------------
    sf_run, sf_sglang = root / "specforge-run", root / "specforge-sglang"
    env = specforge_env(args)
    if env is None:
        log(
            "specforge is not importable (pip install --no-deps specforge==0.2.0 pydantic pyyaml, or --specforge-path): "
            "SpecForge side skipped"
        )
        result["specforge_error"] = "specforge not installed"
    else:
        draft_config = root / "specforge-draft-config.json"
        sf_final = sf_run / f"{SF_RUN_ID}-step{args.steps}"  # SpecForge's checkpoint after the last step
        try:
            if step("specforge train", (sf_final / "training_state.pt").is_file()):
                draft_config.write_text(json.dumps(json.loads((eyas_sglang / "config.json").read_text()), indent=1))
                target_dir, head_key = shadow_target(Path(resolve_target(args.target)), root / "specforge-target")
                sf_cfg = specforge_config(
                    args,
                    features=features,
                    vocab_mapping=features / "vocab_mapping.pt",
                    draft_config=draft_config,
                    target=target_dir,
                    head_key=head_key,
                    out=sf_run,
                )
                seconds["specforge_train"] = run_specforge(args, sf_cfg, sf_run, env)
            result["specforge_train"] = specforge_last_log(sf_run / "train.log")
            if step("specforge export", (sf_sglang / "config.json").is_file()):
                run_logged(
                    specforge_cmd(
                        args,
                        "export",
                        "--to",
                        "sglang",
                        "--checkpoint",
                        str(sf_final),
                        "--draft-config",
                        str(draft_config),
                        "--output-dir",
                        str(sf_sglang),
                        "--vocab-mapping",
                        str(features / "vocab_mapping.pt"),
                    ),
                    env,
                    sf_run / "export.log",
                )
        except subprocess.CalledProcessError as exc:
            log(f"SpecForge failed ({exc}); the eyas side is still evaluated")
            result["specforge_error"] = str(exc)

    # -- 5. eval, same settings: eyas and SpecForge first, then each variant right after its training (a
    # session cut short keeps the ratios it reached) ---------------------------------------------------
    evals, eval_settings = {}, {}

    def evaluate(name: str, d: Path) -> None:
        out = root / f"eval-{name}"
        ecfg = EvalConfig(
            drafter=d,
            target=args.target,
            prompts=args.eval_prompts,
            limit=args.eval_limit,
            max_new_tokens=args.eval_max_new_tokens,
            chain_k=args.eval_chain_k,
            tree_topk=args.eval_tree_topk,
            tree_depth=args.eval_tree_depth,
            tree_tokens=args.eval_tree_tokens,
            device=args.device,
        )
        if step(f"eval {name}", same_eval(out / "report.json", ecfg)):
            t0 = time.perf_counter()
            evaluate_to(out, ecfg, overwrite=True)
            seconds[f"eval_{name}"] = round(time.perf_counter() - t0, 1)
        rep = json.loads((out / "report.json").read_text())
        evals[name] = {
            f"tau_{m}": round(v["acceptance_length"], 4) if v["acceptance_length"] is not None else None
            for m, v in rep["modes"].items()
        }
        eval_settings[name] = {k: v for k, v in rep["settings"].items() if k != "drafter"}
        log(f"eval {name}: " + ", ".join(f"{k} {v}" for k, v in evals[name].items()))

    for name, d in (("eyas", eyas_sglang), ("specforge", sf_sglang)):
        if (d / "config.json").is_file():
            evaluate(name, d)
    for name, sets in variants.items():  # method ablations: the same run with these settings changed
        run_dir, out = root / f"eyas-{name}-train", root / f"eyas-{name}-sglang"
        if step(f"eyas train, variant {name} {sets}", (run_dir / "drafter" / "config.json").is_file()):
            t0 = time.perf_counter()
            with module_flags(sets):
                s = train(
                    TrainConfig(**{**base_train, **{k: v for k, v in sets.items() if "." not in k}, "out": run_dir})
                )
            seconds[f"eyas_{name}_train"] = round(time.perf_counter() - t0, 1)
            result.setdefault("variants", {})[name] = {"settings": sets, "tokens_per_s": s.get("tokens_per_s")}
        if not (out / "config.json").is_file():
            export_drafter(run_dir / "drafter", "sglang", out, overwrite=False)
        evaluate(f"eyas-{name}", out)
    result["eval"] = evals
    if eval_settings:
        result["eval_settings"] = next(iter(eval_settings.values()))
        if any(v != result["eval_settings"] for v in eval_settings.values()):
            raise SystemExit(f"the evals' settings differ: {eval_settings}")
    if "eyas" in evals and "specforge" in evals:
        for m in ("tau_chain", "tau_tree"):
            a, b = evals["eyas"].get(m), evals["specforge"].get(m)
            result[f"{m}_vs_specforge"] = round(a / b, 4) if a and b else None
            for name in variants:
                a = evals.get(f"eyas-{name}", {}).get(m)
                result.setdefault("variants", {}).setdefault(name, {"settings": variants[name]})[
                    f"{m}_vs_specforge"
                ] = round(a / b, 4) if a and b else None
    result["seconds"] = seconds
    log("\n| drafter | tau chain | tau tree |\n|---|---|---|")
    for name, e in evals.items():
        log(f"| {name} | {e.get('tau_chain')} | {e.get('tau_tree')} |")
    if "tau_chain_vs_specforge" in result:
        log(f"| eyas / SpecForge | {result['tau_chain_vs_specforge']} | {result['tau_tree_vs_specforge']} |")
        for name, v in result.get("variants", {}).items():
            log(f"| eyas-{name} / SpecForge | {v.get('tau_chain_vs_specforge')} | {v.get('tau_tree_vs_specforge')} |")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
