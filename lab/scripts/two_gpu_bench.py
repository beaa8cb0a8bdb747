"""Two-GPU training: throughput scaling, loss-curve equality and checkpoint portability, one command.

Every figure is taken through the real command lines, one child process (or one torchrun) per run, so
the driver itself never touches a GPU:

  8b      benchmarks/train_bench.py (8B-shaped drafter, synthetic stored states, SpecForge and the
          reference path off) as 1 process and under `torchrun --nproc_per_node 2` (DDP; with --fsdp
          FSDP2 too). train_bench reports tokens/s of ALL ranks (tokens per step = world x batch x seq),
          so train_2gpu_scaling_8b = tokens/s (2 processes) / tokens/s (1 process).
  smol    `eyas train` online (SmolLM2 target in the loop) on --data, 1 process vs 2, the same
          --tokens-per-batch per process (so the 2-process global batch is twice as large), --steps
          steps; the steady-state rate comes from each run's metrics.jsonl (first --skip steps left
          out; `tokens` there are summed over ranks and `step_s` is rank 0's synchronised step).
  smol-offline  the same with --store (offline, captured states): train_2gpu_scaling_smol_offline;
          without --store it is recorded as not run.
  loss    the same global batches in the same order, 1 process vs 2: TokenPlan cuts each epoch's
          permutation into micro-batches of --tokens-per-batch and gives optimizer step j the
          micro-batches j*S..j*S+S-1, S = grad_accum x world. So 1 process with --grad-accum 2 and
          2 processes with --grad-accum 1 (same --tokens-per-batch) see identical micro-batches, and
          their checkpoints carry the same identity ("Xtok x2"). (1 process with 2X tokens per batch
          would pack the permutation differently: other batches, and a checkpoint the other refuses.)
          Both loss curves go to loss_curves.csv and loss_curves.png (matplotlib, optional).
  ckpt    the 2-process run above checkpoints at step K; a fresh run directory holding only that
          checkpoint (and the metrics up to K) is resumed by ONE process to the end, and the 1-process
          run's step-K checkpoint by TWO processes. Each must log "resumed ... at step K", record steps
          K+1..N, and match the uninterrupted run's losses within --loss-rtol.

NCCL runs with NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, set in every child's environment). On a 2-GPU H200 (about 6-8 minutes):

    PYTHONPATH=src python lab/scripts/two_gpu_bench.py --target /root/smol --data /root/prep_orig \\
        --work /root/two_gpu_bench [--store STORE] [--fsdp]

CPU smoke run (gloo, a tiny random target and random prepared data built under --work; the figures
mean nothing on a shared CPU, it checks that every part runs end to end):

    PYTHONPATH=src python lab/scripts/two_gpu_bench.py --device cpu --work /tmp/two_gpu_smoke

`--tiny` on CUDA runs loss/ckpt on that tiny target over NCCL: the checkpoint and equal-loss mechanics
on the GPUs without staging the real target (the tiny target needs the default tokenizer: build it
where the GGUF is, `smoke_inputs(WORK)`, and carry WORK/smoke_target). `--bf16-reduce` adds an 8b run
with `--grad-reduce bf16` (DDP all-reduce in bf16): train_2gpu_scaling_8b_bf16_reduce.

Progress (each child's stderr, prefixed) goes to stderr; a table and, as the LAST stdout line, one
JSON document. A part that fails is recorded under "errors" and the other parts still run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from capture_dp_bench import child_env, ensure_prepared  # noqa: E402  (sibling benchmark helpers)
from train_bench import _steady  # noqa: E402

PARTS = ("8b", "smol", "smol-offline", "loss", "ckpt")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- running children ------------------------------------------------------------------------------


def launch(
    label: str, argv: list[str], *, procs: int, env: dict[str, str], logdir: Path, timeout: float, module: bool
) -> tuple[str, str]:
    """Run `python [-m] argv` as 1 process or under torchrun with `procs` processes; stream its stderr
    (prefixed) to ours and to logdir/label.log; return (stdout, stderr). Raises on a non-zero exit."""
    py = [sys.executable]
    if procs > 1:
        py += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = py + (["-m"] if module else []) + argv
    log(f"[{label}] $ " + " ".join(cmd))
    logdir.mkdir(parents=True, exist_ok=True)
    out_f, err_lines = logdir / f"{label}.stdout", []
    t0 = time.perf_counter()
    if timeout < 10:
        raise TimeoutError(f"{label}: not started, {timeout:.0f}s left of --budget-s")
    with open(out_f, "w") as so, open(logdir / f"{label}.log", "w") as lf:
        # own process group: on timeout torchrun AND its workers are killed, nothing is left on a GPU
        p = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=so, stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True
        )
        timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None)
        timer.start()
        try:
            for line in p.stderr:
                lf.write(line)
                err_lines.append(line)
                log(f"  [{label}] {line.rstrip()[:300]}")
            p.wait()
        finally:
            timer.cancel()
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    err = "".join(err_lines)
    if p.returncode == -signal.SIGKILL and time.perf_counter() - t0 >= timeout:
        raise TimeoutError(f"{label}: killed after {timeout:.0f}s (--timeout / --budget-s)")
    if p.returncode != 0:
        raise RuntimeError(f"{label}: exit {p.returncode}: {err.strip()[-1200:]}")
    log(f"[{label}] done in {time.perf_counter() - t0:.1f}s")
    return out_f.read_text(), err


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in the output (last lines: {stdout.strip()[-300:]!r})")


def train_records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip() and '"eval"' not in x]


# -- inputs of the CPU smoke run -------------------------------------------------------------------


def smoke_inputs(work: Path) -> tuple[Path, Path]:
    """A tiny random Llama target with the default SmolLM2 tokenizer, and random prepared chats."""
    target = work / "smoke_target"
    if not (target / "config.json").is_file():
        import torch
        import transformers

        from eyas.defaults import default_target_dir
        from eyas.target import load_tokenizer

        tok = load_tokenizer(default_target_dir())
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # a confident teacher whose top-1 lies in the 512-id draft vocab (else no loss)
            model.lm_head.weight[512:] = 0
            model.lm_head.weight[:512] *= 40
        model.save_pretrained(target, safe_serialization=True)
        tok.save_pretrained(target)
    data = ensure_prepared(target, work, samples=32, min_len=12, max_len=40, seed=0)
    return target, data


def smoke_store(work: Path, target: Path, data: Path) -> Path:
    """`eyas capture` of the smoke data (layers 1,3,4 of the tiny target), for the offline part."""
    store = work / "smoke_store"
    if not (store / "manifest.json").is_file():
        launch(
            "smoke-capture",
            [
                "eyas",
                "capture",
                "--target",
                str(target),
                "--data",
                str(data),
                "--out",
                str(store),
                "--device",
                "cpu",
                "--aux-layers",
                "1,3,4",
            ],
            procs=1,
            env=child_env("cpu"),
            logdir=work / "logs",
            timeout=300,
            module=True,
        )
    return store


# -- the parts -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args):
        self.a = args
        self.cuda = args.device != "cpu"
        self.env = child_env(args.device)
        self.logs = args.work / "logs"
        self.result: dict = {"device": args.device, "parts": args.parts, "errors": {}}
        self._refs: dict | Exception | None = None
        self.deadline = time.perf_counter() + args.budget_s

    def run(self, label, argv, *, procs, module=True):
        timeout = min(self.a.timeout, self.deadline - time.perf_counter())
        return launch(label, argv, procs=procs, env=self.env, logdir=self.logs, timeout=timeout, module=module)

    # 8B shape --------------------------------------------------------------------------------------
    def part_8b(self) -> None:
        a = self.a
        if self.cuda:
            common = ["--suite", "8b", "--device", "cuda", "--steps", str(a.steps_8b), "--warmup", "3"]
        else:  # the 8B shape does not fit a CPU smoke run: the SmolLM2 shape, short rows
            common = ["--suite", "8b", "--small", "--device", "cpu", "--seq", "128", "--steps", "2", "--warmup", "1"]
        common += ["--no-specforge", "--no-reference", "--no-compile"]
        bench = str(HERE / "train_bench.py")
        rates = {}
        variants = (
            [("1proc", 1, [])]
            + ([("2proc-ddp-bf16", 2, ["--grad-reduce", "bf16"])] if a.bf16_reduce else [])
            + [("2proc-ddp", 2, [])]
            + ([("2proc-fsdp2", 2, ["--fsdp"])] if a.fsdp else [])
        )
        for name, procs, extra in variants:
            try:
                res = last_json(self.run(f"8b-{name}", [bench, *common, *extra], procs=procs, module=False)[0])
                r = res["runs"]["eyas"]
                if "tokens_per_s" not in r:
                    raise RuntimeError(r.get("error", "no tokens_per_s"))
                if res.get("world") != procs:
                    raise RuntimeError(f"train_bench reported world {res.get('world')}, expected {procs}")
                rates[name] = {
                    "tokens_per_s": r["tokens_per_s"],
                    "s_per_step": r["s_per_step"],
                    "peak_mem_gb": r.get("peak_mem_gb"),
                    "world": procs,
                }
            except Exception as exc:  # noqa: BLE001  (recorded; the other variants still run)
                self.fail(f"8b-{name}", exc)
        self.result["8b"] = rates
        one = rates.get("1proc", {}).get("tokens_per_s")
        for name, key in (
            ("2proc-ddp", "train_2gpu_scaling_8b"),
            ("2proc-ddp-bf16", "train_2gpu_scaling_8b_bf16_reduce"),
            ("2proc-fsdp2", "train_2gpu_scaling_8b_fsdp2"),
        ):
            if one and name in rates:
                self.result[key] = rates[name]["tokens_per_s"] / one

    # SmolLM2 drafter, real `eyas train` -------------------------------------------------------------
    def train_argv(self, out: Path, *, steps: int, tokens: int, source: list[str], extra: list[str] = ()) -> list[str]:
        a = self.a
        argv = [
            "eyas",
            "train",
            "--target",
            str(a.target),
            *source,
            "--out",
            str(out),
            "--device",
            a.device,
            "--steps",
            str(steps),
            "--tokens-per-batch",
            str(tokens),
            "--max-length",
            str(min(a.max_length, tokens)),
            "--eval-samples",
            str(a.eval_samples),
            "--lr",
            "1e-4",
            "--seed",
            "0",
            "--overwrite",
        ]
        if a.draft_vocab:
            argv += ["--draft-vocab", str(a.draft_vocab)]
        if a.aux_layers:
            argv += ["--aux-layers", a.aux_layers]
        return argv + list(extra)

    def part_smol(self) -> None:
        self._scaling("smol", ["--data", str(self.a.data)], "train_2gpu_scaling_smol")

    def part_smol_offline(self) -> None:
        if self.a.store:
            self._scaling("smol-offline", ["--store", str(self.a.store)], "train_2gpu_scaling_smol_offline")
        else:
            log("offline not run (no --store)")
            self.result["smol-offline"] = "offline not run (no --store given)"

    def _scaling(self, name: str, source: list[str], metric: str) -> None:
        a = self.a
        rates = {}
        for procs in (1, 2):
            label = f"{name}-{procs}proc"
            try:
                out = a.work / label
                self.run(
                    label, self.train_argv(out, steps=a.steps, tokens=a.tokens_per_batch, source=source), procs=procs
                )
                r = _steady(out / "metrics.jsonl", a.skip)
                r["world"] = procs
                rates[f"{procs}proc"] = r
                log(f"[{label}] steady {r['tokens_per_s']:.0f} tok/s over {r['steps_timed']} steps")
            except Exception as exc:  # noqa: BLE001
                self.fail(label, exc)
        self.result[name] = rates
        if "1proc" in rates and "2proc" in rates:
            self.result[metric] = rates["2proc"]["tokens_per_s"] / rates["1proc"]["tokens_per_s"]

    # the same global batch on 1 and 2 processes ------------------------------------------------------
    def refs(self) -> dict:
        """The uninterrupted reference runs (shared by `loss` and `ckpt`): 1 process x grad-accum 2 and
        2 processes x grad-accum 1, same tokens per micro-batch, seed, steps; checkpoints every K."""
        if isinstance(self._refs, Exception):  # failed once (recorded under `loss`): not run twice
            raise RuntimeError(f"the reference runs failed: {self._refs}")
        if self._refs is None:
            try:
                self._refs = self._run_refs()
            except Exception as exc:
                self._refs = exc
                raise
        return self._refs

    def _run_refs(self) -> dict:
        a = self.a
        refs = {}
        for procs, accum in ((1, 2), (2, 1)):
            label = f"loss-{procs}proc"
            out = a.work / label
            extra = ["--grad-accum", str(accum), "--save-every", str(a.ckpt_at)] + (
                [] if a.compile else ["--no-compile"]
            )
            self.run(
                label,
                self.train_argv(
                    out, steps=a.loss_steps, tokens=a.loss_tokens, source=["--data", str(a.data)], extra=extra
                ),
                procs=procs,
            )
            recs = train_records(out)
            if [r["step"] for r in recs] != list(range(1, a.loss_steps + 1)):
                raise RuntimeError(f"{label}: recorded steps {[r['step'] for r in recs]}")
            refs[procs] = {"out": out, "records": recs}
        return refs

    def part_loss(self) -> None:
        refs = self.refs()
        one, two = refs[1]["records"], refs[2]["records"]
        rows, abs_d, rel_d = [], [], []
        for r1, r2 in zip(one, two):
            d = abs(r1["loss"] - r2["loss"])
            abs_d.append(d)
            rel_d.append(d / max(abs(r1["loss"]), 1e-12))
            rows.append(
                {
                    "step": r1["step"],
                    "loss_1proc": r1["loss"],
                    "loss_2proc": r2["loss"],
                    "abs_diff": d,
                    "tokens_1proc": r1["tokens"],
                    "tokens_2proc": r2["tokens"],
                }
            )
        same_tokens = all(r["tokens_1proc"] == r["tokens_2proc"] for r in rows)
        csv_path = self.a.work / "loss_curves.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        self.result["loss"] = {
            "steps": len(rows),
            "csv": str(csv_path),
            "same_tokens_every_step": same_tokens,
            "max_abs_diff": max(abs_d),
            "max_rel_diff": max(rel_d),
            "first_step_rel_diff": rel_d[0],
            "tokens_per_micro_batch": self.a.loss_tokens,
            "plot": self.plot(rows),
        }
        self.result["loss_curve_max_abs_diff"] = max(abs_d)
        self.result["loss_curve_max_rel_diff"] = max(rel_d)
        self.result["loss_curve_ok"] = same_tokens and max(rel_d) <= self.a.loss_rtol
        if not same_tokens:
            log("loss: the two runs saw different token counts at some step: not the same global batches")

    def plot(self, rows: list[dict]) -> str:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            log(f"loss: no plot ({exc}); the curves are in loss_curves.csv")
            return f"not drawn: {exc}"
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 1])
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["loss_1proc"] for r in rows], "o-", label="1 process, grad-accum 2")
        ax.plot(steps, [r["loss_2proc"] for r in rows], "x--", label="2 processes")
        ax.set_ylabel("train loss (TTT-weighted)")
        ax.set_title(f"same global batch ({self.a.loss_tokens} tokens x 2 micro-batches), seed 0")
        ax.legend()
        ax2.plot(steps, [r["abs_diff"] for r in rows], "k.-")
        ax2.set_ylabel("|diff|")
        ax2.set_xlabel("optimizer step")
        path = self.a.work / "loss_curves.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)

    # checkpoint portability -------------------------------------------------------------------------
    def part_ckpt(self) -> None:
        refs = self.refs()
        for src, dst, key in ((2, 1, "ckpt_2to1"), (1, 2, "ckpt_1to2")):
            try:
                self.result[key] = self._resume(refs, src=src, dst=dst, label=f"{key}")
                self.result[f"{key}_ok"] = self.result[key]["ok"]
            except Exception as exc:  # noqa: BLE001
                self.fail(key, exc)
                self.result[f"{key}_ok"] = False

    def _resume(self, refs: dict, *, src: int, dst: int, label: str) -> dict:
        a = self.a
        K, N = a.ckpt_at, a.loss_steps
        ck_name = f"step-{K:06d}.safetensors"
        out = a.work / label
        shutil.rmtree(out, ignore_errors=True)
        # a copy of the writer's run directory (eyas's own output marker included) cut back to step K
        shutil.copytree(refs[src]["out"], out)
        shutil.rmtree(out / "drafter", ignore_errors=True)
        for f in (out / "checkpoints").iterdir():
            if f.name != ck_name:
                f.unlink()
        kept = [r for r in refs[src]["records"] if r["step"] <= K]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        accum = 2 // dst
        extra = ["--grad-accum", str(accum), "--resume", "auto"] + ([] if a.compile else ["--no-compile"])
        _, err = self.run(
            label,
            self.train_argv(out, steps=N, tokens=a.loss_tokens, source=["--data", str(a.data)], extra=extra),
            procs=dst,
        )
        m = re.search(r"resumed from \S+ at step (\d+)", err)
        resumed_at = int(m.group(1)) if m else None
        new = [r for r in train_records(out) if r["step"] > K]
        steps_seen = [r["step"] for r in new]
        uninterrupted = {r["step"]: r["loss"] for r in refs[dst]["records"]}
        rel = max(
            (
                abs(r["loss"] - uninterrupted[r["step"]]) / max(abs(uninterrupted[r["step"]]), 1e-12)
                for r in new
                if r["step"] in uninterrupted
            ),
            default=float("inf"),
        )
        ok = resumed_at == K and steps_seen == list(range(K + 1, N + 1)) and rel <= a.loss_rtol
        log(
            f"[{label}] {src} -> {dst} processes: resumed at step {resumed_at}, ran steps {steps_seen}, "
            f"max rel loss diff vs the uninterrupted {dst}-process run {rel:.2e}: {'ok' if ok else 'FAILED'}"
        )
        return {
            "written_by_processes": src,
            "resumed_on_processes": dst,
            "checkpoint_step": K,
            "resumed_at": resumed_at,
            "steps_seen": steps_seen,
            "max_rel_loss_diff_vs_uninterrupted": rel,
            "ok": ok,
        }

    def fail(self, part: str, exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {str(exc)[-800:]}"
        log(f"[{part}] FAILED: {msg}")
        self.result["errors"][part] = msg


def table(res: dict) -> None:
    def f(x, fmt="{:.3f}"):
        return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)

    print(f"{'run':26s} {'1 proc tok/s':>13s} {'2 proc tok/s':>13s} {'scaling':>8s}")
    for name, metric in (
        ("8b (ddp)", "train_2gpu_scaling_8b"),
        ("8b (ddp, bf16 reduce)", "train_2gpu_scaling_8b_bf16_reduce"),
        ("8b (fsdp2)", "train_2gpu_scaling_8b_fsdp2"),
        ("smol online", "train_2gpu_scaling_smol"),
        ("smol offline", "train_2gpu_scaling_smol_offline"),
    ):
        part = res.get("8b" if name.startswith("8b") else ("smol" if "online" in name else "smol-offline"))
        if not isinstance(part, dict):
            print(f"{name:26s} {'-':>13s} {'-':>13s} {'-':>8s}  ({part or 'not run'})")
            continue
        k2 = (
            "2proc-fsdp2"
            if "fsdp2" in name
            else "2proc-ddp-bf16"
            if "bf16" in name
            else "2proc-ddp"
            if name.startswith("8b")
            else "2proc"
        )
        if k2 not in part and k2 != "2proc-ddp" and name.startswith("8b"):
            continue
        r1, r2 = part.get("1proc", {}).get("tokens_per_s"), part.get(k2, {}).get("tokens_per_s")
        print(f"{name:26s} {f(r1, '{:.0f}'):>13s} {f(r2, '{:.0f}'):>13s} {f(res.get(metric)):>8s}")
    print(
        f"loss curve 1 vs 2 proc: max |diff| {f(res.get('loss_curve_max_abs_diff'), '{:.2e}')}, "
        f"max rel {f(res.get('loss_curve_max_rel_diff'), '{:.2e}')}, ok {res.get('loss_curve_ok')}"
    )
    for key in ("ckpt_2to1", "ckpt_1to2"):
        r = res.get(key) or {}
        print(f"{key}: ok {res.get(key + '_ok')}, resumed at {r.get('resumed_at')}, steps {r.get('steps_seen')}")
    for part, msg in res["errors"].items():
        print(f"FAILED {part}: {msg[:160]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu = gloo smoke run, tiny settings")
    ap.add_argument(
        "--target", type=Path, default=None, help="SmolLM2 target directory (cpu: default a tiny random one)"
    )
    ap.add_argument("--data", type=Path, default=None, help="prepared dataset (cpu: default random chats)")
    ap.add_argument(
        "--store", type=Path, default=None, help="offline store of --target's states (smol offline scaling)"
    )
    ap.add_argument("--work", type=Path, required=True, help="run directories, logs, loss_curves.csv/.png")
    ap.add_argument("--steps", type=int, default=None, help="smol: optimizer steps per run (default 16; cpu 6)")
    ap.add_argument("--skip", type=int, default=None, help="smol: first steps left out of the rate (default 5; cpu 2)")
    ap.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="smol: tokens per micro-batch per process (default 131072, eyas train's H200 default; cpu 128)",
    )
    ap.add_argument("--steps-8b", type=int, default=10, help="8b: timed steps after 3 warmup steps")
    ap.add_argument("--fsdp", action="store_true", help="8b: also 2 processes with FSDP2")
    ap.add_argument("--bf16-reduce", action="store_true", help="8b: also 2 processes with DDP's all-reduce in bf16")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="smol/loss/ckpt on a tiny random target and random prepared "
        "data built under --work, on any device (the cpu default)",
    )
    ap.add_argument("--loss-steps", type=int, default=None, help="loss/ckpt: steps N (default 20; cpu 4)")
    ap.add_argument("--ckpt-at", type=int, default=None, help="ckpt: checkpoint step K resumed (default N // 2)")
    ap.add_argument(
        "--loss-tokens", type=int, default=None, help="loss/ckpt: tokens per micro-batch (default 16384; cpu 128)"
    )
    ap.add_argument(
        "--loss-rtol",
        type=float,
        default=None,
        help="loss/ckpt: tolerated relative loss difference (default 0.02 on CUDA, bf16; 1e-4 on the CPU, fp32)",
    )
    ap.add_argument(
        "--compile", action="store_true", help="loss/ckpt: compile the drafter (default --no-compile: shorter)"
    )
    ap.add_argument("--max-length", type=int, default=None, help="sample truncation (default 2048; cpu 64)")
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=None, help="default: eyas train's (cpu smoke: 512)")
    ap.add_argument("--aux-layers", default=None, help="default: eyas train's (cpu smoke: 1,3,4)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per child run")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=570,
        help="seconds for the whole command: a run still going "
        "then is killed, later ones are not started (recorded), "
        "and the JSON line is still printed",
    )
    a = ap.parse_args()
    cpu = a.device == "cpu"
    tiny = cpu or a.tiny
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in a.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    a.steps = a.steps or (6 if tiny else 16)
    a.skip = a.skip if a.skip is not None else (2 if tiny else 5)
    a.tokens_per_batch = a.tokens_per_batch or (128 if tiny else 131072)
    a.loss_steps = a.loss_steps or (4 if cpu else 8 if tiny else 20)
    a.ckpt_at = a.ckpt_at or max(1, a.loss_steps // 2)
    a.loss_tokens = a.loss_tokens or (128 if tiny else 16384)
    a.loss_rtol = a.loss_rtol if a.loss_rtol is not None else (1e-4 if cpu else 0.02)
    a.max_length = a.max_length or (64 if tiny else 2048)
    if not 1 <= a.ckpt_at < a.loss_steps:
        ap.error(f"--ckpt-at must be in [1, --loss-steps), got {a.ckpt_at} with --loss-steps {a.loss_steps}")
    a.work = a.work.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    needs_data = any(p in a.parts for p in ("smol", "smol-offline", "loss", "ckpt"))
    if tiny and needs_data and (a.target is None or a.data is None):
        a.target, a.data = smoke_inputs(a.work)
        a.draft_vocab = a.draft_vocab or 512
        a.aux_layers = a.aux_layers or "1,3,4"
        log(f"tiny run: tiny random target {a.target}, random prepared data {a.data}")
        if cpu and "smol-offline" in a.parts and a.store is None:
            try:
                a.store = smoke_store(a.work, a.target, a.data)
            except Exception as exc:  # noqa: BLE001  (the offline part then says it did not run)
                log(f"cpu smoke run: no store for the offline part ({exc})")
    if needs_data and (a.target is None or a.data is None):
        ap.error("--parts smol/loss/ckpt need --target DIR and --data PREPARED")

    b = Bench(a)
    b.result.update(settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()})
    if cpu:
        b.result["note"] = "CPU smoke run (gloo, tiny model): the figures are meaningless, only that every part runs"
    elif a.tiny:
        b.result["note"] = "tiny random target on the GPUs (NCCL): smol/loss/ckpt check mechanics, not speed"
    t0 = time.perf_counter()
    for part in a.parts:
        log(f"== part {part} ==")
        try:
            getattr(b, f"part_{part.replace('-', '_')}")()
        except Exception as exc:  # noqa: BLE001  (recorded; the next part still runs)
            b.fail(part, exc)
            if part == "ckpt":
                b.result.setdefault("ckpt_2to1_ok", False)
                b.result.setdefault("ckpt_1to2_ok", False)
    b.result["wall_s"] = time.perf_counter() - t0
    table(b.result)
    print(json.dumps(b.result, sort_keys=True, default=str))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
