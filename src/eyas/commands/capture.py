"""`eyas capture`: run the target over a prepared split and store its hidden states (see eyas/capture)."""

from __future__ import annotations

from pathlib import Path

import typer


def capture(
    target: str = typer.Option("default", help="Target: a local Hugging Face model directory, or `default` (SmolLM2-135M-Instruct)."),
    data: Path = typer.Option(..., help="Prepared dataset directory (from `eyas prepare`)."),
    split: str = typer.Option("train", help="Split of the prepared dataset to capture."),
    out: Path = typer.Option(..., help="Store directory; rerunning with the same settings resumes it."),
    layers: str = typer.Option("default", help="Aux layer ids, comma-separated, convention hf-input (id i = input to decoder layer i); default = EAGLE-3's 2,N//2,N-3."),
    dtype: str = typer.Option("bf16", help="Stored dtype: bf16, fp8 (e4m3, a scale per token and layer; half the bytes) or fp32."),
    device: str = typer.Option("cpu", help="Where the target runs: cpu, cuda or cuda:K."),
    model_dtype: str = typer.Option("auto", help="Dtype the target runs in: bf16, fp32, or auto (bf16 on CUDA, fp32 on CPU)."),
    token_budget: int = typer.Option(16384, help="Most tokens per forward (batch size x padded length); longer samples run alone."),
    shard_bytes: str = typer.Option("1GB", help="Commit a shard once it holds this many bytes (e.g. 512MB, 2GiB)."),
    limit: int = typer.Option(None, help="Capture only the first N samples of the split."),
    queue_depth: int = typer.Option(3, help="Batches in flight between forward and disk (pinned buffers on CUDA)."),
) -> dict:
    """Capture the target's aux and final hidden states for every sample of a prepared split."""
    from eyas.capture.run import CaptureSettings, parse_bytes, parse_layers, run_capture

    settings = CaptureSettings(
        target=target, data=data, split=split, out=out, layers=parse_layers(layers), dtype=dtype, device=device,
        model_dtype=model_dtype, token_budget=token_budget, shard_bytes=parse_bytes(shard_bytes), limit=limit,
        queue_depth=queue_depth,
    )
    return run_capture(settings)
