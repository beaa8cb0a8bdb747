"""`eyas generate`: speculative decoding with a trained drafter, timed against target-only decoding;
see eyas/specdec/generate_run.py (the options are GenerateConfig's fields, via eyas/cli_options.py,
plus where the per-turn records go)."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_options import options_from


@options_from("eyas.specdec.generate_run:GenerateConfig")
def generate(
    cfg,
    out: Path | None = typer.Option(
        None, "--out", help="Write one JSONL record per turn (ids, text, accepted per round, seconds) to this file."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite/--no-overwrite", help="Replace an existing --out file written by `eyas generate`."
    ),
) -> dict:
    """Speculative decoding (batch 1, or --batch-size B) with a trained EAGLE-3 drafter: tokens/s vs target-only, tau, time split."""
    from eyas.specdec.generate_run import generate_to

    return generate_to(cfg, out=out, overwrite=overwrite)  # --out is checked first, before any model loads
