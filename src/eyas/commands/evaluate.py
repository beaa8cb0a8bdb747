"""`eyas eval`: exact greedy acceptance of a drafter on MT-bench (or your prompts); see eyas/specdec/run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def evaluate(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter directory: eyas (`eyas train` output), SGLang (LlamaForCausalLMEagle3) or vLLM/speculators (Eagle3Speculator) layout."),
    out: Path = typer.Option(..., "--out", help="Report directory: report.json, report.md, acceptance.png, sequences.jsonl."),
    target: str = typer.Option("default", "--target", help="Target model directory (Hugging Face layout); `default` = embedded SmolLM2-135M-Instruct."),
    prompts: str = typer.Option("mtbench", "--prompts", help="`mtbench` (80 questions x 2 turns, the 2nd after the target's own 1st answer) or a JSONL file of {\"turns\": [...]} or {\"prompt\": \"...\"}."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Greedy tokens generated per turn."),
    chain_k: int = typer.Option(7, "--chain-k", help="Chain drafting: draft tokens per round (0 = skip the chain)."),
    tree_topk: int = typer.Option(10, "--tree-topk", help="EAGLE-2 tree: children kept per node and nodes expanded per depth."),
    tree_depth: int = typer.Option(6, "--tree-depth", help="EAGLE-2 tree: draft steps per round (0 = skip the tree)."),
    tree_tokens: int = typer.Option(60, "--tree-tokens", help="EAGLE-2 tree: draft tokens submitted per round, root excluded."),
    device: str = typer.Option("auto", "--device", help="`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."),
    dtype: str = typer.Option("auto", "--dtype", help="`auto` (bfloat16 on GPU, float32 on CPU), `bfloat16`, `float16`, `float32`."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate only the first N conversations."),
    gen_batch_size: int = typer.Option(160, "--gen-batch-size", help="Prompts per batched generate() call."),
    replay_tokens: int = typer.Option(131072, "--replay-tokens", help="Tokens (sequences x padded length) per replay batch; lower it if memory runs out."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
) -> dict:
    """Replay greedy speculative decoding (chain and EAGLE-2 tree) against the target's own answers."""
    from eyas.errors import EyasError
    from eyas.specdec.run import EvalConfig, evaluate_to

    try:
        cfg = EvalConfig(
            drafter=drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens, chain_k=chain_k,
            tree_topk=tree_topk, tree_depth=tree_depth, tree_tokens=tree_tokens, device=device, dtype=dtype,
            limit=limit, gen_batch_size=gen_batch_size, replay_tokens=replay_tokens,
        )
        cfg.modes()  # validates the tree options
    except EyasError:
        raise
    except ValueError as exc:
        raise EyasError(str(exc)) from exc
    return evaluate_to(out, cfg, overwrite=overwrite)
