"""`eyas demo`: the whole pipeline on the embedded default, on CPU, in a few minutes.

    prepare (ShareGPT, a few hundred chats) -> capture (SmolLM2 hidden states, bf16 store)
    -> verify (coverage + numbers against the unbatched reference) -> train (EAGLE-3 drafter,
    training-time test, offline from the store) -> eval (MT-bench greedy acceptance, chain and tree)
    -> export (SGLang and vLLM layouts)

Every stage is the library call its subcommand makes, so the demo exercises exactly what users run.
A rerun resumes: a finished prepared dataset is reused, the capture resumes its store, training
resumes from its last checkpoint, eval and export are redone. --overwrite starts from scratch.
The drafter is small-data and short-trained: its acceptance shows the pipeline works end to end,
not what a full run reaches (see docs/performance.md for that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.common import claim_output_dir, log, remove_owned_dir
from eyas.errors import CheckFailed, EyasError


@dataclass(kw_only=True)
class DemoConfig:
    out: Path = Path("runs/demo")
    """Directory for every stage's output; a rerun resumes."""
    chats: int = 200
    """ShareGPT records to prepare."""
    max_length: int = 384
    """Tokens per sample (short keeps the CPU run to minutes)."""
    train_steps: int = 60
    """Optimizer steps of the drafter."""
    draft_vocab: int = 8192
    """Draft vocabulary size (small: the lm_head dominates a CPU step; a few hundred chats use fewer
    distinct tokens than this)."""
    lr: float = 5e-4
    """Peak learning rate (a short run wants a higher one than a long run's 1e-4)."""
    ttt_steps: int = 7
    """Training-time-test steps."""
    eval_questions: int = 4
    """MT-bench questions evaluated (2 turns each)."""
    max_new_tokens: int = 48
    """Greedy tokens per turn in the evaluation."""
    device: str = "cpu"
    """cpu or cuda."""
    overwrite: bool = False
    """Start over: delete what an earlier demo wrote in --out (other files there are kept)."""

    def __post_init__(self):
        for name in (
            "chats",
            "max_length",
            "train_steps",
            "eval_questions",
            "max_new_tokens",
            "ttt_steps",
            "draft_vocab",
        ):
            if getattr(self, name) < 1:
                raise EyasError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        from eyas.common import check_out_path, require_owned
        from eyas.config_checks import check_device, check_number

        check_number(self, "lr", gt=0)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EyasError(f"--device must be cpu or cuda, got {self.device!r}")
        check_device(self.device)
        check_out_path(self.out)
        require_owned(self.out, option="--overwrite" if self.overwrite else "--out", kind="demo")


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    from eyas.capture.run import CaptureSettings, run_capture
    from eyas.data.prepare import PrepareConfig, prepare
    from eyas.export.formats import export_drafter
    from eyas.specdec.run import EvalConfig, evaluate_to
    from eyas.store.verify import verify_store
    from eyas.train.loop import TrainConfig, check_options_fit_target, run as train

    check_options_fit_target("default", draft_vocab=cfg.draft_vocab)  # before any stage runs or anything is removed
    out = Path(cfg.out)
    if cfg.overwrite:
        remove_owned_dir(out, kind="demo")  # only what eyas's demo wrote there; anything else is refused or kept
    claim_output_dir(out, kind="demo")
    times: dict[str, float] = {}
    results: dict[str, Any] = {}

    def stage(name: str, fn):
        log(f"\n== eyas demo: {name} ==")
        t0 = time.perf_counter()
        results[name] = fn()
        times[name] = round(time.perf_counter() - t0, 1)

    prepared = out / "prepared"
    if (prepared / "meta.json").is_file():
        import json

        stage("prepare", lambda: json.loads((prepared / "meta.json").read_text())["summary"])
    else:
        stage(
            "prepare",
            lambda: prepare(
                PrepareConfig(
                    source="sharegpt",
                    target="default",
                    out=prepared,
                    limit=cfg.chats,
                    max_length=cfg.max_length,
                    eval_fraction=0.05,
                )
            ),
        )
    store = out / "store"
    stage(
        "capture",
        lambda: run_capture(
            CaptureSettings(
                target="default", data=prepared, split="train", out=store, device=cfg.device, store_dtype="bf16"
            )
        ),
    )

    def verify():
        try:
            return verify_store(store, numbers=8, seed=0, tolerance=None, device=cfg.device, target=None, data=None)
        except CheckFailed as exc:  # the demo must not go on to train on states that failed
            raise EyasError(f"verification of {store} failed: {exc}") from None

    stage("verify", verify)
    stage(
        "train",
        lambda: train(
            TrainConfig(
                target="default",
                out=out / "train",
                store=store,
                steps=cfg.train_steps,
                lr=cfg.lr,
                ttt_steps=cfg.ttt_steps,
                draft_vocab=cfg.draft_vocab,
                max_length=cfg.max_length,
                eval_every=max(cfg.train_steps // 4, 1),
                eval_samples=16,
                save_every=max(cfg.train_steps // 4, 1),
                resume="auto",
                device=cfg.device,
                seed=0,
            )
        ),
    )
    drafter = out / "train" / "drafter"
    stage(
        "eval",
        lambda: evaluate_to(
            out / "eval",
            EvalConfig(
                drafter=drafter,
                target="default",
                prompts="mtbench",
                max_new_tokens=cfg.max_new_tokens,
                limit=cfg.eval_questions,
                device=cfg.device,
            ),
            overwrite=True,
        ),
    )
    # the serving copies in bf16, the dtype the engines run a drafter in: the fp32 weights stay in one place,
    # train/drafter (what eval read and `eyas export` reads again)
    stage(
        "export",
        lambda: {
            fmt: export_drafter(drafter, fmt, out / "export" / fmt, overwrite=True, dtype="bfloat16")
            for fmt in ("sglang", "vllm")
        },
    )
    summary = _summarise(results, times, out)
    _print_table(summary)
    from eyas.defaults import resolve_target

    log("\n" + "\n".join(next_steps(summary, target=resolve_target("default"))))
    return summary


def next_steps(s: dict[str, Any], *, target: Path) -> list[str]:
    """What a user does after the demo: where its drafter is, what its tau says, and the commands that
    evaluate, export and serve it (the paths the demo wrote; `target` the converted default target)."""
    out, e = Path(s["out"]), s["eval"]
    drafter, sglang, vllm = s["drafter"], s["export"]["sglang"], s["export"]["vllm"]
    return [
        "== eyas demo: what next ==",
        f"Drafter: {drafter} (fp32, eyas layout); serving copies (bf16): {sglang}, {vllm}",
        f"tau (tree {e.get('tau_tree')}, chain {e.get('tau_chain')}; 1.0 = no draft token accepted) is what a short",
        f"CPU run on {s['data']['train_samples']} chats gives: it shows the pipeline works, not a useful drafter;",
        "`eyas pipeline recipes/smollm2-gpu.toml` trains one on a GPU (recipes/README.md).",
        "Evaluate on more questions (CPU-sized; eval's defaults are sized for a GPU):",
        f"  eyas eval --drafter {drafter} --limit 8 --max-new-tokens 64 --out {out / 'eval-more'}",
        "Export (the demo did; for a drafter of your own):",
        f"  eyas export --drafter {drafter} --format sglang --weights-dtype bfloat16 --out {out / 'export-mine'}",
        "Serve (docs/serving.md):",
        f"  python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {sglang} \\",
        "    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
        f"  vllm serve {target} --speculative-config \\",
        f'    \'{{"method": "eagle3", "model": "{vllm}", "num_speculative_tokens": 3}}\'',
        f"Disk: `du -sh {out}`; the checkpoints in {out / 'train' / 'checkpoints'} only serve a resume.",
    ]


def _summarise(results: dict[str, Any], times: dict[str, float], out: Path) -> dict[str, Any]:
    p, c, v, t, e = (results[k] for k in ("prepare", "capture", "verify", "train", "eval"))
    return {
        "stage": "demo",
        "out": str(out),
        "seconds": times,
        "data": {
            k: p.get(k)
            for k in ("samples_kept", "train_samples", "eval_samples", "tokens", "assistant_tokens", "skipped")
        },
        "capture": c,
        "verify": v,
        "train": t,
        "eval": e,
        "export": {fmt: r.get("out") for fmt, r in results["export"].items()},
        "drafter": str(out / "train" / "drafter"),
    }


def _print_table(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    e = s["eval"]
    table = Table(title="eyas demo: the pipeline on the embedded default")
    table.add_column("stage")
    table.add_column("result")
    table.add_column("seconds", justify="right")
    d = s["data"]
    table.add_row(
        "prepare",
        f"{d['samples_kept']} chats ({d['train_samples']} train / {d['eval_samples']} eval), "
        f"{d['tokens']:,} tokens, {d['assistant_tokens']:,} supervised",
        str(s["seconds"]["prepare"]),
    )
    c = s["capture"]
    table.add_row(
        "capture",
        f"{c.get('samples')} samples, {c.get('tokens')} tokens, {c.get('dtype')} -> {c.get('store')}",
        str(s["seconds"]["capture"]),
    )
    v = s["verify"]
    worst = (v.get("numbers") or {}).get("worst_rel_err")
    table.add_row(
        "verify",
        f"ok={v.get('ok')}: {v.get('samples')} samples covered, {(v.get('numbers') or {}).get('checked', 0)} "
        f"recomputed, worst rel. error {worst:.2g}"
        if worst is not None
        else f"ok={v.get('ok')}",
        str(s["seconds"]["verify"]),
    )
    t = s["train"]
    loss, rate = t.get("final_loss"), t.get("tokens_per_s")
    table.add_row(
        "train",
        f"{t.get('steps')} steps"
        + (f", final loss {loss:.3f}" if loss is not None else "")
        + (f", {rate:.0f} tokens/s" if rate else "")
        + f", held-out tau {(t.get('eval') or {}).get('acceptance_length', float('nan')):.2f}",
        str(s["seconds"]["train"]),
    )
    table.add_row(
        "eval",
        f"MT-bench {e.get('sequences')} turns: tau chain {e.get('tau_chain')}, tau tree {e.get('tau_tree')}",
        str(s["seconds"]["eval"]),
    )
    table.add_row("export", ", ".join(f"{k}: {p}" for k, p in s["export"].items()), str(s["seconds"]["export"]))
    Console(stderr=True).print(table)
