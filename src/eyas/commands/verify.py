"""`eyas verify`: coverage and numbers checks of a hidden-state store (see eyas/store/verify.py)."""

from __future__ import annotations

from pathlib import Path

import typer


def verify(
    store: Path = typer.Option(..., help="Store directory written by `eyas capture`."),
    numbers: int = typer.Option(8, help="Samples recomputed with the unbatched reference path (0 = coverage only)."),
    seed: int = typer.Option(0, help="Seed for choosing the recomputed samples."),
    tolerance: float = typer.Option(None, help="Worst per-token relative error allowed; default by stored dtype and model dtype."),
    device: str = typer.Option("cpu", help="Where the reference recomputation runs: cpu or cuda[:K]."),
    target: str = typer.Option(None, help="Target directory if it moved since capture (its hashes must match)."),
    data: Path = typer.Option(None, help="Prepared dataset directory if it moved since capture."),
) -> dict:
    """Check that every prepared sample is stored exactly once with the right numbers; exit 1 if not."""
    from eyas.config_checks import check_device, check_value
    from eyas.errors import EyasError
    from eyas.store.verify import verify_store

    if not store.is_dir():
        raise EyasError(f"--store {store} is not a directory (expected an `eyas capture` store)")
    check_value(numbers, "--numbers", ge=0)
    check_value(tolerance, "--tolerance", gt=0, optional=True)
    if device == "auto":
        raise EyasError("--device must be cpu or cuda[:K], got 'auto'")
    check_device(device)
    return verify_store(store, numbers=numbers, seed=seed, tolerance=tolerance, device=device, target=target, data=data)
