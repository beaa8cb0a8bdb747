"""`eyas train`: the training loop for the EAGLE-3 drafter (one process, one GPU or N under torchrun).

Order of work, each block labelled in `_train` below (the parts it calls are named there):
  1. processes and devices (train/dist.py)          5. batches and the schedule's length (train/builders.py)
  2. data: offline store or online target           6. parallelism: DDP, or FSDP2 with --fsdp (train/modules.py)
  3. checks before any step (train/checks.py)       7. optimizer (train/optim.py), warmup + cosine; resume
  4. draft vocabulary and the drafter               8. loop: accumulate, clip, step, log, eval, save (train/step.py)
The final drafter is written with `Eagle3Drafter.save` to <out>/drafter (train/report.py, with the run's summary).

Numerics: fp32 master weights; on CUDA the forward runs under bf16 autocast (FSDP2: bf16 params,
fp32 gradient reduction). Loss normalisation uses the GLOBAL batch's loss-mask counts per TTT step
(drafter/ttt/masks.py), so a step is the same whatever the split into ranks and micro-batches.

Simulated acceptance length (eval, train/evaluate.py): for each supervised position (one simulated drafting round),
accepted = the number of leading TTT steps whose draft top-1 equals the target's top-1 (inputs are
the data tokens, as in training); tau = 1 + mean accepted (the 1 is the target's bonus token).
It equals greedy chain-drafting tau when the data are the target's own greedy outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.common import log
from eyas.errors import EyasError, Interrupted

# (names other modules, tests and benchmarks import from here, wherever they are defined now)
from eyas.train.builders import default_tokens_per_batch  # noqa: F401
from eyas.train.checks import check_options_fit_target  # noqa: F401
from eyas.train.evaluate import evaluate  # noqa: F401
from eyas.train.modules import HEAD_CHUNK_ROWS, PackedTTTModule, TTTModule, teacher_cache_bytes  # noqa: F401
from eyas.train.optim import (  # noqa: F401
    LARGE_DRAFTER_HIDDEN,
    LARGE_DRAFTER_LR,
    OPTIMIZERS,
    SMALL_DRAFTER_LR,
    SMALL_DRAFTER_MUON_LR,
    default_lr,
    default_optimizer,
    lr_lambda,
)
from eyas.train.stop import (  # noqa: F401
    StopRequest,
    clear_frames as _clear_frames,
    interrupted_message as _interrupted_message,
    peer_stopped as _peer_stopped,
    start_compile_workers_shielded,
)


@dataclass(kw_only=True)
class TrainConfig:
    target: str = "default"
    """Target model directory (HF layout); `default` = embedded SmolLM2-135M-Instruct."""
    out: Path
    """Run directory: metrics.jsonl, curves.png, checkpoints/, drafter/."""
    store: Path | None = None
    """Offline: hidden-state store from `eyas capture` (training split)."""
    data: Path | None = None
    """Online: prepared dataset; the target runs on every batch, nothing is written. With --store: where the
    store's prepared dataset is now, when it moved after capture."""
    aux_layers: list[int] | None = None
    """Online: target layer ids for fc, comma-separated (hf-input convention); default 2,N//2,N-3."""
    eval_store: Path | None = None
    """Offline: a store of eval states; without it --eval-samples samples are held out of --store."""
    steps: int | None = None
    """Optimizer steps (overrides --epochs)."""
    epochs: float = 1.0
    """Passes over the training split when --steps is not given."""
    tokens_per_batch: int | None = None
    """Tokens per micro-batch per process, samples packed end to end (CUDA default: 131072, 32768 under 64 GiB)."""
    batch_size: int | None = None
    """Samples per micro-batch per process, instead of --tokens-per-batch (CPU default: 1)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float | None = None
    """Peak learning rate (default by drafter width: 2e-3 Muon / 1e-3 AdamW under hidden 2048, else 1e-4)."""
    optimizer: str | None = None
    """adamw, or muon (orthogonalized updates for the matrices; default under hidden 2048 without --fsdp)."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of --lr."""
    warmup_steps: int | None = None
    """Linear warmup steps (default 2% of the run, at least 1)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (0 = off)."""
    ttt_steps: int = 7
    """Training-time-test steps."""
    ttt_decay: float = 0.8
    """Loss weight of TTT step k = decay**k."""
    teacher_temperature: float = 1.0
    """Temperature of the target's distribution the drafter learns; below 1 sharpens it toward greedy's top token."""
    align_topk: int = 4
    """K > 0: a TTT step's loss counts only while the target's token stayed in the drafter's top K (0 = all rows)."""
    feature_loss: float = 0.0
    """> 0: adds this weight times a regression onto the target's final state (EAGLE-1's feature loss)."""
    ttt_cast_once: bool | None = None
    """Cast the mid layer's weights once per forward under autocast (default: by the drafter's size)."""
    draft_vocab: int | None = None
    """Draft vocabulary size (default min(32000, target vocab))."""
    draft_intermediate_size: int | None = None
    """SwiGLU inner width of the draft layer (default: the target's); wider adds capacity, exports carry it."""
    max_length: int = 2048
    """Samples are truncated to this many tokens."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    eval_samples: int = 64
    """Samples of the eval split used per evaluation."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept: the latest N (0 = all); older ones are deleted at each save to bound the disk used."""
    resume: str | None = None
    """Checkpoint file to resume from, or `auto` (the latest in <out>/checkpoints)."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N (under torchrun each rank uses cuda:LOCAL_RANK)."""
    model_dtype: str = "auto"
    """Compute dtype: bf16 (autocast, fp32 master weights) or fp32; auto = bf16 on CUDA, fp32 on CPU."""
    fsdp: bool = False
    """FSDP2: shard parameters, gradients and optimizer state across processes (needs torchrun)."""
    grad_reduce: str = "fp32"
    """DDP gradient all-reduce dtype: fp32, or bf16 (half the bytes); FSDP2 always reduces in fp32."""
    attention: str = "fast"
    """TTT attention: fast (flash + diagonals) or reference (dense mask)."""
    compile: bool | None = None
    """torch.compile the drafter's per-step pieces (default: on for CUDA, off on the CPU)."""
    init_head: bool = False
    """Start lm_head and the final norm from the target's (off: a copied head starts confident and wrong)."""
    cache_states: bool | None = None
    """Online: keep the target's states on the device after epoch 1 (default: when they fit; the log says)."""
    seed: int = 0
    """Seeds weights and data order."""
    overwrite: bool = False
    """Start --out over: its checkpoints, metrics and drafter are deleted (files eyas did not write are kept)."""

    def __post_init__(self):
        from eyas.common import check_out_path, require_owned
        from eyas.config_checks import check_choice, check_device, check_number, input_must_exist

        if self.store is None and self.data is None:
            raise EyasError(
                "give exactly one of --store (offline, captured states) or --data (online, prepared dataset)"
            )
        if self.store is None and self.eval_store is not None:
            raise EyasError(
                "--eval-store is for offline training (--store); with --data the prepared dataset's "
                "eval split is used: drop --eval-store, or train from a store"
            )
        if self.store is not None and self.cache_states:
            raise EyasError(
                "--cache-states keeps the target's states in online training (--data); with --store they "
                "are read from the store: drop --cache-states"
            )
        for name in ("grad_accum", "max_length", "eval_samples"):
            check_number(self, name, ge=1)
        check_number(self, "batch_size", ge=1, optional=True)
        check_number(self, "steps", ge=1, optional=True)
        check_number(self, "epochs", gt=0)
        check_number(self, "lr", gt=0, optional=True)
        check_number(self, "min_lr_ratio", ge=0, le=1)
        check_number(self, "warmup_steps", ge=0, optional=True)
        check_number(self, "weight_decay", ge=0)
        check_number(self, "grad_clip", ge=0)
        check_number(self, "ttt_steps", ge=1)
        check_number(self, "ttt_decay", gt=0, le=1)
        check_number(self, "teacher_temperature", gt=0)
        check_number(self, "align_topk", ge=0)
        check_number(self, "feature_loss", ge=0)
        check_number(self, "draft_vocab", ge=1, optional=True)
        check_number(self, "draft_intermediate_size", ge=1, optional=True)
        check_number(self, "eval_every", ge=0)
        check_number(self, "save_every", ge=0)
        check_number(self, "keep_checkpoints", ge=0)
        check_choice(self, "model_dtype", ("auto", "bf16", "fp32"))
        check_choice(self, "attention", ("fast", "reference"))
        check_choice(self, "grad_reduce", ("fp32", "bf16"))
        if self.optimizer is not None:
            check_choice(self, "optimizer", OPTIMIZERS)
        if self.fsdp and self.optimizer == "muon":
            raise EyasError(
                "--optimizer muon orthogonalizes whole matrices; --fsdp shards them: use DDP (drop --fsdp) "
                "or --optimizer adamw"
            )
        if self.fsdp and self.grad_reduce != "fp32":
            raise EyasError(f"--grad-reduce {self.grad_reduce} applies to DDP; --fsdp always reduces in fp32")
        check_device(self.device)
        if self.aux_layers is not None and any(i < 0 for i in self.aux_layers):
            raise EyasError(f"--aux-layers must be non-negative layer ids, got {self.aux_layers}")
        for opt, p, what in (
            ("--store", self.store, "an `eyas capture` store"),
            ("--data", self.data, "an `eyas prepare` output"),
            ("--eval-store", self.eval_store, "an `eyas capture` store"),
        ):
            if p is not None and input_must_exist() and not Path(p).is_dir():
                raise EyasError(f"{opt} {p} is not a directory (expected {what})")
        if self.resume not in (None, "auto") and not Path(self.resume).is_file():
            raise EyasError(f"--resume {self.resume}: no such checkpoint file (or pass `--resume auto`)")
        check_out_path(self.out)
        require_owned(self.out, kind="train")  # never checkpoints written into a store or a prepared dataset
        check_number(self, "tokens_per_batch", ge=1, optional=True)
        if self.tokens_per_batch is not None and self.batch_size is not None:
            raise EyasError(
                f"--batch-size {self.batch_size} and --tokens-per-batch {self.tokens_per_batch} both size "
                "a micro-batch: give one of them"
            )
        if self.tokens_per_batch is not None and self.tokens_per_batch < self.max_length:
            raise EyasError(
                f"--tokens-per-batch must be >= --max-length ({self.max_length}) so every sample fits "
                f"in a row, got {self.tokens_per_batch}"
            )


