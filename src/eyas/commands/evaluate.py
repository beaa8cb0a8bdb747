"""`eyas eval`: exact greedy acceptance of a drafter on MT-bench (or your prompts); see eyas/specdec/run.py.

The options are EvalConfig's fields (eyas/specdec/run.py, via eyas/cli_options.py) plus where the
report goes.
"""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_options import options_from


@options_from("eyas.specdec.run:EvalConfig")
def evaluate(
    cfg,
    out: Path = typer.Option(
        ..., "--out", help="Report directory: report.json, report.md, acceptance.png, sequences.jsonl."
    ),
    overwrite: bool = typer.Option(False, "--overwrite/--no-overwrite", help="Replace an existing --out directory."),
) -> dict:
    """Replay greedy speculative decoding (chain and EAGLE-2 tree) against the target's own answers."""
    from eyas.errors import EyasError
    from eyas.specdec.run import evaluate_to

    try:
        cfg.modes()  # validates the tree options
    except EyasError:
        raise
    except ValueError as exc:
        raise EyasError(str(exc)) from exc
    return evaluate_to(out, cfg, overwrite=overwrite)
