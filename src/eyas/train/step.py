"""The training loop's steps (Trainer): accumulate the micro-batches, clip, step the optimizer, read the statistics
(one step late where nothing waits on them), evaluate, checkpoint, and stop cleanly on a signal."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.common import log
from eyas.errors import Interrupted
from eyas.packing import to_device
from eyas.train import checkpoint as ck, dist as dd
from eyas.train.builders import start_state_cache
from eyas.train.data import OnlineSource
from eyas.train.evaluate import dummy_item, evaluate
from eyas.train.prefetch import HostCopies, PackedPrefetcher
from eyas.train.report import Reporter
from eyas.train.stop import StopRequest, continue_hint, start_compile_workers_shielded


def micro_items(train_src, plan, rank: int, step: int):
    """[accum] item lists of this rank; a rank left without samples gets a loss-free dummy."""
    first = train_src.item(plan.step_indices(step)[0])
    return [[train_src.item(i) for i in idx] or [dummy_item(first)] for idx in plan.micro_indices(step, rank)]


def schedule(train_src, plan, rank: int, start: int, total: int):
    """This rank's micro-batches' items from step `start` on, in the order the loop consumes them. (It holds the
    source and the plan only: the prefetcher's thread that iterates it keeps no model alive.)"""
    for s in range(start, total):
        yield from micro_items(train_src, plan, rank, s)


@dataclass(kw_only=True)
class Trainer:
    """One run's loop: what it reads and updates, built by train/loop.py `_train`, then `run()`."""

    cfg: Any
    d: Any
    module: torch.nn.Module
    opt: Any
    sched: Any
    params: list
    clip: Callable
    """Clips the gradients and returns their norm: train/loop.py `_clip`, passed in so a patch of it applies."""
    plan: Any
    batches: Any
    """builders.Batches: micro-batch size, the run's length in steps."""
    train_src: Any
    eval_src: Any
    samples: Any
    """builders.Samples: loss normalisers' table, lengths and ids (the state cache's)."""
    hidden: int
    ttt_cfg: Any
    amp: Any
    reporter: Reporter
    stop: StopRequest
    step_end: Callable[[int], None] | None
    start: int
    identity: dict
    ckdir: Path
    prefetch: Any = None

    def forward_batch(self, batch, denoms):
        with self.amp:
            return self.module(
                batch.input_ids_N, batch.seg, batch.rows, batch.aux_NAD, batch.final_ND, denoms, batch.live
            )

    def run(self) -> None:
        """Steps `start` to the end; raises Interrupted after saving the step a stop was asked in."""
        d, dev, total = self.d, self.d.device, self.batches.total
        if dev.type == "cuda":  # before the first compile (the online target's first forward, queued just below)
            start_compile_workers_shielded()
        self.prefetch = PackedPrefetcher(
            self.train_src,
            schedule(self.train_src, self.plan, d.rank, self.start, total),
            dev,
            steps=self.cfg.ttt_steps,
            pad_to=self.batches.tokens_per_batch,
        )
        self.stop.install()
        # a step whose statistics are read once the next one is queued, so the GPU never idles while the host logs and
        # prepares a step: they are copied to pinned host memory behind the step (`HostCopies`), and the read waits for
        # that copy alone; the records and log lines are then one step late (never at an evaluation, a checkpoint, the
        # last step or a stop in one process, which read at once); with several ranks, a stop asked during step s ends
        # the run after step s + 1 on every rank alike
        pending = None
        self.reporter.begin()
        for step in range(self.start, total):
            readings = self.step(step)
            if pending is not None:  # the step before's, one step late
                t0 = time.perf_counter()
                got = pending.get()
                stop_seen = self.reporter.step(*got, waited=time.perf_counter() - t0)
            else:
                stop_seen = False
            pending = None
            done = step + 1 == total
            eval_due = self.eval_src is not None and (
                (self.cfg.eval_every and (step + 1) % self.cfg.eval_every == 0) or done
            )
            save_due = bool(self.cfg.save_every and (step + 1) % self.cfg.save_every == 0) or done
            stop_here = (
                d.world == 1 and self.stop.signum is not None
            )  # (ranks agree on a stop through the statistics only)
            if not (done or eval_due or save_due or stop_seen or stop_here):
                pending = HostCopies(readings)  # read once the next step is queued, waiting for this one alone
                continue
            stopping = self.reporter.step(*readings) or stop_seen
            self.evaluate_and_save(step, done=done, eval_due=eval_due, save_due=save_due, stopping=stopping)
        self.stop.restore()  # the final save is quick; an interrupt there leaves the last step's checkpoint to resume from
        self.prefetch.close()

    def step(self, step: int) -> tuple:
        """One optimizer step over this rank's micro-batches; its readings (statistics summed over the ranks, still
        on the device) for Reporter.step."""
        cfg, d, dev, K, plan = self.cfg, self.d, self.d.device, self.cfg.ttt_steps, self.plan
        world_scale = float(d.world)  # DDP/FSDP average gradients; our loss is already a global mean
        micro = plan.micro_indices(step, d.rank)
        # no step waits for the GPU before its statistics are read at its end: a plain host-to-device copy waits
        # for all the work queued before it (so do float() and tolist()), so the small per-step tensors go
        # through pinned memory and the gradient norm is read with the statistics
        denoms = to_device(torch.from_numpy(self.samples.den_table[plan.step_indices(step)].sum(0)), dev)
        stats = torch.zeros(3 * K + 2, dtype=torch.float64, device=dev)
        # real, padded, supervised tokens; stop requests (summed with them, so every rank stops after the same step)
        counts = [0, 0, 0, 0]
        batches = []
        for m, idx in enumerate(micro):
            batch = self.prefetch.next_batch()
            sync = m == len(micro) - 1
            ctx = self.module.no_sync() if (d.enabled and not cfg.fsdp and not sync) else nullcontext()
            if cfg.fsdp:
                self.module.set_requires_gradient_sync(sync)
            with ctx:  # (named ranges: a profile's table splits the step's GPU time by them)
                with torch.profiler.record_function("eyas.drafter_forward"):
                    loss, st = self.forward_batch(batch, denoms)
                with torch.profiler.record_function("eyas.drafter_backward"):
                    (loss * world_scale).backward()
            stats += st.double()
            if idx:
                counts[0] += batch.tokens
                counts[1] += batch.padded_tokens
                counts[2] += batch.supervised
            batches.append(batch)
        with torch.profiler.record_function("eyas.optimizer"):
            gnorm = self.clip(self.module, self.params, cfg.grad_clip)
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.step_end is not None:
            self.step_end(step)
        self.maybe_start_state_cache(step)
        if self.stop.signum is not None:
            counts[3] = 1
        counts_t = to_device(torch.tensor(counts, dtype=torch.float64), dev)
        dd.all_reduce_sum(stats, d)
        dd.all_reduce_sum(counts_t, d)
        return step, stats, counts_t, denoms, gnorm, self.sched.get_last_lr()[0], [b.target_timing for b in batches]

    def maybe_start_state_cache(self, step: int) -> None:
        """Online, after the run's first step: the state cache decision (builders.start_state_cache)."""
        cfg = self.cfg
        if step == self.start and isinstance(self.train_src, OnlineSource) and cfg.cache_states is not False:
            start_state_cache(
                cfg,
                self.train_src,
                self.samples.item_ids,
                self.samples.lengths,
                hidden=self.hidden,
                dev=self.d.device,
                epochs=(self.batches.total - self.start) / self.plan.steps_per_epoch,
                log_it=self.d.is_main,
            )

    def evaluate_and_save(self, step: int, *, done: bool, eval_due: bool, save_due: bool, stopping: bool) -> None:
        """After a step read at once: its evaluation and checkpoint when due; a stop saves and raises Interrupted."""
        cfg, d, b = self.cfg, self.d, self.batches
        if eval_due and not (stopping and not done):  # (a run that stops here saves and ends: no evaluation first)
            ev = evaluate(
                self.module,
                self.eval_src,
                forward_batch=self.forward_batch,
                K=cfg.ttt_steps,
                weights=self.ttt_cfg.weights,
                d=d,
                tokens_per_batch=b.tokens_per_batch or b.batch_size * cfg.max_length,
                device=d.device,
            )
            self.reporter.eval(ev, step)
        ck_path = self.ckdir / f"step-{step + 1:06d}.safetensors"
        if save_due or stopping:
            p = ck.save_checkpoint(
                ck_path,
                model=self.module,
                optimizer=self.opt,
                scheduler=self.sched,
                step=step + 1,
                identity=self.identity,
                extra={"world": d.world},
                is_main=d.is_main,
            )
            if p is not None:
                log(f"checkpoint {p}")
                ck.prune_checkpoints(self.ckdir, keep=cfg.keep_checkpoints)
        if stopping and not done:
            self.prefetch.close()
            raise Interrupted(
                f"stopped after step {step + 1} of {b.total}, saved in {ck_path}; "
                f"{continue_hint(cfg)} to continue from there"
            )
