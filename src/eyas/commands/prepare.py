"""`eyas prepare`: chats -> token ids + assistant-only loss masks (see eyas/data/prepare.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def prepare(
    out: Path = typer.Option(..., "--out", help="Output directory of the prepared dataset."),
    source: str = typer.Option("sharegpt", "--source", help="Chats: `sharegpt` (embedded default), a .json/.jsonl file (OpenAI `messages` or ShareGPT `conversations`), a dataset saved with save_to_disk, or an `eyas regenerate` output dir."),
    target: str = typer.Option("default", "--target", help="Target model directory (Hugging Face layout) whose tokenizer and chat template render the chats; `default` = embedded SmolLM2-135M-Instruct."),
    max_length: int = typer.Option(2048, "--max-length", help="Maximum tokens per sample."),
    length_policy: str = typer.Option("truncate", "--length-policy", help="Samples longer than --max-length: `truncate` or `drop`."),
    eval_fraction: float = typer.Option(0.02, "--eval-fraction", help="Fraction of samples put in the eval split (deterministic hash of the sample id)."),
    seed: int = typer.Option(0, "--seed", help="Seed mixed into the split hash."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Read at most this many records."),
    truncated_answers: str = typer.Option("keep", "--truncated-answers", help="Assistant turns cut at a token limit (from `eyas regenerate`): `keep` (train on the content, not on the end-of-turn token), `mask` (no loss on the turn), `drop` (skip the conversation)."),
    hf_split: Optional[str] = typer.Option(None, "--hf-split", help="Split to read when --source is a saved DatasetDict."),
    aux_layers: int = typer.Option(3, "--aux-layers", help="Aux layers the capture will store (for the disk estimate)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
) -> dict:
    """Render chats with the target's chat template into ids + assistant-only loss masks."""
    from eyas.data.prepare import PrepareConfig, prepare as run

    return run(PrepareConfig(
        source=source, target=target, out=out, max_length=max_length, length_policy=length_policy,
        eval_fraction=eval_fraction, seed=seed, limit=limit, truncated_answers=truncated_answers,
        hf_split=hf_split, aux_layers=aux_layers, overwrite=overwrite,
    ))
