"""`eyas generate`: speculative decoding with a trained drafter, timed against target-only decoding;
see eyas/specdec/generate_run.py (the options are GenerateConfig's fields)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def generate(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter directory: eyas (`eyas train` output), SGLang or vLLM/speculators layout."),
    target: str = typer.Option("default", "--target", help="Target model directory (Hugging Face layout); `default` = embedded SmolLM2-135M-Instruct."),
    prompts: str = typer.Option("mtbench", "--prompts", help="`mtbench` (80 questions x 2 turns, the 2nd after the model's own 1st answer) or a JSONL file of {\"turns\": [...]} or {\"prompt\": \"...\"}."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens generated per turn (an EOS ends a turn earlier)."),
    mode: str = typer.Option("tree", "--mode", help="`tree` (EAGLE-2 dynamic tree) or `chain` (--chain-k tokens a round)."),
    chain_k: int = typer.Option(7, "--chain-k", help="Chain drafting: draft tokens per round."),
    tree_topk: int = typer.Option(10, "--tree-topk", help="EAGLE-2 tree: children kept per node and nodes expanded per depth."),
    tree_depth: int = typer.Option(6, "--tree-depth", help="EAGLE-2 tree: draft steps per round."),
    tree_tokens: int = typer.Option(60, "--tree-tokens", help="EAGLE-2 tree: draft tokens verified per round, root excluded."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (identical to the target's own output); > 0 = rejection sampling from the target's distribution."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling generator (temperature > 0)."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also decode target-only in the same loop and report the speed-up."),
    warmup: int = typer.Option(1, "--warmup", help="Prompts decoded once before timing starts (not counted)."),
    device: str = typer.Option("auto", "--device", help="`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."),
    dtype: str = typer.Option("auto", "--dtype", help="`auto` (bfloat16 on GPU, float32 on CPU), `bfloat16`, `float16`, `float32`."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Decode only the first N conversations."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write one JSONL record per turn (ids, text, accepted per round, seconds) to this file."),
) -> dict:
    """Speculative decoding (batch 1) with a trained EAGLE-3 drafter: tokens/s vs target-only, tau, time split."""
    from eyas.errors import EyasError
    from eyas.specdec.generate_run import GenerateConfig, generate_to

    try:
        cfg = GenerateConfig(
            drafter=drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens, mode=mode, chain_k=chain_k,
            tree_topk=tree_topk, tree_depth=tree_depth, tree_tokens=tree_tokens, temperature=temperature, seed=seed,
            baseline=baseline, warmup=warmup, device=device, dtype=dtype, limit=limit,
        )
    except EyasError:
        raise
    except ValueError as exc:
        raise EyasError(str(exc)) from exc
    return generate_to(cfg, out=out)
