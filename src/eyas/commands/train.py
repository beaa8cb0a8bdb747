"""`eyas train`: train an EAGLE-3 drafter offline from a store or online with the target in the loop.

Same command on one CPU process, one GPU, or N GPUs:
    eyas train --data prepared/ --out run/ --steps 200                      (online, one process)
    torchrun --nproc_per_node 8 -m eyas train --store store/ --out run/ --fsdp   (offline, 8 GPUs)
See eyas/train/loop.py for the order of work and the metric definitions.
"""

from __future__ import annotations

from pathlib import Path

import typer


def train(
    out: Path = typer.Option(..., "--out", help="Run directory: metrics.jsonl, curves.png, checkpoints/, drafter/."),
    target: str = typer.Option("default", "--target", help="Target model directory (HF layout); `default` = embedded SmolLM2-135M-Instruct."),
    store: Path | None = typer.Option(None, "--store", help="Offline: hidden-state store from `eyas capture` (training split)."),
    data: Path | None = typer.Option(None, "--data", help="Online: prepared dataset; the target runs on every batch, nothing is written."),
    aux_layers: str | None = typer.Option(None, "--aux-layers", help="Online: comma-separated target layer ids for fc (inputs to those layers, hf-input convention); default 2,N//2,N-3. Offline uses the store's."),
    eval_store: Path | None = typer.Option(None, "--eval-store", help="Offline: store of eval states; without it --eval-samples store samples are held out."),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps (overrides --epochs)."),
    epochs: float = typer.Option(1.0, "--epochs", help="Passes over the training split when --steps is not given."),
    tokens_per_batch: int | None = typer.Option(None, "--tokens-per-batch", help="Tokens per micro-batch per process: samples packed end to end into one row of this many tokens (default on CUDA 131072, 32768 under 64 GiB of GPU memory; on the CPU --batch-size samples per row)."),
    batch_size: int = typer.Option(1, "--batch-size", help="Samples per micro-batch per process when --tokens-per-batch is not used (global batch = this x --grad-accum x processes)."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW, betas 0.9/0.95)."),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="Linear warmup steps (default 2% of the run)."),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="Cosine decay floor as a fraction of --lr."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    grad_clip: float = typer.Option(0.5, "--grad-clip", help="Global gradient-norm clip (0 = off)."),
    ttt_steps: int = typer.Option(7, "--ttt-steps", help="Training-time-test steps."),
    ttt_decay: float = typer.Option(0.8, "--ttt-decay", help="Loss weight of TTT step k = decay**k."),
    draft_vocab: int | None = typer.Option(None, "--draft-vocab", help="Draft vocabulary size (default min(32000, target vocab))."),
    max_length: int = typer.Option(2048, "--max-length", help="Truncate samples to this many tokens."),
    eval_every: int = typer.Option(0, "--eval-every", help="Evaluate every N steps (0 = at the end only)."),
    eval_samples: int = typer.Option(64, "--eval-samples", help="Eval samples per evaluation."),
    save_every: int = typer.Option(0, "--save-every", help="Checkpoint every N steps (0 = at the end only)."),
    resume: str | None = typer.Option(None, "--resume", help="Checkpoint file to resume from, or `auto` (latest in <out>/checkpoints)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N (torchrun: cuda:LOCAL_RANK)."),
    precision: str = typer.Option("auto", "--precision", help="bf16 (autocast, fp32 master weights) or fp32; auto = bf16 on CUDA, fp32 on CPU."),
    fsdp: bool = typer.Option(False, "--fsdp", help="FSDP2: shard parameters, gradients and optimizer state across processes."),
    attention: str = typer.Option("fast", "--attention", help="TTT attention: `fast` (flash + diagonals) or `reference` (dense mask)."),
    compile: bool | None = typer.Option(None, "--compile/--no-compile", help="torch.compile the drafter's per-step pieces (default: on for CUDA, off on the CPU)."),
    init_head: bool = typer.Option(False, "--init-head/--no-init-head", help="Start lm_head/norm from the target's draft-vocab rows (default: random, as EAGLE-3)."),
    seed: int = typer.Option(0, "--seed", help="Seed for weights and data order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run's drafter in --out."),
) -> dict:
    """Train an EAGLE-3 drafter with training-time test (offline --store or online --data)."""
    from eyas.errors import EyasError
    from eyas.train.loop import TrainConfig, run

    try:
        layer_ids = [int(x) for x in aux_layers.split(",")] if aux_layers else None
    except ValueError:
        raise EyasError(f"--aux-layers: expected comma-separated integers, got {aux_layers!r}") from None
    return run(TrainConfig(
        out=out, aux_layers=layer_ids, target=target, store=store, data=data, eval_store=eval_store, steps=steps, epochs=epochs,
        tokens_per_batch=tokens_per_batch, batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
        weight_decay=weight_decay, grad_clip=grad_clip, ttt_steps=ttt_steps, ttt_decay=ttt_decay,
        draft_vocab=draft_vocab, max_length=max_length, eval_every=eval_every, eval_samples=eval_samples,
        save_every=save_every, resume=resume, device=device, precision=precision, fsdp=fsdp, attention=attention,
        init_head=init_head, compile=compile, seed=seed, overwrite=overwrite,
    ))
