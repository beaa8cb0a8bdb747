"""Data and compute scaling of the drafter: MT-bench tau (chain and tree) against the number of
regenerated conversations and the tokens seen in training, each point one `eyas pipeline` run.

Grid: --conversations (source records regenerated, e.g. 2000,6000,17671 = the whole embedded ShareGPT)
x --steps (optimizer steps, the same batch for every point, so a steps value is a fixed compute budget
whatever the data size). Every point has its own workdir (<root>/n<N>-s<S>) and reads the ONE shared
regeneration <root>/regen: points run in order of conversations, so the regeneration grows
incrementally (an `eyas regenerate` output resumes; each pipeline reads only its own first N records).

Split into short runs: --max-minutes bounds one invocation. A point still running at the deadline is
stopped with SIGTERM (regeneration commits what it finished; training resumes from its last checkpoint,
every `save_every` steps) and the next invocation continues where this one stopped; finished points
(<root>/points.jsonl) are not touched again. After a point finishes, its older training checkpoints are
deleted (eyas wrote them; the latest one and the drafter stay).

Outputs, rewritten after every point: <root>/points.jsonl (one JSON line per point, also printed on
stdout), <root>/scaling.md (table + the fitted trend: tau gained per doubling of conversations at each
budget), <root>/scaling.png (tau against conversations and against tokens seen). The last stdout line
is one JSON document: points done, points left, trend.

GPU, one H200, in runs of at most 8 minutes each (repeat the same command until `"done": true`):

    PYTHONPATH=src python benchmarks/scaling_study.py --recipe recipes/smollm2-gpu.toml \
        --root runs/scaling --conversations 2000,6000,17671 --steps 600,1800 --max-minutes 8

Any recipe option can be changed for every point with --set section.key=value (as `eyas pipeline`).
CPU check (tiny): --recipe recipes/smollm2-cpu-smoke.toml --conversations 4,8 --steps 2 --root /tmp/s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def point_dir(root: Path, n: int, steps: int) -> Path:
    return root / f"n{n}-s{steps}"


def run_point(args, n: int, steps: int, deadline: float) -> dict | None:
    """One pipeline run; None when stopped at the deadline (it resumes next time)."""
    work = point_dir(args.root, n, steps)
    cmd = [sys.executable, "-m", "eyas", "pipeline", str(args.recipe), "--workdir", str(work),
           "--set", f"regenerate.out={json.dumps(str(args.root / 'regen'))}", "--set", f"regenerate.limit={n}",
           "--set", f"train.steps={steps}"]
    for item in args.set or []:
        cmd += ["--set", item]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log(f"\n=== scaling point: {n} conversations, {steps} steps -> {work}\n    {' '.join(cmd)}")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        log(f"=== time budget reached: stopping this point (it resumes on the next run)")
        os.killpg(proc.pid, signal.SIGTERM)  # our own child's process group: regenerate commits on SIGTERM
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        return None
    if proc.returncode != 0:
        raise SystemExit(f"point n={n} steps={steps} failed (exit {proc.returncode}); see the log above")
    summary = json.loads(out.strip().splitlines()[-1])
    return point_record(work, n, steps, summary, wall_s=time.time() - t0)


def tokens_seen(metrics: Path) -> tuple[int, int]:
    """(tokens, supervised-steps) over the training run, one value per step (a resumed run re-logs steps)."""
    per_step: dict[int, int] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if not rec.get("eval") and "step" in rec:
            per_step[int(rec["step"])] = int(rec.get("tokens", 0))
    return sum(per_step.values()), len(per_step)


def point_record(work: Path, n: int, steps: int, summary: dict, *, wall_s: float) -> dict:
    st = summary["stages"]
    tokens, logged = tokens_seen(work / "train" / "metrics.jsonl")
    acc = st["train"].get("heldout_acc_per_step") or [None]
    return {
        "conversations": n, "steps": steps, "tokens_seen": tokens, "steps_logged": logged,
        "regenerated": st.get("regenerate", {}).get("selected"),
        "answer_tokens": st.get("regenerate", {}).get("selected_answer_tokens"),
        "train_samples": st["prepare"].get("train_samples"), "train_tokens_per_epoch": st["prepare"].get("tokens"),
        "tau_chain": summary.get("tau_chain"), "tau_tree": summary.get("tau_tree"),
        "heldout_top1_step0": acc[0], "train_tokens_per_s": st["train"].get("tokens_per_s"),
        "stage_seconds": {k: v.get("seconds") for k, v in st.items()}, "wall_s": round(wall_s, 1),
        "workdir": str(work),
    }


def prune_checkpoints(work: Path) -> None:
    cks = sorted((work / "train" / "checkpoints").glob("step-*.safetensors"))
    for p in cks[:-1]:
        p.unlink()


def trend(points: list[dict]) -> dict:
    """Least-squares slope of tau against log2(conversations), per steps budget: tau per doubling."""
    out = {}
    for steps in sorted({p["steps"] for p in points}):
        pts = [p for p in points if p["steps"] == steps]
        if len({p["conversations"] for p in pts}) < 2:
            continue
        for mode in ("tau_chain", "tau_tree"):
            xs = [math.log2(p["conversations"]) for p in pts if p[mode] is not None]
            ys = [p[mode] for p in pts if p[mode] is not None]
            if len(xs) < 2:
                continue
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            den = sum((x - mx) ** 2 for x in xs)
            out[f"{mode}_per_doubling_s{steps}"] = round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den, 4) if den else None
    return out


def write_outputs(root: Path, points: list[dict], tr: dict) -> None:
    points = sorted(points, key=lambda p: (p["conversations"], p["steps"]))
    lines = ["| conversations | steps | tokens seen | train samples | held-out top-1 | tau chain | tau tree |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        top1 = f"{p['heldout_top1_step0']:.3f}" if p["heldout_top1_step0"] is not None else "-"
        lines.append(f"| {p['conversations']:,} | {p['steps']:,} | {p['tokens_seen'] / 1e6:.1f}M | {p['train_samples']:,} | "
                     f"{top1} | {p['tau_chain']} | {p['tau_tree']} |")
    lines += ["", "Trend (least squares, tau per doubling of conversations at a fixed step budget): "
              + (", ".join(f"{k} = {v}" for k, v in tr.items()) or "needs two sizes at one budget")]
    (root / "scaling.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log(f"no plot ({exc})")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for steps in sorted({p["steps"] for p in points}):
        pts = [p for p in points if p["steps"] == steps]
        for mode, style in (("tau_tree", "o-"), ("tau_chain", "s--")):
            axes[0].plot([p["conversations"] for p in pts], [p[mode] for p in pts], style, label=f"{mode[4:]}, {steps} steps")
    for n in sorted({p["conversations"] for p in points}):
        pts = sorted((p for p in points if p["conversations"] == n), key=lambda p: p["tokens_seen"])
        for mode, style in (("tau_tree", "o-"), ("tau_chain", "s--")):
            axes[1].plot([p["tokens_seen"] for p in pts], [p[mode] for p in pts], style, label=f"{mode[4:]}, {n:,} conv.")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("regenerated conversations")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("tokens seen in training")
    for ax in axes:
        ax.set_ylabel("MT-bench tau (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "scaling.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "smollm2-gpu.toml")
    ap.add_argument("--root", type=Path, default=Path("runs/scaling"))
    ap.add_argument("--conversations", default="2000,6000,17671", help="comma-separated source records to regenerate")
    ap.add_argument("--steps", default="600,1800", help="comma-separated optimizer-step budgets")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="stop (resumably) after this long")
    ap.add_argument("--set", action="append", help="section.key=value passed to every point's pipeline")
    args = ap.parse_args()
    for item in args.set or []:
        if item.split("=", 1)[0].strip() in ("regenerate.limit", "regenerate.out", "train.steps", "workdir"):
            ap.error(f"--set {item}: the study sets this per point (use --conversations / --steps / --root)")
    args.root.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.max_minutes
    grid = [(n, s) for n in sorted(int(x) for x in args.conversations.split(","))
            for s in sorted(int(x) for x in args.steps.split(","))]
    done_file = args.root / "points.jsonl"
    done = [json.loads(line) for line in done_file.read_text().splitlines()] if done_file.exists() else []
    finished = {(p["conversations"], p["steps"]) for p in done}
    stopped = False
    for n, s in grid:
        if (n, s) in finished:
            continue
        if deadline - time.time() < 30:
            stopped = True
            break
        rec = run_point(args, n, s, deadline)
        if rec is None:
            stopped = True
            break
        prune_checkpoints(point_dir(args.root, n, s))
        done.append(rec)
        with open(done_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({"point": rec}), flush=True)
        write_outputs(args.root, done, trend(done))
    tr = trend(done)
    if done:
        write_outputs(args.root, done, tr)
    left = [{"conversations": n, "steps": s} for n, s in grid if (n, s) not in {(p["conversations"], p["steps"]) for p in done}]
    print(json.dumps({"benchmark": "scaling_study", "done": not left, "stopped_at_deadline": stopped,
                      "points_done": len(done), "points_left": left, "trend": tr, "root": str(args.root),
                      "table": str(args.root / "scaling.md"), "plot": str(args.root / "scaling.png")}), flush=True)


if __name__ == "__main__":
    main()