# ----------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, *, step_end: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train (see the module docstring). `step_end`: called with each step's index once its optimizer step is queued
    (a profiler's `step()`). On SIGINT/SIGTERM in the loop it stops after the current step
    with a checkpoint of it; every interrupt ends in `Interrupted`, whose message says what a rerun does.

    The process group (torchrun) is torn down here, once `_train`'s frame is gone (the DDP/FSDP module
    it held keeps the group alive): at the end of a run with a plain destroy, and when training raises
    (a bad batch, an EyasError, an interrupt, a collective failing because another rank stopped) with
    `dist.abort`, which cannot block on ranks still waiting in a collective and never raises, so the
    error that stopped the run is the one the CLI reports (exit 2 for an EyasError, 130 for an interrupt)."""
    from eyas.train import dist as dd

    stop = StopRequest()
    d = None
    had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        d = dd.setup(cfg.device)
        summary = _train(cfg, stop, d, step_end)
    except BaseException as exc:
        stop.restore()  # a Ctrl-C from here on is the default one (abort() does not let it replace this error)
        _clear_frames(exc)
        if (
            d is not None or not had_group
        ):  # (a group that existed before this run is the caller's, unless setup took it)
            dd.abort(d)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(_interrupted_message(cfg)) from None
        if d is not None and d.enabled and _peer_stopped(exc):
            msg = " ".join(str(exc).split())[:200]
            raise EyasError(
                f"rank {d.rank}: stopped because another rank of this job stopped first (its own error is "
                f"printed above; this rank's collective failed: {type(exc).__name__}: {msg})"
            ) from None
        raise
    finally:
        stop.restore()
    try:
        dd.teardown(d)
    except Exception as exc:  # the run is done and saved: a failed destroy is worth a line, not a failed command
        log(f"eyas: warning: destroying the process group after the run failed ({type(exc).__name__}: {exc})")
    if not d.is_main:
        # under torchrun every rank runs the CLI; only rank 0's summary may be the last stdout line
        import os
        import sys

        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (kept open: stdout for the rest of the process)
    return summary


def _train(cfg: TrainConfig, stop: StopRequest, d, step_end=None) -> dict[str, Any]:
    from eyas.drafter.ttt import TTTConfig
    from eyas.train import builders as b, checkpoint as ck, dist as dd
    from eyas.train.checks import claim_out
    from eyas.train.metrics import MetricsWriter
    from eyas.train.report import Reporter, save_final, summary
    from eyas.train.step import Trainer

    torch.manual_seed(cfg.seed)
    # -- 1. processes and devices (d: dd.setup's, in run(), which also tears the group down) --------
    dev = d.device
    bf16 = cfg.model_dtype == "bf16" or (cfg.model_dtype == "auto" and dev.type == "cuda")
    out, final_dir = claim_out(cfg)

    # -- 2. data (3. the store's checks before any step: in build_data) --------------------------
    tgt = b.describe_target(cfg)
    data = b.build_data(cfg, tgt, d, bf16=bf16)

    # -- 4. draft vocabulary and the drafter ----------------------------------------------------
    dcfg = b.drafter_config(cfg, tgt, data)  # (online: the sources open here, on the drafter's aux layers)
    train_src = data.train_src
    samples = b.scan_samples(cfg, train_src, tgt.vocab_size)
    drafter, vocab, head_w = b.build_drafter(cfg, dcfg, data, samples.counts, dev, bf16=bf16)
    ttt_cfg = TTTConfig(
        steps=cfg.ttt_steps,
        decay=cfg.ttt_decay,
        attention=cfg.attention,
        cast_once=cfg.ttt_cast_once,
        align_topk=cfg.align_topk,
        feature_loss=cfg.feature_loss,
    )
    b.log_drafter(
        cfg,
        d,
        bf16=bf16,
        dcfg=dcfg,
        ttt_cfg=ttt_cfg,
        drafter=drafter,
        vocab=vocab,
        samples=samples,
        vocab_size=tgt.vocab_size,
    )

    # -- 5. batches and the schedule's length -----------------------------------------------------
    batches = b.build_batches(cfg, d, samples.lengths, len(train_src))

    # -- 6. parallelism ---------------------------------------------------------------------------
    if cfg.compile or (cfg.compile is None and dev.type == "cuda"):
        from eyas.drafter.ttt.unroll import compile_drafter

        compile_drafter(drafter)
    module = PackedTTTModule(drafter, ttt_cfg, head_VtD=head_w)
    module = dd.wrap_model(module, d, fsdp=cfg.fsdp, bf16=bf16, grad_reduce=cfg.grad_reduce)
    params = [p for p in module.parameters() if p.requires_grad]

    # -- 7. optimizer, schedule and resume --------------------------------------------------------
    ckdir = out / "checkpoints"
    resume_path, state = b.open_resume(cfg, ckdir)
    optim = b.build_optimizer(cfg, module, dcfg.hidden_size, state, d, batches)
    identity = b.run_identity(
        cfg,
        ttt_cfg=ttt_cfg,
        dcfg=dcfg,
        global_batch=batches.plan.global_batch,
        fingerprint=data.fingerprint,
        vocab_used=vocab.used,
        optimizer=optim.name,
    )
    start = b.resume(cfg, state, resume_path, ckdir, identity=identity, module=module, optim=optim, d=d)
    del state

    # -- 8. loop ---------------------------------------------------------------------------------
    if cfg.overwrite and cfg.resume is None and d.is_main:  # the old run's checkpoints would mislead a later resume
        from eyas.common import remove_owned_dir

        remove_owned_dir(out, kind="train")
    metrics = MetricsWriter(out / "metrics.jsonl", enabled=d.is_main, append=start > 0)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 and not cfg.fsdp else nullcontext()
    reporter = Reporter(
        metrics,
        d=d,
        K=cfg.ttt_steps,
        weights=ttt_cfg.weights,
        total=batches.total,
        start=start,
        online=cfg.store is None,
    )
    trainer = Trainer(
        cfg=cfg,
        d=d,
        module=module,
        opt=optim.opt,
        sched=optim.sched,
        params=params,
        clip=_clip,
        plan=batches.plan,
        batches=batches,
        train_src=train_src,
        eval_src=data.eval_src,
        samples=samples,
        hidden=tgt.hidden,
        ttt_cfg=ttt_cfg,
        amp=amp,
        reporter=reporter,
        stop=stop,
        step_end=step_end,
        start=start,
        identity=identity,
        ckdir=ckdir,
    )
    trainer.run()

    # -- final drafter ----------------------------------------------------------------------------
    model_sd, _ = ck.full_state(module, optim.opt)
    if not d.is_main:
        return {}
    save_final(
        cfg,
        model_sd,
        out=out,
        final_dir=final_dir,
        dcfg=dcfg,
        target_id=tgt.identity,
        tok_hash=tgt.tok_hash,
        total=batches.total,
        global_batch=batches.plan.global_batch,
        lr=optim.lr,
        optimizer=optim.name,
        vocab=vocab,
    )
    return summary(
        reporter,
        out=out,
        final_dir=final_dir,
        total=batches.total,
        world=d.world,
        tokens_per_batch=batches.tokens_per_batch,
        vocab=vocab,
        train_src=train_src,
    )


def _clip(module, params, max_norm: float) -> torch.Tensor | float:
    """The gradients' global norm (after clipping them to `max_norm` when it is > 0), left on the device: read
    with the step's statistics, not before the optimizer step is queued (a read waits for the backward)."""
    if max_norm > 0:
        n = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return n.full_tensor() if hasattr(n, "full_tensor") else n  # FSDP2 returns a DTensor
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else 0.0
