"""`eyas verify`: coverage, every-sample invariants and a fresh random recompute of a hidden-state
store (see eyas/store/verify.py; the options are eyas.store.verify.VerifyConfig's fields)."""

from __future__ import annotations

from pathlib import Path

import typer


def verify(
    store: Path = typer.Option(..., help="Store directory written by `eyas capture`."),
    numbers: int = typer.Option(8, help="Samples recomputed with the unbatched reference path (0 = none); at least this many."),
    numbers_fraction: float = typer.Option(0.0, help="Also recompute at least this fraction of the samples (0..1)."),
    numbers_seconds: float = typer.Option(None, help="Time budget: keep recomputing further samples until this many seconds pass."),
    seed: int = typer.Option(None, help="Seed of the recomputed subset; default: fresh each run (printed; pass it to repeat)."),
    invariants: bool = typer.Option(True, "--invariants/--no-invariants", help="Check the every-sample invariants (prefix, tail, post-norm final, calibrated rates)."),
    tolerance: float = typer.Option(None, help="Worst per-token relative error allowed (numbers and prefix); default by stored dtype and model dtype."),
    device: str = typer.Option("cpu", help="Where the target runs for invariants and recompute: cpu or cuda[:K]."),
    target: str = typer.Option(None, help="Target directory if it moved since capture (its identity must match the store's)."),
    data: Path = typer.Option(None, help="Prepared dataset directory if it moved since capture."),
) -> dict:
    """Check that every prepared sample is stored exactly once with the right numbers; exit 1 if not."""
    from eyas.config_checks import check_device, check_value
    from eyas.errors import EyasError
    from eyas.store.verify import VerifyConfig, run_verify

    if not store.is_dir():
        raise EyasError(f"--store {store} is not a directory (expected an `eyas capture` store)")
    check_value(numbers, "--numbers", ge=0)
    check_value(tolerance, "--tolerance", gt=0, optional=True)
    if device == "auto":
        raise EyasError("--device must be cpu or cuda[:K], got 'auto'")
    check_device(device)
    return run_verify(VerifyConfig(store=store, numbers=numbers, numbers_fraction=numbers_fraction, numbers_seconds=numbers_seconds,
                                   seed=seed, invariants=invariants, tolerance=tolerance, device=device, target=target, data=data))
