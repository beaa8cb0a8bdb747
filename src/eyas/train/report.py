"""What `eyas train` reports: each step's metrics record and log line (Reporter, with the run's running totals), the
evaluations' records, and the final drafter with the run's summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eyas.common import log


def fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def fmt_eta(s: float) -> str:
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 else f"{s:.0f}s"


class Reporter:
    """The records and log lines of one run, and the running totals they are computed from (tokens, padded and
    supervised tokens, the target's seconds since the run's start). `last`: the latest training record (on a
    resume, the finished run's last one until a step is reported); `evals`: the evaluation records."""

    def __init__(self, metrics, *, d, K: int, weights, total: int, start: int, online: bool):
        self.metrics, self.d, self.K, self.weights = metrics, d, K, weights
        self.total, self.start, self.online = total, start, online
        self.t_run, self.tok_run, self.sup_run, self.pad_run, self.target_run = time.perf_counter(), 0, 0, 0, 0.0
        done_last, self.evals = (
            metrics.last() if start > 0 else (None, [])
        )  # a finished run's rerun reports its figures
        self.last: dict[str, Any] = done_last or {}
        self.t_last = self.t_run
        self.t_first: float | None = None  # when this run's first step ended (it compiles: the eta leaves it out)

    def begin(self) -> None:
        """The clock of the first step's `step_s` starts here, once the loop is ready to queue it."""
        self.t_last = time.perf_counter()

    def step(self, step, stats, counts_t, denoms, gnorm, lr_s, timings, waited: float = 0.0) -> bool:
        """Read a step's statistics back (this waits for the GPU to finish it), write its metrics record and log
        line; True when a process asked to stop. `waited`: seconds the host already waited for them (a deferred
        read's copies); the record's `host_wait_s` adds the wait here (well above 0: the GPU bounds the step; near 0
        the host did not wait here, as when it waits in kernel launches behind a full GPU queue instead)."""
        from eyas.train.prefetch import target_seconds

        K, total = self.K, self.total
        ce, correct, valid = stats[:K], stats[K : 2 * K], stats[2 * K : 3 * K]
        den = denoms.double().clamp_min(1)
        t0 = time.perf_counter()
        loss_k = (ce / den).tolist()  # synchronises: the step (and the side-stream target) is done
        waited += time.perf_counter() - t0
        loss_v = sum(w * x for w, x in zip(self.weights, loss_k))
        acc_k = (correct / valid.clamp_min(1)).tolist()
        tokens, padded, supervised, stopping = (int(x) for x in counts_t.tolist())
        target_s = sum(target_seconds(t) for t in timings)
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        self.tok_run += tokens
        self.pad_run += padded
        self.sup_run += supervised
        self.target_run += target_s
        wall = now - self.t_run
        rate = self.tok_run / wall
        if self.t_first is None:
            self.t_first, eta = now, None
        else:
            eta = (total - step - 1) * (now - self.t_first) / (step - self.start)
        self.last = last = {
            "step": step + 1,
            "loss": loss_v,
            "loss_per_step": loss_k,
            "acc_per_step": acc_k,
            "lr": lr_s,
            "grad_norm": float(gnorm),
            "tokens": tokens,
            "padded_tokens": padded,
            "supervised_tokens": supervised,
            "step_s": dt,
            "host_wait_s": waited,
            "tokens_per_s": rate,
            "supervised_tokens_per_s": self.sup_run / wall,
            "useful_fraction": self.tok_run / max(self.pad_run, 1),
            "target_share": self.target_run / wall if self.online else 0.0,
        }
        self.metrics.write(last)
        if self.d.is_main:
            accs = " ".join(f"{a:.2f}" for a in acc_k[: min(K, 4)])
            extra = f" | target {last['target_share']:.0%}" if self.online else ""
            log(
                f"step {step + 1:05d}/{total:05d} | loss {loss_v:.3f} | acc {accs} | {fmt_rate(rate)} tok/s "
                f"({fmt_rate(last['supervised_tokens_per_s'])} supervised) | useful {last['useful_fraction']:.2f}"
                f"{extra} | eta {'-' if eta is None else fmt_eta(eta)}"
            )
        return bool(stopping)

    def eval(self, ev: dict[str, Any], step: int) -> None:
        """An evaluation after step `step`: its record and log line."""
        ev["step"] = step + 1
        self.evals.append(ev)
        self.metrics.write({"eval": True, **ev})
        if self.d.is_main:
            log(
                f"eval  {step + 1:05d} | loss {ev['loss']:.3f} | acc "
                + " ".join(f"{a:.2f}" for a in ev["acc_per_step"])
                + f" | tau {ev['acceptance_length']:.2f}"
            )


def save_final(
    cfg,
    model_sd,
    *,
    out: Path,
    final_dir: Path,
    dcfg,
    target_id: dict,
    tok_hash: str,
    total: int,
    global_batch: int,
    lr: float,
    optimizer: str,
    vocab,
) -> None:
    """Write the final drafter to `final_dir` (Eagle3Drafter.save, with how it was trained) and the curves' plot."""
    from eyas.common import require_finite
    from eyas.drafter.model import Eagle3Drafter
    from eyas.train.metrics import plot_curves

    require_finite(dict(model_sd), what="the final drafter")
    final = Eagle3Drafter(dcfg)
    final.load_state_dict({k.removeprefix("drafter."): v for k, v in model_sd.items()})
    final.save(
        final_dir,
        target={**target_id, "tokenizer_hash": tok_hash},
        extra={
            "training": {
                "steps": total,
                "global_batch": global_batch,
                "lr": lr,
                "teacher_temperature": cfg.teacher_temperature,
                "align_topk": cfg.align_topk,
                "feature_loss": cfg.feature_loss,
                "optimizer": optimizer,
                "ttt_steps": cfg.ttt_steps,
                "source": "store" if cfg.store else "online",
                "vocab": vocab.report(),
            }
        },
    )
    plot_curves(out / "metrics.jsonl", out / "curves.png")


def summary(
    reporter: Reporter, *, out: Path, final_dir: Path, total: int, world: int, tokens_per_batch, vocab, train_src
) -> dict[str, Any]:
    """The run's summary (the CLI's last stdout line): where its outputs are and its last figures."""
    last, evals = reporter.last, reporter.evals
    return {
        "out": str(out),
        "drafter": str(final_dir),
        "steps": total,
        "world": world,
        "final_loss": last.get("loss"),
        "acc_per_step": last.get("acc_per_step"),
        "tokens_per_s": last.get("tokens_per_s"),
        "supervised_tokens_per_s": last.get("supervised_tokens_per_s"),
        "useful_fraction": last.get("useful_fraction"),
        "target_share": last.get("target_share"),
        "tokens_per_batch": tokens_per_batch,
        "vocab": vocab.report(),
        "state_cache": getattr(train_src, "cache", None) is not None,
        "target_forwards": getattr(train_src, "target_forwards", None),
        "eval": evals[-1] if evals else None,
        "metrics": str(out / "metrics.jsonl"),
        "plot": str(out / "curves.png"),
    }
