"""`eyas train`: the training loop for the EAGLE-3 drafter (one process, one GPU or N under torchrun).

Order of work, each block labelled below:
  1. processes and devices (train/dist.py)          5. optimizer (train/optim.py), warmup + cosine
  2. data: offline store or online target           6. parallelism: DDP, or FSDP2 with --fsdp
  3. checks before any step (store vs target, ...)  7. resume: model, optimizer, scheduler, step, RNG
  4. draft vocabulary and the drafter               8. loop: accumulate, clip, step, log, eval, save
The final drafter is written with `Eagle3Drafter.save` to <out>/drafter.

Numerics: fp32 master weights; on CUDA the forward runs under bf16 autocast (FSDP2: bf16 params,
fp32 gradient reduction). Loss normalisation uses the GLOBAL batch's loss-mask counts per TTT step
(drafter/ttt.py), so a step is the same whatever the split into ranks and micro-batches.

Simulated acceptance length (eval): for each supervised position (one simulated drafting round),
accepted = the number of leading TTT steps whose draft top-1 equals the target's top-1 (inputs are
the data tokens, as in training); tau = 1 + mean accepted (the 1 is the target's bonus token).
It equals greedy chain-drafting tau when the data are the target's own greedy outputs.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from eyas.common import log
from eyas.errors import EyasError, Interrupted
from eyas.train.optim import OPTIMIZERS, make_optimizer

def default_tokens_per_batch(device: torch.device) -> int:
    """Packed tokens per micro-batch on CUDA when --tokens-per-batch is not given: the fastest
    measured for SmolLM2 online on a 141 GB GPU, 32,768 on GPUs with less than 64 GiB (its peak memory is a third)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return 131072 if total >= 64 * 2**30 else 32768


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
            raise EyasError("give exactly one of --store (offline, captured states) or --data (online, prepared dataset)")
        if self.store is None and self.eval_store is not None:
            raise EyasError("--eval-store is for offline training (--store); with --data the prepared dataset's "
                            "eval split is used: drop --eval-store, or train from a store")
        if self.store is not None and self.cache_states:
            raise EyasError("--cache-states keeps the target's states in online training (--data); with --store they "
                            "are read from the store: drop --cache-states")
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
            raise EyasError("--optimizer muon orthogonalizes whole matrices; --fsdp shards them: use DDP (drop --fsdp) "
                            "or --optimizer adamw")
        if self.fsdp and self.grad_reduce != "fp32":
            raise EyasError(f"--grad-reduce {self.grad_reduce} applies to DDP; --fsdp always reduces in fp32")
        check_device(self.device)
        if self.aux_layers is not None and any(i < 0 for i in self.aux_layers):
            raise EyasError(f"--aux-layers must be non-negative layer ids, got {self.aux_layers}")
        for opt, p, what in (("--store", self.store, "an `eyas capture` store"),
                             ("--data", self.data, "an `eyas prepare` output"),
                             ("--eval-store", self.eval_store, "an `eyas capture` store")):
            if p is not None and input_must_exist() and not Path(p).is_dir():
                raise EyasError(f"{opt} {p} is not a directory (expected {what})")
        if self.resume not in (None, "auto") and not Path(self.resume).is_file():
            raise EyasError(f"--resume {self.resume}: no such checkpoint file (or pass `--resume auto`)")
        check_out_path(self.out)
        require_owned(self.out, kind="train")  # never checkpoints written into a store or a prepared dataset
        check_number(self, "tokens_per_batch", ge=1, optional=True)
        if self.tokens_per_batch is not None and self.batch_size is not None:
            raise EyasError(f"--batch-size {self.batch_size} and --tokens-per-batch {self.tokens_per_batch} both size "
                            "a micro-batch: give one of them")
        if self.tokens_per_batch is not None and self.tokens_per_batch < self.max_length:
            raise EyasError(f"--tokens-per-batch must be >= --max-length ({self.max_length}) so every sample fits "
                            f"in a row, got {self.tokens_per_batch}")


