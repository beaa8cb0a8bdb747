"""`eyas demo`: the whole pipeline on the embedded default (see eyas/demo.py)."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Directory for every stage's output; a rerun resumes."),
    chats: int = typer.Option(200, "--chats", help="ShareGPT records to prepare."),
    max_length: int = typer.Option(384, "--max-length", help="Tokens per sample."),
    train_steps: int = typer.Option(60, "--train-steps", help="Optimizer steps of the drafter."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Draft vocabulary size (small keeps CPU steps fast)."),
    lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate."),
    ttt_steps: int = typer.Option(7, "--ttt-steps", help="Training-time-test steps."),
    eval_questions: int = typer.Option(4, "--eval-questions", help="MT-bench questions evaluated (2 turns each)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Greedy tokens per turn in the evaluation."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete --out first."),
) -> dict:
    """Run prepare -> capture -> verify -> train -> eval -> export on the embedded default."""
    from eyas.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(out=out, chats=chats, max_length=max_length, train_steps=train_steps, draft_vocab=draft_vocab, lr=lr,
                               ttt_steps=ttt_steps, eval_questions=eval_questions, max_new_tokens=max_new_tokens,
                               device=device, overwrite=overwrite))
