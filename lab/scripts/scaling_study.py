"""Data and compute scaling of the drafter: MT-bench tau (chain and tree) against the number of
regenerated conversations and the tokens seen in training, each point one `eyas pipeline` run.

Grid: --conversations (source records regenerated, e.g. 2000,6000,17671 = the whole embedded ShareGPT)
x --steps (optimizer steps, the same batch for every point, so a steps value is a fixed compute budget
whatever the data size). Every point has its own workdir (<root>/n<N>-s<S>) and reads the ONE shared
regeneration <root>/regen (each pipeline reads only its own first N records).

One process (default): points run one after another in order of conversations, so the shared
regeneration grows incrementally (an `eyas regenerate` output resumes). Several GPUs (--gpus 0,1):
phase 1 regenerates the largest N once (`eyas pipeline ... --until regenerate`, pinned to the first
GPU) so the shared regeneration covers every point; phase 2 then runs up to one point per GPU at once,
each child pinned with CUDA_VISIBLE_DEVICES=<gpu>. A pipeline whose shared regeneration already covers
its N only reads it (eyas/pipeline.py), so concurrent points never write there. Trade-off: no point
starts before the whole regeneration is done (one GPU regenerates while the others wait), in exchange
for training and evaluating one point per GPU at once. --regen-only runs phase 1 alone.

Split into short runs: --max-minutes bounds one invocation. Points still running at the deadline are
stopped with SIGTERM (regeneration commits what it finished; training resumes from its last checkpoint,
every `save_every` steps) and the next invocation continues where this one stopped; finished points
(<root>/points.jsonl) are not touched again. A failed point is reported (the tail of its log) while the
others go on; the next invocation retries it. After a point finishes, its older training checkpoints
are deleted (eyas wrote them; the latest one and the drafter stay).

Points measured in another root or session: --add-points FILE (JSON lines in the format of points.jsonl; repeatable)
counts them as done and puts them in the table, trend and plot beside this root's, which win where both have a
point. lab/scripts/scaling_points.jsonl keeps the points measured in earlier GPU sessions (each with its settings).
Each point record carries its held-out tau curve (`heldout_tau`: [step, tokens seen, tau] at every eval), the plot's
third panel.

Logs: each child's stderr goes whole to <workdir>/pipeline.log and, prefixed with its name
(`[n2000-s600] ...`), to this script's stderr; progress-bar redraws are echoed at most every 30 s.

Outputs, written by this process alone after every point: <root>/points.jsonl (one JSON line per
point, also printed on stdout), <root>/scaling.md (table + the fitted trend: tau gained per doubling
of conversations at each budget), <root>/scaling.png (MT-bench tau against conversations and against tokens
seen; held-out tau along each run). The last stdout line is one JSON document: points done, points left, failed
points, trend.
Exit 1 when a point (or the regeneration) failed.

GPU, two H200, in calls of at most 10 minutes (repeat the same command until `"done": true`):

    PYTHONPATH=src python lab/scripts/scaling_study.py --recipe recipes/smollm2-gpu.toml \
        --root runs/scaling --conversations 2000,6000,17671 --steps 600,1800 --gpus 0,1 --max-minutes 8

(--max-minutes 8: at the deadline the children get up to 60 s to commit, so one call stays under
10 minutes.) One H200: the same without --gpus. Regenerate only (e.g. while the GPUs train something else): add
--regen-only; it prints where the regenerated chats are.

Any recipe option can be changed for every point with --set section.key=value (as `eyas pipeline`).
CPU check (tiny): --recipe recipes/smollm2-cpu-smoke.toml --conversations 4,8 --steps 2 --root /tmp/s
(add --gpus 0,1 for the concurrent path: CUDA_VISIBLE_DEVICES is harmless on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[2]
REGEN_WORKDIR = "regen-pipeline"  # phase 1's own pipeline workdir under <root>
START_MARGIN_S = 30.0  # no child is started this close to the deadline
GRACE_S = 60.0  # after SIGTERM, how long a child may take to commit before SIGKILL
PROGRESS_ECHO_S = 30.0  # a child's progress-bar redraws are echoed at most this often


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def point_dir(root: Path, n: int, steps: int) -> Path:
    return root / f"n{n}-s{steps}"


# -- one child process ------------------------------------------------------------------------------


class Child:
    """One `eyas pipeline` subprocess in its own process group: stdout kept (its last line is the
    summary), stderr appended whole to `log_path` and echoed line by line with a `[name]` prefix."""

    def __init__(self, name: str, cmd: list[str], *, log_path: Path, gpu: str | None, side_by_side: int = 1):
        self.name, self.log_path = name, log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
            # Side by side, each child gets its share of the cores. Two trainings started with a
            # full-size OpenMP pool each ran 2.7x slower per step than one alone on a 32-core
            # 2-GPU host (0.90 s vs 0.33 s, 2026-11-30), while two torchrun ranks (which set
            # OMP_NUM_THREADS=1) scaled 2.0x on the same host: oversubscribed cores, we conclude.
            if "OMP_NUM_THREADS" not in os.environ:
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
                env["OMP_NUM_THREADS"] = str(max(1, cores // side_by_side))
        pin = f"CUDA_VISIBLE_DEVICES={gpu} " if gpu is not None else ""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 (the child's log, open while it runs)
        self._log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {pin}{' '.join(cmd)}\n".encode())
        log(f"[{name}] start: {pin}{' '.join(cmd)}\n[{name}] log: {log_path}")
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
        )
        self._stdout: list[bytes] = []
        self._tail: deque[str] = deque(maxlen=40)
        self._threads = [
            threading.Thread(target=self._pump_stderr, daemon=True),
            threading.Thread(target=lambda: self._stdout.append(self.proc.stdout.read()), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _echo(self, text: str) -> None:
        self._tail.append(text)
        print(f"[{self.name}] {text}", file=sys.stderr, flush=True)

    def _pump_stderr(self) -> None:
        buf, last_progress = b"", 0.0
        while chunk := self.proc.stderr.read1(65536):
            self._log.write(chunk)
            self._log.flush()
            parts = re.split(rb"(\r\n|\n|\r)", buf + chunk)
            buf = parts.pop()  # an unfinished line waits for its end
            for seg, sep in zip(parts[0::2], parts[1::2]):
                text = seg.decode("utf-8", "replace").rstrip()
                if not text:
                    continue
                if sep == b"\r":  # a progress-bar redraw: echo some, or two children flood the terminal
                    if time.time() - last_progress < PROGRESS_ECHO_S:
                        continue
                    last_progress = time.time()
                self._echo(text)
        if buf.strip():
            self._echo(buf.decode("utf-8", "replace").rstrip())

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            for t in self._threads:
                t.join()
            if not self._log.closed:
                self._log.close()
        return rc

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own child's group: regenerate commits on SIGTERM

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def summary(self) -> dict[str, Any] | None:
        lines = b"".join(self._stdout).decode("utf-8", "replace").strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else None
        except ValueError:
            return None

    def tail(self, n: int = 15) -> str:
        return "\n".join(f"[{self.name}]   {line}" for line in list(self._tail)[-n:])


# -- the scheduler (no models here: tests plug in fake children) -------------------------------------


class Running(Protocol):
    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


@dataclass
class Outcome:
    stopped: bool = False  # the deadline stopped some child, or kept one from starting
    failed: int = 0


def schedule(
    items: list[Any],
    slots: list[str | None],
    launch: Callable[[Any, str | None], Running],
    on_exit: Callable[[Any, Running, int], bool],
    *,
    deadline: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 2.0,
    start_margin_s: float = START_MARGIN_S,
    grace_s: float = GRACE_S,
) -> Outcome:
    """Run `items` in order, at most one per slot at a time (a slot: a GPU id, or None for no pinning).

    `launch(item, slot)` starts one; `on_exit(item, child, rc)` runs in this process for each child
    that exited by itself (or with rc 0 during its SIGTERM grace) and says whether it succeeded; a
    failure does not stop the others. At the deadline every running child gets SIGTERM, then `grace_s`
    to exit, then SIGKILL: those are neither done nor failed (they resume next time)."""
    pending = list(items)
    running: dict[int, tuple[Any, Running]] = {}  # slot index -> (item, child)
    out = Outcome()

    def reap(i: int, rc: int) -> None:
        item, child = running.pop(i)
        if not on_exit(item, child, rc):
            out.failed += 1

    while pending or running:
        for i, (_, child) in list(running.items()):
            rc = child.poll()
            if rc is not None:
                reap(i, rc)
        if running and clock() >= deadline:
            for _, child in running.values():
                child.terminate()
            end = clock() + grace_s
            while running and clock() < end:
                for i, (_, child) in list(running.items()):
                    rc = child.poll()
                    if rc == 0:
                        reap(i, rc)  # it finished before the signal landed: keep its result
                    elif rc is not None:
                        running.pop(i)
                if running:
                    sleep(min(poll_s, 1.0))
            for _, child in running.values():
                child.kill()
                while child.poll() is None:
                    sleep(0.1)
            running.clear()
            out.stopped = True
            break
        while pending and len(running) < len(slots) and deadline - clock() >= start_margin_s:
            free = next(i for i in range(len(slots)) if i not in running)
            item = pending.pop(0)
            running[free] = (item, launch(item, slots[free]))
        if pending and not running:  # too close to the deadline to start anything
            out.stopped = True
            break
        if running:
            sleep(poll_s)
    return out


# -- the study ---------------------------------------------------------------------------------------


def pipeline_cmd(args, workdir: Path, n: int, extra: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "eyas",
        "pipeline",
        str(args.recipe),
        "--workdir",
        str(workdir),
        "--set",
        f"regenerate.out={json.dumps(str(args.root / 'regen'))}",
        "--set",
        f"regenerate.limit={n}",
        *extra,
    ]
    for item in args.set or []:
        cmd += ["--set", item]
    return cmd


def regen_phase(args, n_max: int, deadline: float) -> tuple[str, dict[str, Any] | None]:
    """Phase 1: the shared regeneration of the largest N, pinned to the first GPU.
    Returns ("done" | "stopped" (deadline; it resumes) | "failed", the pipeline's summary)."""
    work = args.root / REGEN_WORKDIR
    result: dict[str, Any] = {}

    def launch(_, gpu):
        return Child(
            f"regen-n{n_max}",
            pipeline_cmd(args, work, n_max, ["--until", "regenerate"]),
            log_path=work / "pipeline.log",
            gpu=gpu,
        )

    def on_exit(_, child: Child, rc: int) -> bool:
        summary = child.summary()
        if rc != 0 or summary is None:
            log(f"[{child.name}] FAILED (exit {rc}); the end of {child.log_path}:\n{child.tail()}")
            return False
        result.update(summary)
        return True

    outcome = schedule(["regen"], [args.gpus[0] if args.gpus else None], launch, on_exit, deadline=deadline)
    if outcome.stopped or outcome.failed:
        return ("failed" if outcome.failed else "stopped"), None
    r = result["stages"]["regenerate"]
    log(
        f"phase 1 done: {r.get('selected')} regenerated chats of the first {n_max} source records "
        f"({r.get('selected_answer_tokens')} answer tokens)\n"
        f"  shared regeneration (read by every point): {args.root / 'regen' / 'chats.jsonl'}\n"
        f"  the first {n_max} records' chats alone:    {work / 'regenerate' / 'chats.jsonl'}"
    )
    return "done", result


def train_log(metrics: Path) -> tuple[dict[int, int], dict[int, float]]:
    """(tokens of each step, held-out tau of each eval) of a training run's metrics.jsonl, by step: the last record of
    a step where a resumed run logged it twice."""
    tokens: dict[int, int] = {}
    taus: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "step" not in rec:
            continue
        if not rec.get("eval"):
            tokens[int(rec["step"])] = int(rec.get("tokens", 0))
        elif rec.get("acceptance_length") is not None:
            taus[int(rec["step"])] = round(float(rec["acceptance_length"]), 4)
    return tokens, taus


def heldout_curve(tokens: dict[int, int], taus: dict[int, float]) -> list[list]:
    """[[step, tokens seen up to it, held-out tau], ...] from `train_log`: the run's evals (the simulated acceptance
    length on its held-out chats, every `eval_every` steps)."""
    seen, curve = 0, []
    for step in sorted(set(tokens) | set(taus)):
        seen += tokens.get(step, 0)
        if step in taus:
            curve.append([step, seen, taus[step]])
    return curve


def point_record(work: Path, n: int, steps: int, summary: dict, *, wall_s: float) -> dict:
    st = summary["stages"]
    per_step, taus = train_log(work / "train" / "metrics.jsonl")
    acc = st["train"].get("heldout_acc_per_step") or [None]
    return {
        "conversations": n,
        "steps": steps,
        "tokens_seen": sum(per_step.values()),
        "steps_logged": len(per_step),
        "regenerated": st.get("regenerate", {}).get("selected"),
        "answer_tokens": st.get("regenerate", {}).get("selected_answer_tokens"),
        "train_samples": st["prepare"].get("train_samples"),
        "train_tokens_per_epoch": st["prepare"].get("tokens"),
        "tau_chain": summary.get("tau_chain"),
        "tau_tree": summary.get("tau_tree"),
        "heldout_top1_step0": acc[0],
        "heldout_tau": heldout_curve(per_step, taus),
        "train_tokens_per_s": st["train"].get("tokens_per_s"),
        "stage_seconds": {k: v.get("seconds") for k, v in st.items()},
        "wall_s": round(wall_s, 1),
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
            out[f"{mode}_per_doubling_s{steps}"] = (
                round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den, 4) if den else None
            )
    return out


POINT_KEYS = ("conversations", "steps", "tokens_seen", "tau_chain", "tau_tree")


def read_points(path: Path) -> list[dict]:
    """Point records measured elsewhere (--add-points: another root's points.jsonl, or lab/scripts/scaling_points.jsonl),
    each checked for the keys the table, trend and plot read. Raises ValueError naming the file and line."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        missing = [k for k in POINT_KEYS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ValueError(f"{path}:{i}: a point record needs {', '.join(missing)}")
        rec.setdefault("source", str(path))
        out.append(rec)
    return out


def merge_points(own: list[dict], added: list[dict]) -> list[dict]:
    """This root's points and the added ones, one per (conversations, steps): a point measured in this root wins over
    an added one, and of two added ones the later file's."""
    by_key = {(p["conversations"], p["steps"]): p for p in added}
    by_key.update({(p["conversations"], p["steps"]): p for p in own})
    return list(by_key.values())


def write_outputs(root: Path, points: list[dict], tr: dict) -> None:
    points = sorted(points, key=lambda p: (p["conversations"], p["steps"]))
    lines = [
        "| conversations | steps | tokens seen | train samples | held-out top-1 | tau chain | tau tree | from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        top1 = f"{p['heldout_top1_step0']:.3f}" if p.get("heldout_top1_step0") is not None else "-"
        samples = f"{p['train_samples']:,}" if p.get("train_samples") is not None else "-"
        lines.append(
            f"| {p['conversations']:,} | {p['steps']:,} | {p['tokens_seen'] / 1e6:.1f}M | {samples} | "
            f"{top1} | {p['tau_chain']} | {p['tau_tree']} | {p.get('source', 'this root')} |"
        )
    lines += [
        "",
        "Trend (least squares, tau per doubling of conversations at a fixed step budget): "
        + (", ".join(f"{k} = {v}" for k, v in tr.items()) or "needs two sizes at one budget"),
    ]
    (root / "scaling.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log(f"no plot ({exc})")
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for steps in sorted({p["steps"] for p in points}):
        pts = [p for p in points if p["steps"] == steps]
        for mode, style in (("tau_tree", "o-"), ("tau_chain", "s--")):
            axes[0].plot(
                [p["conversations"] for p in pts], [p[mode] for p in pts], style, label=f"{mode[4:]}, {steps} steps"
            )
    for n in sorted({p["conversations"] for p in points}):
        pts = sorted((p for p in points if p["conversations"] == n), key=lambda p: p["tokens_seen"])
        for mode, style in (("tau_tree", "o-"), ("tau_chain", "s--")):
            axes[1].plot(
                [p["tokens_seen"] for p in pts], [p[mode] for p in pts], style, label=f"{mode[4:]}, {n:,} conv."
            )
    for p in points:  # held-out tau along each run (every step budget's batch is the same: steps measure compute)
        curve = p.get("heldout_tau") or []
        if curve:
            axes[2].plot(
                [c[0] for c in curve],
                [c[-1] for c in curve],
                ".-",
                label=f"{p['conversations']:,} conv., {p['steps']} steps",
            )
    axes[0].set_xscale("log")
    axes[0].set_xlabel("regenerated conversations")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("tokens seen in training")
    axes[2].set_xlabel("optimizer step")
    for ax in axes[:2]:
        ax.set_ylabel("MT-bench tau (greedy)")
    axes[2].set_ylabel("held-out tau (simulated chain)")
    for ax in axes:
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
    ap.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU ids, e.g. 0,1: regenerate once on the first, "
        "then run one point per GPU at once (default: one point at a time, no pinning)",
    )
    ap.add_argument("--regen-only", action="store_true", help="only regenerate the largest --conversations (phase 1)")
    ap.add_argument("--set", action="append", help="section.key=value passed to every point's pipeline")
    ap.add_argument(
        "--add-points",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="point records measured elsewhere (JSON lines, e.g. another root's points.jsonl or "
        "lab/scripts/scaling_points.jsonl): counted as done, shown in the table, trend and plot; this "
        "root's points.jsonl stays its own",
    )
    args = ap.parse_args()
    added: list[dict] = []
    for f in args.add_points:
        try:
            added += read_points(f)
        except OSError as exc:
            ap.error(f"--add-points {f}: {exc.strerror or exc}")
        except ValueError as exc:
            ap.error(f"--add-points {exc}")
    for item in args.set or []:
        if item.split("=", 1)[0].strip() in ("regenerate.limit", "regenerate.out", "train.steps", "workdir"):
            ap.error(f"--set {item}: the study sets this per point (use --conversations / --steps / --root)")
    if args.gpus is not None:
        args.gpus = [g.strip() for g in args.gpus.split(",")]
        if not all(args.gpus):
            ap.error(f"--gpus {','.join(args.gpus)}: expected comma-separated GPU ids such as 0,1")
    args.root.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.max_minutes
    grid = [
        (n, s)
        for n in sorted(int(x) for x in args.conversations.split(","))
        for s in sorted(int(x) for x in args.steps.split(","))
    ]
    done_file = args.root / "points.jsonl"
    own = [json.loads(line) for line in done_file.read_text().splitlines()] if done_file.exists() else []
    done = merge_points(own, added)
    finished = {(p["conversations"], p["steps"]) for p in done}
    todo = [(n, s) for n, s in grid if (n, s) not in finished]

    # -- phase 1: the shared regeneration, once, for the largest N still needed
    regen_status = "not needed"  # one process: each point grows the shared regeneration in turn
    if args.regen_only or (args.gpus and todo):
        n_max = max(n for n, _ in (grid if args.regen_only else todo))
        regen_status, regen = regen_phase(args, n_max, deadline)
        if args.regen_only:
            print(
                json.dumps(
                    {
                        "benchmark": "scaling_study",
                        "phase": "regenerate",
                        "done": regen_status == "done",
                        "status": regen_status,
                        "conversations": n_max,
                        "chats": str(args.root / "regen" / "chats.jsonl"),
                        "selected_chats": str(args.root / REGEN_WORKDIR / "regenerate" / "chats.jsonl"),
                        "regenerate": (regen or {}).get("stages", {}).get("regenerate"),
                    }
                ),
                flush=True,
            )
            sys.exit(1 if regen_status == "failed" else 0)

    # -- phase 2: the points, one per slot at a time; this process alone writes the outputs
    failures: list[dict[str, Any]] = []

    def launch(point, gpu):
        n, s = point
        work = point_dir(args.root, n, s)
        return Child(
            work.name,
            pipeline_cmd(args, work, n, ["--set", f"train.steps={s}"]),
            log_path=work / "pipeline.log",
            gpu=gpu,
            side_by_side=len(args.gpus or [None]),
        )

    def on_exit(point, child: Child, rc: int) -> bool:
        n, s = point
        summary = child.summary()
        if rc != 0 or summary is None:
            log(
                f"[{child.name}] FAILED (exit {rc}); the other points go on. The end of {child.log_path}:\n{child.tail()}"
            )
            failures.append({"conversations": n, "steps": s, "exit": rc, "log": str(child.log_path)})
            return False
        work = point_dir(args.root, n, s)
        rec = point_record(work, n, s, summary, wall_s=time.time() - child.t0)
        prune_checkpoints(work)
        done[:] = merge_points([rec], done)
        with open(done_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({"point": rec}), flush=True)
        write_outputs(args.root, done, trend(done))
        return True

    stopped = regen_status == "stopped"
    if regen_status in ("done", "not needed") and todo:
        slots = list(args.gpus) if args.gpus else [None]
        stopped = schedule(todo, slots, launch, on_exit, deadline=deadline).stopped
    tr = trend(done)
    if done:
        write_outputs(args.root, done, tr)
    left = [
        {"conversations": n, "steps": s}
        for n, s in grid
        if (n, s) not in {(p["conversations"], p["steps"]) for p in done}
    ]
    print(
        json.dumps(
            {
                "benchmark": "scaling_study",
                "done": not left,
                "stopped_at_deadline": stopped,
                "regeneration": regen_status,
                "points_done": len(done),
                "points_left": left,
                "failed": failures,
                "trend": tr,
                "root": str(args.root),
                "table": str(args.root / "scaling.md"),
                "plot": str(args.root / "scaling.png"),
            }
        ),
        flush=True,
    )
    sys.exit(1 if failures or regen_status == "failed" else 0)


if __name__ == "__main__":
    main()