def teacher_cache_bytes(device: torch.device) -> int:
    """How many bytes of draft-vocab teacher logits a step may keep for its TTT steps to share.

    Kept logits save one [rows x V] matmul per TTT step (7 of them a step at TTT 7); beyond the cap
    they are recomputed chunk by chunk. The cap is a constant per device, so memory still grows with
    tokens x hidden, not tokens x vocab, past it: a tenth of the GPU's memory, at most 16 GiB (an H200
    keeps a whole 131,072-token batch at a 32,000-token draft vocab: 8.4 GB), and 1 GiB elsewhere."""
    from eyas.drafter.ttt import TEACHER_CACHE_BYTES

    if device.type != "cuda":
        return TEACHER_CACHE_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return max(TEACHER_CACHE_BYTES, min(16 << 30, total // 10))


HEAD_CHUNK_ROWS = 8192
"""Rows a chunk of the heads' work (the drafter's head with its soft cross-entropy, the teacher's logits) holds at a
time: its [rows x vocab] logits are the head's whole extra memory, whatever the batch; larger chunks cost memory
and gain nothing, since the step is bound by the GPU, not by the chunks' launches."""


class PackedTTTModule(nn.Module):
    """The drafter plus its packed TTT loss as one forward(), so DDP/FSDP2 hooks see every use.

    The target's lm_head (`head_VtD`, frozen, not a parameter) turns the stored final states into
    teacher logits inside the forward, chunk by chunk (drafter/ttt.py, fast path; `chunk_rows`: HEAD_CHUNK_ROWS
    unless given)."""

    def __init__(self, drafter, ttt_cfg, *, head_VtD: torch.Tensor, chunk_rows: int | None = None):
        super().__init__()
        self.drafter = drafter
        self.ttt_cfg = ttt_cfg
        self.chunk_rows = chunk_rows or HEAD_CHUNK_ROWS
        self.teacher_cache_bytes = teacher_cache_bytes(head_VtD.device)
        self.set_teacher_head(head_VtD)

    def set_teacher_head(self, head_VtD: torch.Tensor) -> None:
        used = self.drafter.used_target_ids().to(head_VtD.device)
        t2d = self.drafter.t2d.to(head_VtD.device)
        self._head = (head_VtD, head_VtD.index_select(0, used), used, t2d)
        self._unused = None  # the rows outside the draft vocab, made on first use

    def teacher(self, final_ND):
        """The packed row's teacher (drafter/ttt.py packed_teacher) from its final states. (Made ahead of its step,
        on the side stream that brings the batch in, it did not pay.)"""
        from eyas.drafter import ttt

        head, head_used, used, t2d = self._head
        if self._unused is None:
            self._unused = ttt.unused_head(head, t2d)
        return ttt.packed_teacher(final_ND, head, head_used, used, t2d, chunk_rows=self.chunk_rows,
                                  cache_bytes=self.teacher_cache_bytes,
                                  unused=self._unused)

    def forward(self, input_ids_N, seg, rows, aux_NAD, final_ND, denominators, live=None):
        from eyas.drafter.ttt import ttt_loss_packed

        teacher = self.teacher(final_ND)
        out = ttt_loss_packed(self.drafter, input_ids_N=input_ids_N, seg=seg, rows=rows, aux_NAD=aux_NAD,
                              teacher=teacher, cfg=self.ttt_cfg, denominators=denominators,
                              chunk_rows=self.chunk_rows, live=live)
        stats = torch.cat([out.ce_sum, out.correct, out.valid, out.accepted.view(1), out.rounds.view(1)])
        return out.loss, stats


class TTTModule(nn.Module):
    """The reference path: padded rows and materialised teacher probabilities (tests, benchmarks)."""

    def __init__(self, drafter, ttt_cfg):
        super().__init__()
        self.drafter = drafter
        self.ttt_cfg = ttt_cfg

    def forward(self, input_ids_BT, loss_mask_BT, aux_BTAD, probs_BTV, top_BT, in_vocab_BT, denominators):
        from eyas.drafter.ttt import Teacher, ttt_loss

        out = ttt_loss(self.drafter, input_ids_BT=input_ids_BT, loss_mask_BT=loss_mask_BT, aux_BTAD=aux_BTAD,
                       teacher=Teacher(probs_BTV, top_BT, in_vocab_BT), cfg=self.ttt_cfg, denominators=denominators)
        stats = torch.cat([out.ce_sum, out.correct, out.valid, out.accepted.view(1), out.rounds.view(1)])
        return out.loss, stats


SMALL_DRAFTER_LR, SMALL_DRAFTER_MUON_LR, LARGE_DRAFTER_LR, LARGE_DRAFTER_HIDDEN = 1e-3, 2e-3, 1e-4, 2048


def default_optimizer(hidden_size: int, *, fsdp: bool) -> str:
    """--optimizer's default for a drafter of this hidden size (TrainConfig.optimizer): Muon for small drafters, whose
    Newton-Schulz iterations cost little beside a step; AdamW for large ones and under --fsdp."""
    return "muon" if hidden_size < LARGE_DRAFTER_HIDDEN and not fsdp else "adamw"


def default_lr(hidden_size: int, optimizer: str) -> float:
    """--lr's default for a drafter of this hidden size trained with this optimizer (TrainConfig.lr)."""
    if hidden_size >= LARGE_DRAFTER_HIDDEN:
        return LARGE_DRAFTER_LR
    return SMALL_DRAFTER_MUON_LR if optimizer == "muon" else SMALL_DRAFTER_LR


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _fmt_eta(s: float) -> str:
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 else f"{s:.0f}s"


class StopRequest:
    """SIGINT/SIGTERM during the loop: the current step finishes, a checkpoint is saved, and the run
    stops (`signum` is set; the loop reads it between steps). A second signal (SIGINT or SIGTERM)
    stops at once, without that checkpoint. Handlers can only be installed from the main thread;
    elsewhere signals keep their default behaviour."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._old.clear()

    def _handle(self, signum, frame):
        # no logging here: the handler may run in the middle of the loop's own write to stderr
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = self.signum or signum


def start_compile_workers_shielded() -> None:
    """Start torch inductor's compile workers now, with SIGINT and SIGTERM ignored (a disposition they
    inherit), instead of at the first compile inside the loop.

    A SIGTERM sent to the whole process group (`timeout`, a batch scheduler's preemption) otherwise
    kills those workers while the run itself, asked to stop, finishes its step; a compile after that
    (the final evaluation's first) sends its jobs to the dead workers, whose replies never come: the
    parent keeps both ends of their pipes open, so no end of file is read (read from torch's code). On
    an H200 a SmolLM2 run under `timeout 120` hung 20 minutes at its final evaluation, until killed,
    with the workers' process dead and unreaped and a thread blocked reading its pipe. Shielded, the
    workers live until the run exits (they end when their parent's pipe closes). Uses torch's own
    warm-up (`maybe_warm_pool`), so nothing starts where torch would not start a pool
    (TORCH_WARM_POOL=0, no Triton); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # (a torch without inductor's pool: nothing to shield)
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        maybe_warm_pool()
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _continue_hint(cfg: TrainConfig) -> str:
    return "rerun the same command" if cfg.resume == "auto" else "rerun the same command with --resume auto"


def _interrupted_message(cfg: TrainConfig) -> str:
    """What an interrupt outside the loop's clean stop leaves: the latest checkpoint, if any."""
    from eyas.train.checkpoint import CKPT_RE, latest_checkpoint

    path = latest_checkpoint(Path(cfg.out) / "checkpoints")
    if path is None:
        return "no training step was saved, so a rerun starts from step 0"
    step = int(CKPT_RE.match(path.name).group(1))
    return f"the latest checkpoint is {path} (step {step}); {_continue_hint(cfg)} to continue from it"


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
        if d is not None or not had_group:  # (a group that existed before this run is the caller's, unless setup took it)
            dd.abort(d)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(_interrupted_message(cfg)) from None
        if d is not None and d.enabled and _peer_stopped(exc):
            msg = " ".join(str(exc).split())[:200]
            raise EyasError(f"rank {d.rank}: stopped because another rank of this job stopped first (its own error is "
                            f"printed above; this rank's collective failed: {type(exc).__name__}: {msg})") from None
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

        sys.stdout = open(os.devnull, "w")
    return summary


def _peer_stopped(exc: BaseException) -> bool:
    """A collective that failed because another rank left the group (gloo: the peer's connection closed or
    reset; NCCL: the communicator aborted by the peer's teardown), not an error of this rank's own."""
    text = str(exc)  # (by its words: a DistBackendError can also be this rank's own, a CUDA error in NCCL say)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("by peer", "Connection closed", "Connection reset", "communicator was aborted"))


def _clear_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames in exc's traceback (and those of its cause and
    context): the failed run's model, optimizer and DDP reducer go now, not when the traceback does, so
    the process group they reference can be freed by the teardown. Line numbers stay for printing."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # skips the frames still running (run's own)
        if exc.__cause__ is not None and id(exc.__cause__) not in seen:
            _clear_frames(exc.__cause__)
        exc = exc.__context__


def _train(cfg: TrainConfig, stop: StopRequest, d, step_end=None) -> dict[str, Any]:
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.drafter.ttt import TTTConfig
    from eyas.drafter.vocab import build_draft_vocab, count_assistant_tokens
    from eyas.train import checkpoint as ck
    from eyas.train import dist as dd
    from eyas.train.data import (
        HostCopies,
        OnlineSource,
        PackedPrefetcher,
        Plan,
        StoreSource,
        TokenPlan,
        open_store,
        read_target_tensors,
        store_order,
        target_seconds,
    )
    from eyas.packing import to_device
    from eyas.train.metrics import MetricsWriter, plot_curves

    torch.manual_seed(cfg.seed)
    # -- 1. processes and devices (d: dd.setup's, in run(), which also tears the group down) --------
    dev = d.device
    bf16 = cfg.model_dtype == "bf16" or (cfg.model_dtype == "auto" and dev.type == "cuda")
    out = Path(cfg.out)
    from eyas.locks import hold

    hold(out)  # one writer of the run folder (under torchrun, rank 0 holds it for the job)
    final_dir = out / "drafter"
    if final_dir.exists() and not cfg.overwrite and cfg.resume is None:
        raise EyasError(f"{final_dir} already exists (a finished run): pass --overwrite, --resume auto, or another --out")
    if not cfg.overwrite and cfg.resume is None and (earlier := ck.latest_checkpoint(out / "checkpoints")) is not None:
        raise EyasError(f"--out {out} holds another run's checkpoints ({earlier.name}); a new run would replace them: "
                        "pass --resume auto to continue that run, --overwrite to start over, or choose another --out")

    # -- 2. data ------------------------------------------------------------------------------
    from eyas.defaults import resolve_target
    from eyas.target import (
        load_target,
        load_tokenizer,
        model_identity,
        num_layers_of,
        tokenizer_hash,
    )

    target_dir = resolve_target(cfg.target)
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target_dir)
    tok_hash = tokenizer_hash(load_tokenizer(target_dir))
    target_id = model_identity(target_dir)
    tcfg_text = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    n_layers, hidden = num_layers_of(tcfg), int(tcfg_text.hidden_size)
    check_options_fit_target(target_dir, aux_layers=cfg.aux_layers, draft_vocab=cfg.draft_vocab, tcfg=tcfg)
    target_model = None
    if cfg.store is not None:
        reader, split, man = open_store(cfg.store, prepared=cfg.data)
        # -- 3. checks before any step --
        _check_store(man, cfg.store, n_layers=n_layers, hidden=hidden, tok_hash=tok_hash, target_id=target_id)
        _check_store_layers(reader, split, target_dir, dev, bf16=bf16, is_main=d.is_main)
        aux_ids = list(man["aux_layer_ids"])
        order = store_order(reader, split)
        state_dtype = torch.bfloat16 if bf16 else torch.float32
        if cfg.eval_store is not None:
            ereader, esplit, eman = open_store(cfg.eval_store)
            _check_store(eman, cfg.eval_store, n_layers=n_layers, hidden=hidden, tok_hash=tok_hash, target_id=target_id)
            eval_src = StoreSource(ereader, esplit, store_order(ereader, esplit)[: cfg.eval_samples],
                                   max_length=cfg.max_length, dtype=state_dtype)
            train_order = order
        else:
            g = torch.Generator().manual_seed(cfg.seed + 7)
            perm = torch.randperm(len(order), generator=g).tolist()
            n_hold = min(cfg.eval_samples, len(order) // 10)
            hold = set(perm[:n_hold])
            train_order = [o for i, o in enumerate(order) if i not in hold]
            eval_src = StoreSource(reader, split, [order[i] for i in perm[:n_hold]], max_length=cfg.max_length,
                                   dtype=state_dtype) if n_hold else None
            log(f"offline: no --eval-store; holding out {n_hold} of {len(order)} store samples for eval")
        train_src = StoreSource(reader, split, train_order, max_length=cfg.max_length, dtype=state_dtype)
        data_fp = {"store": man.get("prepared", {}).get("fingerprint"), "samples": len(train_order)}
        tensors = read_target_tensors(target_dir)
    else:
        from eyas.data.prepared import PreparedDataset

        ds = PreparedDataset(cfg.data)
        if ds.tokenizer_hash and ds.tokenizer_hash != tok_hash:
            raise EyasError(f"--data {cfg.data} was tokenised with another tokenizer (hash {ds.tokenizer_hash[:12]}) "
                            f"than target {target_dir} ({tok_hash[:12]}); run `eyas prepare --target {cfg.target}` again")
        split = ds.split("train")
        aux_ids = None
        target_model = load_target(target_dir, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
        for p in target_model.parameters():
            p.requires_grad_(False)
        tensors = {"embed": target_model.get_input_embeddings().weight.detach(),
                   "lm_head": target_model.get_output_embeddings().weight.detach()}
        norm = getattr(getattr(target_model, "model", None), "norm", None)
        if norm is not None:
            tensors["final_norm"] = norm.weight.detach()
        data_fp = {"data": split.fingerprint, "samples": len(split)}
        train_src = None  # built once aux ids are known
        esplit = ds.split("eval") if "eval" in ds.split_names else None
    n_train = len(train_src) if train_src is not None else len(split)
    if n_train == 0:
        raise EyasError(f"the training split is empty ({cfg.store or cfg.data}); prepare/capture some samples first")

    # -- 4. draft vocabulary and the drafter ----------------------------------------------------
    vocab_size = int(tcfg_text.vocab_size)
    if cfg.store is not None and cfg.aux_layers and list(cfg.aux_layers) != aux_ids:
        raise EyasError(f"--aux-layers {cfg.aux_layers} differs from the store's {aux_ids}; offline training uses "
                        "the layers the store holds (drop --aux-layers or capture those layers)")
    try:
        wider = {"intermediate_size": cfg.draft_intermediate_size} if cfg.draft_intermediate_size else {}
        dcfg = DrafterConfig.from_target_config(tcfg, draft_vocab_size=cfg.draft_vocab,
                                                aux_layer_ids=aux_ids or cfg.aux_layers, **wider)
    except EyasError:
        raise
    except ValueError as exc:  # DrafterConfig names the field; say which target it came from
        raise EyasError(f"target {target_dir}: cannot build a drafter config ({exc})") from exc
    if cfg.store is None:
        aux_ids = dcfg.aux_layer_ids
        train_src = OnlineSource(split, list(range(len(split))), model=target_model, layer_ids=aux_ids,
                                 max_length=cfg.max_length)
        eval_src = (OnlineSource(esplit, list(range(min(len(esplit), cfg.eval_samples))), model=target_model,
                                 layer_ids=aux_ids, max_length=cfg.max_length) if esplit is not None and len(esplit) else None)
    if tensors["embed"].shape != (vocab_size, dcfg.hidden_size):
        raise EyasError(f"target {target_dir}: embedding {tuple(tensors['embed'].shape)} does not match its config "
                        f"(vocab {vocab_size} x hidden {dcfg.hidden_size})")
    K = cfg.ttt_steps
    train_items = [train_src.item(i) for i in range(len(train_src))]
    counts = count_assistant_tokens(train_items, vocab_size)
    den_table = _step_counts([it.loss_mask for it in train_items], K)  # [n, K] loss-mask positions per step
    lengths = [int(it.input_ids.shape[0]) for it in train_items]
    item_ids = [it.id for it in train_items]
    del train_items
    if int(counts.sum()) == 0:
        if max(lengths) >= cfg.max_length:  # samples were cut: the assistant turns may lie past the cut
            raise EyasError(f"--max-length {cfg.max_length} leaves no loss-masked (assistant) tokens in the training "
                            f"split ({cfg.store or cfg.data}): samples are cut to their first {cfg.max_length} tokens, "
                            "before any answer; raise --max-length")
        raise EyasError(f"the training split has no loss-masked (assistant) tokens ({cfg.store or cfg.data}); nothing to learn")
    vocab = build_draft_vocab(counts, dcfg.draft_vocab_size)
    drafter = Eagle3Drafter(dcfg)
    drafter.reset_parameters(seed=cfg.seed)
    drafter.set_vocab(vocab.used)
    drafter.init_from_target(tensors["embed"].float().cpu(),
                             tensors["lm_head"].float().cpu() if cfg.init_head else None,
                             tensors.get("final_norm").float().cpu() if cfg.init_head and "final_norm" in tensors else None)
    drafter.to(dev)
    head_w = tensors["lm_head"]
    if cfg.teacher_temperature != 1.0:  # the teacher's logits / T: the head scaled once (its argmax unchanged)
        head_w = head_w.float() / cfg.teacher_temperature
    head_w = head_w.to(dev, torch.bfloat16 if bf16 else torch.float32)
    del tensors
    ttt_cfg = TTTConfig(steps=cfg.ttt_steps, decay=cfg.ttt_decay, attention=cfg.attention,
                        cast_once=cfg.ttt_cast_once, align_topk=cfg.align_topk, feature_loss=cfg.feature_loss)
    if dev.type == "cuda" and cfg.attention == "fast":
        from eyas.packing import check_varlen_kernel, pick_varlen_kernel

        err = check_varlen_kernel(dev, torch.bfloat16 if bf16 else torch.float32)
        if d.is_main:
            probe = torch.empty(1, 1, 1, dcfg.head_dim, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
            log(f"packed attention kernel: {pick_varlen_kernel(probe)} (check vs exact: max |diff| {err:.4f})")
    if bf16 and not cfg.fsdp and d.is_main:  # (FSDP2 keeps bf16 parameters: nothing to cast)
        once = ttt_cfg.cast_once_for(dcfg.hidden_size)
        log(f"TTT weights: {'cast to bf16 once a forward, gradients summed inside the matmuls' if once else 'cast by each step'}"
            f" ({'set' if cfg.ttt_cast_once is not None else f'default for hidden size {dcfg.hidden_size}'})")
    if d.is_main:
        log(f"draft vocab: {vocab.size} of {vocab_size} target ids, coverage {vocab.coverage():.4f} of "
            f"{int(counts.sum())} assistant tokens; drafter {drafter.num_trainable_params() / 1e6:.1f}M trainable params")

    # -- 5. optimizer and schedule -------------------------------------------------------------
    tokens_per_batch = cfg.tokens_per_batch or (default_tokens_per_batch(dev)
                                                if dev.type == "cuda" and cfg.batch_size is None else None)
    batch_size = cfg.batch_size or 1
    if tokens_per_batch is not None:
        tokens_per_batch = max(tokens_per_batch, min(cfg.max_length, max(lengths)))
        plan = TokenPlan(lengths=lengths, tokens_per_batch=tokens_per_batch, accum=cfg.grad_accum, world=d.world,
                         seed=cfg.seed)
    else:
        plan = Plan(n=len(train_src), micro_batch=batch_size, accum=cfg.grad_accum, world=d.world, seed=cfg.seed)
    if d.is_main:
        log(f"batches: {'%d tokens' % tokens_per_batch if tokens_per_batch else '%d samples' % batch_size} per "
            f"micro-batch (packed rows), {plan.steps_per_epoch} steps per epoch")
    total = cfg.steps or max(1, math.ceil(cfg.epochs * plan.steps_per_epoch))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, total // 50)
    if cfg.compile or (cfg.compile is None and dev.type == "cuda"):
        from eyas.drafter.ttt import compile_drafter

        compile_drafter(drafter)
    module = PackedTTTModule(drafter, ttt_cfg, head_VtD=head_w)
    module = dd.wrap_model(module, d, fsdp=cfg.fsdp, bf16=bf16, grad_reduce=cfg.grad_reduce)
    params = [p for p in module.parameters() if p.requires_grad]
    ckdir = out / "checkpoints"
    resume_path = (ck.latest_checkpoint(ckdir) if cfg.resume == "auto" else Path(cfg.resume)) if cfg.resume else None
    state = ck.load_checkpoint(resume_path) if resume_path is not None else None
    optimizer = cfg.optimizer or (state["identity"].get("optimizer", "adamw") if state is not None
                                  else default_optimizer(dcfg.hidden_size, fsdp=cfg.fsdp))
    lr = default_lr(dcfg.hidden_size, optimizer) if cfg.lr is None else cfg.lr
    if d.is_main:
        why = "set" if cfg.optimizer else "the checkpoint's" if state is not None else "default"
        log(f"optimizer: {optimizer} ({why}), peak lr {lr:g} ({'set' if cfg.lr is not None else 'default'})")
    opt = make_optimizer(module, optimizer, lr=lr, weight_decay=cfg.weight_decay,
                         fused=dev.type == "cuda" and not cfg.fsdp)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio))

    # -- 7. resume ------------------------------------------------------------------------------
    later = ("align_topk", "feature_loss")  # (in the identity below, only when set)
    ttt_id = {k: v for k, v in asdict(ttt_cfg).items() if k not in later} | {"attention": None}
    identity = {"drafter": dcfg.to_dict(), "ttt": ttt_id, "global_batch": plan.global_batch,
                "data": data_fp, "seed": cfg.seed, "draft_vocab_sha": _vocab_sha(vocab.used)}
    # (absent at the values runs had before these settings existed, temperature 1, no mask, no feature loss, AdamW:
    # their checkpoints still resume with those values)
    if cfg.teacher_temperature != 1.0:
        identity["teacher_temperature"] = cfg.teacher_temperature
    if cfg.align_topk:
        identity["align_topk"] = cfg.align_topk
    if cfg.feature_loss:
        identity["feature_loss"] = cfg.feature_loss
    if optimizer != "adamw":
        identity["optimizer"] = optimizer
    start = 0
    if cfg.resume and state is None:
        log(f"--resume auto: no checkpoint in {ckdir}; starting from step 0")
    elif state is not None:
        ck.check_identity(state["identity"], identity, resume_path)
        ck.restore(state, model=module, optimizer=opt, scheduler=sched)
        start = int(state["step"])
        if d.is_main:
            log(f"resumed from {resume_path} at step {start}")
        del state

    # -- 8. loop ---------------------------------------------------------------------------------
    if cfg.overwrite and cfg.resume is None and d.is_main:  # the old run's checkpoints would mislead a later resume
        from eyas.common import remove_owned_dir

        remove_owned_dir(out, kind="train")
    metrics = MetricsWriter(out / "metrics.jsonl", enabled=d.is_main, append=start > 0)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 and not cfg.fsdp else nullcontext()
    world_scale = float(d.world)  # DDP/FSDP average gradients; our loss is already a global mean
    t_run, tok_run, sup_run, pad_run, target_run = time.perf_counter(), 0, 0, 0, 0.0
    done_last, evals = metrics.last() if start > 0 else (None, [])  # a finished run's rerun reports its figures
    last: dict[str, Any] = done_last or {}

    def forward_batch(batch, denoms):
        with amp:
            return module(batch.input_ids_N, batch.seg, batch.rows, batch.aux_NAD, batch.final_ND, denoms, batch.live)

    def micro_items(step):
        """[accum] item lists of this rank; a rank left without samples gets a loss-free dummy."""
        first = train_src.item(plan.step_indices(step)[0])
        return [[train_src.item(i) for i in idx] or [_dummy(first)] for idx in plan.micro_indices(step, d.rank)]

    def report(step, stats, counts_t, denoms, gnorm, lr_s, timings, waited: float = 0.0) -> bool:
        """Read a step's statistics back (this waits for the GPU to finish it), write its metrics record and log
        line; True when a process asked to stop. `waited`: seconds the host already waited for them (a deferred
        read's copies); the record's `host_wait_s` adds the wait here (well above 0: the GPU bounds the step; near 0
        the host did not wait here, as when it waits in kernel launches behind a full GPU queue instead)."""
        nonlocal tok_run, pad_run, sup_run, target_run, last, t_last
        ce, correct, valid = stats[:K], stats[K:2 * K], stats[2 * K:3 * K]
        den = denoms.double().clamp_min(1)
        t0 = time.perf_counter()
        loss_k = (ce / den).tolist()  # synchronises: the step (and the side-stream target) is done
        waited += time.perf_counter() - t0
        loss_v = sum(w * l for w, l in zip(ttt_cfg.weights, loss_k))
        acc_k = (correct / valid.clamp_min(1)).tolist()
        tokens, padded, supervised, stopping = (int(x) for x in counts_t.tolist())
        target_s = sum(target_seconds(t) for t in timings)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        tok_run, pad_run, sup_run, target_run = tok_run + tokens, pad_run + padded, sup_run + supervised, target_run + target_s
        wall = now - t_run
        rate = tok_run / wall
        eta = (total - step - 1) * wall / (step + 1 - start)
        last = {"step": step + 1, "loss": loss_v, "loss_per_step": loss_k, "acc_per_step": acc_k,
                "lr": lr_s, "grad_norm": float(gnorm), "tokens": tokens, "padded_tokens": padded,
                "supervised_tokens": supervised, "step_s": dt, "host_wait_s": waited, "tokens_per_s": rate,
                "supervised_tokens_per_s": sup_run / wall, "useful_fraction": tok_run / max(pad_run, 1),
                "target_share": target_run / wall if train_src is not None and cfg.store is None else 0.0}
        metrics.write(last)
        if d.is_main:
            accs = " ".join(f"{a:.2f}" for a in acc_k[:min(K, 4)])
            extra = f" | target {last['target_share']:.0%}" if cfg.store is None else ""
            log(f"step {step + 1:05d}/{total:05d} | loss {loss_v:.3f} | acc {accs} | {_fmt_rate(rate)} tok/s "
                f"({_fmt_rate(last['supervised_tokens_per_s'])} supervised) | useful {last['useful_fraction']:.2f}"
                f"{extra} | eta {_fmt_eta(eta)}")
        return bool(stopping)

    if dev.type == "cuda":  # before the first compile (the online target's first forward, queued just below)
        start_compile_workers_shielded()
    prefetch = PackedPrefetcher(train_src, (items for s in range(start, total) for items in micro_items(s)), dev,
                                steps=K, pad_to=tokens_per_batch)
    stop.install()
    # a step whose statistics are read once the next one is queued, so the GPU never idles while the host logs and
    # prepares a step: they are copied to pinned host memory behind the step (`HostCopies`), and the read waits for
    # that copy alone; the records and log lines are then one step late (never at an evaluation, a checkpoint, the
    # last step or a stop in one process, which read at once); with several ranks, a stop asked during step s ends
    # the run after step s + 1 on every rank alike
    pending = None
    t_last = time.perf_counter()
    for step in range(start, total):
        micro = plan.micro_indices(step, d.rank)
        # no step waits for the GPU before its statistics are read at its end: a plain host-to-device copy waits
        # for all the work queued before it (so do float() and tolist()), so the small per-step tensors go
        # through pinned memory and the gradient norm is read with the statistics
        denoms = to_device(torch.from_numpy(den_table[plan.step_indices(step)].sum(0)), dev)
        stats = torch.zeros(3 * K + 2, dtype=torch.float64, device=dev)
        # real, padded, supervised tokens; stop requests (summed with them, so every rank stops after the same step)
        counts = [0, 0, 0, 0]
        batches = []
        for m, idx in enumerate(micro):
            batch = prefetch.next_batch()
            sync = m == len(micro) - 1
            ctx = module.no_sync() if (d.enabled and not cfg.fsdp and not sync) else nullcontext()
            if cfg.fsdp:
                module.set_requires_gradient_sync(sync)
            with ctx:  # (named ranges: a profile's table splits the step's GPU time by them)
                with torch.profiler.record_function("eyas.drafter_forward"):
                    loss, st = forward_batch(batch, denoms)
                with torch.profiler.record_function("eyas.drafter_backward"):
                    (loss * world_scale).backward()
            stats += st.double()
            if idx:
                counts[0] += batch.tokens
                counts[1] += batch.padded_tokens
                counts[2] += batch.supervised
            batches.append(batch)
        with torch.profiler.record_function("eyas.optimizer"):
            gnorm = _clip(module, params, cfg.grad_clip)
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step_end is not None:
            step_end(step)
        if step == start and isinstance(train_src, OnlineSource) and cfg.cache_states is not False:
            _start_state_cache(cfg, train_src, item_ids, lengths, hidden=hidden, dev=dev,
                               epochs=(total - start) / plan.steps_per_epoch, log_it=d.is_main)
        if stop.signum is not None:
            counts[3] = 1
        counts_t = to_device(torch.tensor(counts, dtype=torch.float64), dev)
        dd.all_reduce_sum(stats, d)
        dd.all_reduce_sum(counts_t, d)
        readings = (step, stats, counts_t, denoms, gnorm, sched.get_last_lr()[0], [b.target_timing for b in batches])
        if pending is not None:  # the step before's, one step late
            t0 = time.perf_counter()
            got = pending.get()
            stop_seen = report(*got, waited=time.perf_counter() - t0)
        else:
            stop_seen = False
        pending = None
        done = step + 1 == total
        eval_due = eval_src is not None and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or done)
        save_due = bool(cfg.save_every and (step + 1) % cfg.save_every == 0) or done
        stop_here = d.world == 1 and stop.signum is not None  # (ranks agree on a stop through the statistics only)
        if not (done or eval_due or save_due or stop_seen or stop_here):
            pending = HostCopies(readings)  # read once the next step is queued, waiting for this one alone
            continue
        stopping = report(*readings) or stop_seen
        if eval_due and not (stopping and not done):  # (a run that stops here saves and ends: no evaluation first)
            ev = evaluate(module, eval_src, forward_batch=forward_batch, K=K, weights=ttt_cfg.weights, d=d,
                          tokens_per_batch=tokens_per_batch or batch_size * cfg.max_length, device=dev)
            ev["step"] = step + 1
            evals.append(ev)
            metrics.write({"eval": True, **ev})
            if d.is_main:
                log(f"eval  {step + 1:05d} | loss {ev['loss']:.3f} | acc "
                    + " ".join(f"{a:.2f}" for a in ev["acc_per_step"]) + f" | tau {ev['acceptance_length']:.2f}")
        ck_path = ckdir / f"step-{step + 1:06d}.safetensors"
        if save_due or stopping:
            p = ck.save_checkpoint(ck_path, model=module, optimizer=opt, scheduler=sched, step=step + 1,
                                   identity=identity, extra={"world": d.world}, is_main=d.is_main)
            if p is not None:
                log(f"checkpoint {p}")
                ck.prune_checkpoints(ckdir, keep=cfg.keep_checkpoints)
        if stopping and not done:
            prefetch.close()
            raise Interrupted(f"stopped after step {step + 1} of {total}, saved in {ck_path}; "
                              f"{_continue_hint(cfg)} to continue from there")

    stop.restore()  # the final save is quick; an interrupt there leaves the last step's checkpoint to resume from
    prefetch.close()

    # -- final drafter ----------------------------------------------------------------------------
    model_sd, _ = ck.full_state(module, opt)
    summary: dict[str, Any] = {}
    if d.is_main:
        from eyas.common import require_finite

        require_finite(dict(model_sd), what="the final drafter")
        final = Eagle3Drafter(dcfg)
        final.load_state_dict({k.removeprefix("drafter."): v for k, v in model_sd.items()})
        final.save(final_dir, target={**target_id, "tokenizer_hash": tok_hash},
                   extra={"training": {"steps": total, "global_batch": plan.global_batch, "lr": lr,
                                       "teacher_temperature": cfg.teacher_temperature,
                                       "align_topk": cfg.align_topk, "feature_loss": cfg.feature_loss,
                                       "optimizer": optimizer,
                                       "ttt_steps": K, "source": "store" if cfg.store else "online",
                                       "vocab": vocab.report()}})
        plot_curves(out / "metrics.jsonl", out / "curves.png")
        summary = {"out": str(out), "drafter": str(final_dir), "steps": total, "world": d.world,
                   "final_loss": last.get("loss"), "acc_per_step": last.get("acc_per_step"),
                   "tokens_per_s": last.get("tokens_per_s"),
                   "supervised_tokens_per_s": last.get("supervised_tokens_per_s"),
                   "useful_fraction": last.get("useful_fraction"), "target_share": last.get("target_share"),
                   "tokens_per_batch": tokens_per_batch, "vocab": vocab.report(),
                   "state_cache": getattr(train_src, "cache", None) is not None,
                   "target_forwards": getattr(train_src, "target_forwards", None),
                   "eval": evals[-1] if evals else None, "metrics": str(out / "metrics.jsonl"),
                   "plot": str(out / "curves.png")}
    return summary


@torch.no_grad()
def evaluate(module, src, *, forward_batch, K: int, weights, d, tokens_per_batch: int, device) -> dict[str, Any]:
    """Per-step top-1 accuracy, loss and simulated acceptance length on the eval source (sharded by
    rank, packed into rows of at most `tokens_per_batch` tokens)."""
    from eyas.train.data import StoreSource, _packed_to, cut_by_tokens, online_packed, store_packed
    from eyas.train.dist import all_reduce_sum

    was = module.training
    module.eval()
    stats = torch.zeros(3 * K + 2, dtype=torch.float64, device=device)
    den = torch.zeros(K, dtype=torch.float64, device=device)
    mine = [src.item(i) for i in range(d.rank, len(src), d.world)]
    lengths = [int(it.input_ids.shape[0]) for it in mine]
    rows = [[mine[i] for i in run] for run in cut_by_tokens(list(range(len(mine))), lengths, tokens_per_batch)]
    n_rows = torch.tensor([len(rows)], dtype=torch.float64, device=device)
    if d.enabled:  # equal count on every rank (collectives inside the FSDP forward)
        import torch.distributed as tdist

        tdist.all_reduce(n_rows, op=tdist.ReduceOp.MAX)
    for b in range(int(n_rows)):
        items = rows[b] if b < len(rows) else [_dummy(src.item(0))]
        if isinstance(src, StoreSource):
            batch = _packed_to(store_packed(src, items, steps=K, pad_to=None), device)
        else:
            batch = online_packed(src, items, device, steps=K, pad_to=None)
        dn = torch.tensor([float(len(r)) for r in batch.rows], dtype=torch.float64, device=device)
        _, st = forward_batch(batch, dn)
        stats += st.double()
        den += dn
    all_reduce_sum(stats, d)
    all_reduce_sum(den, d)
    module.train(was)
    ce, correct, valid = stats[:K], stats[K:2 * K], stats[2 * K:3 * K]
    accepted, rounds = float(stats[3 * K]), float(stats[3 * K + 1])
    loss_k = (ce / den.clamp_min(1)).tolist()
    return {"loss": sum(w * l for w, l in zip(weights, loss_k)), "loss_per_step": loss_k,
            "acc_per_step": (correct / valid.clamp_min(1)).tolist(),
            "acceptance_length": 1.0 + accepted / max(rounds, 1.0), "rounds": int(rounds), "samples": len(src)}


def _start_state_cache(cfg: TrainConfig, src, ids: list[str], lengths: list[int], *, hidden: int, dev: torch.device,
                       epochs: float, log_it: bool) -> None:
    """After the first step (its memory peak measured): give the online source a StateCache when
    asked (--cache-states) or, by default, when the run reads its samples more than once and the
    cache fits on the GPU beside that peak (10% and 4 GiB to spare)."""
    from eyas.train.data import StateCache

    A, D = len(src.layer_ids), hidden
    dtype = next(src.model.parameters()).dtype
    need = StateCache.bytes_needed(lengths, n_aux=A, hidden=D, dtype=dtype)
    what = f"{need / 1e9:.1f} GB for {len(ids):,} samples"
    why = None
    if cfg.cache_states is None and epochs <= 1:
        why = "the run reads each sample once"
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        peak = torch.cuda.max_memory_reserved(dev)
        room = total - int(peak * 1.1) - (4 << 30)
        if need > room:
            why = f"{what} do not fit beside the first step's {peak / 1e9:.1f} GB on {total / 1e9:.0f} GB"
            if cfg.cache_states:
                raise EyasError(f"--cache-states: {why}; drop it or lower --tokens-per-batch")
    elif cfg.cache_states is None:
        why = "off by default on the CPU (--cache-states turns it on)"
    if why is not None:
        if log_it:
            log(f"state cache: off ({why})")
        return
    src.cache = StateCache(ids, lengths, n_aux=A, hidden=D, dtype=dtype, device=dev)
    if log_it:
        log(f"state cache: on, {what}: after the first epoch the target runs only for samples not yet seen")


def check_options_fit_target(target: str | Path, *, aux_layers: list[int] | None = None,
                             draft_vocab: int | None = None, tcfg=None) -> None:
    """--aux-layers and --draft-vocab against the target's config (`tcfg`, else read from its config.json;
    no weights), so a run that cannot fit fails before any model loads (train, and the demo before its stages)."""
    from eyas.drafter.layouts import check_layer_ids
    from eyas.target import num_layers_of

    if tcfg is None:
        from transformers import AutoConfig

        from eyas.defaults import resolve_target

        tcfg = AutoConfig.from_pretrained(resolve_target(target))
    text = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    if aux_layers:
        check_layer_ids(aux_layers, num_layers_of(tcfg), what=f"--aux-layers (target {target})")
    vocab = int(text.vocab_size)
    if draft_vocab is not None and draft_vocab > vocab:
        raise EyasError(f"--draft-vocab {draft_vocab} exceeds the vocabulary of target {target} ({vocab} tokens); "
                        f"pass at most {vocab}")


def _check_store(man: dict, path, *, n_layers: int, hidden: int, tok_hash: str, target_id: dict) -> None:
    from eyas.store.format import manifest_fields_problem
    from eyas.target import CONVENTION

    if (problem := manifest_fields_problem(man, Path(path))) is not None:
        raise EyasError(problem)
    if int(man.get("hidden_size", -1)) != hidden:
        raise EyasError(f"store {path} holds hidden size {man.get('hidden_size')}, target has {hidden}: "
                        "it was captured from another model; pass the matching --target or capture again")
    if man.get("convention", CONVENTION) != CONVENTION:
        raise EyasError(f"store {path}: layer convention {man.get('convention')!r}, expected {CONVENTION!r}")
    ids = list(man.get("aux_layer_ids") or [])
    if not ids or max(ids) >= n_layers:
        raise EyasError(f"store {path} holds aux layers {ids}, which do not fit a target with {n_layers} layers: "
                        "it was captured from another model")
    if man.get("tokenizer_hash") and man["tokenizer_hash"] != tok_hash:
        raise EyasError(f"store {path} was captured with another tokenizer (hash {man['tokenizer_hash'][:12]}) than "
                        f"the target's ({tok_hash[:12]}); pass the matching --target or capture again")
    t = man.get("target") or {}
    if t.get("config_sha256") and t["config_sha256"] != target_id["config_sha256"]:
        raise EyasError(f"store {path} was captured from target {t.get('path')} whose config differs from "
                        f"{target_id['path']}; pass the matching --target or capture again")
    if t.get("weights_index_sha256") and t["weights_index_sha256"] != target_id["weights_index_sha256"]:
        log(f"warning: store {path} was captured from a target whose weight files differ from {target_id['path']}")


def _check_store_layers(reader, split, target_dir: Path, dev: torch.device, *, bf16: bool, is_main: bool) -> None:
    """Refuse a store whose states are other layers than its manifest names (store.invariants.layer_ids_problem):
    a forward of a few tokens, skipped where the target would not fit beside training (a huge target's store is
    checked by `eyas verify` only)."""
    import gc

    from eyas.store.invariants import layer_ids_problem
    from eyas.target import load_target

    weights = sum(f.stat().st_size for f in Path(target_dir).glob("*.safetensors"))
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if weights > free // 2:  # the target would crowd out training: leave the check to verify
        if is_main:
            log(f"store layer check: skipped (target weights {weights >> 20} MiB, {free >> 20} MiB free on {dev.type}); "
                "`eyas verify` checks the store's layers")
        return
    model = load_target(target_dir, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
    try:
        problem = layer_ids_problem(reader, split, model)
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if problem is not None:
        raise EyasError(problem)


def _vocab_sha(used: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(used.numpy().tobytes()).hexdigest()[:16]


def _step_counts(masks, K: int):
    """[n, K] float64 numpy: loss-mask positions of each sample at each TTT step (m_{t+2+k} summed),
    the per-sample terms of the loss normalisers."""
    import numpy as np

    out = np.zeros((len(masks), K), dtype=np.float64)
    for i, m in enumerate(masks):
        c = m.to(torch.int64).flip(0).cumsum(0).flip(0)  # c[j] = sum(m[j:])
        for k in range(K):
            out[i, k] = float(c[2 + k]) if 2 + k < c.shape[0] else 0.0
    return out


def _dummy(item):
    """A sample with an empty loss mask: keeps a rank with no data in the collectives, adds nothing."""
    from eyas.train.data import Item

    return Item(item.id, item.input_ids, torch.zeros_like(item.loss_mask))


def _clip(module, params, max_norm: float) -> torch.Tensor | float:
    """The gradients' global norm (after clipping them to `max_norm` when it is > 0), left on the device: read
    with the step's statistics, not before the optimizer step is queued (a read waits for the backward)."""
    if max_norm > 0:
        n = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return n.full_tensor() if hasattr(n, "full_tensor") else n  # FSDP2 returns a DTensor
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else 0.0
