"""`eyas pipeline CONFIG.toml`: regenerate -> prepare -> train -> eval -> export from one file (see eyas/pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import typer


def pipeline(
    config: Path = typer.Argument(
        ...,
        help="Pipeline file (TOML): top-level workdir/target/device and one [section] per stage, whose keys are that stage's options (e.g. recipes/smollm2-gpu.toml).",
    ),
    workdir: Path | None = typer.Option(None, "--workdir", help="Override the file's `workdir`."),
    set_: list[str] | None = typer.Option(
        None,
        "--set",
        help="Override one option: section.key=value (TOML value), e.g. --set train.steps=100 --set regenerate.limit=2000. Repeatable.",
    ),
    until: str | None = typer.Option(
        None,
        "--until",
        help="Run the stages up to and including this one (regenerate, prepare, train, eval or export), then stop; the summary lists the stages not run.",
    ),
) -> dict:
    """Run every stage of the file in order; a stage already complete for the same inputs is skipped."""
    from eyas.pipeline import load_config, run_pipeline

    return run_pipeline(load_config(config, overrides=list(set_ or []), workdir=workdir, until=until))
