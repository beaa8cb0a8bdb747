"""`eyas verify`: coverage, every-sample invariants and a fresh random recompute of a hidden-state
store (see eyas/store/verify.py; the options are eyas.store.verify.VerifyConfig's fields, via
eyas/cli_options.py)."""

from __future__ import annotations

from eyas.cli_options import options_from


@options_from("eyas.store.verify:VerifyConfig")
def verify(cfg) -> dict:
    """Check that every prepared sample is stored exactly once with the right numbers; exit 1 if not."""
    from eyas.errors import EyasError
    from eyas.store.verify import run_verify

    if not cfg.store.is_dir():
        raise EyasError(f"--store {cfg.store} is not a directory (expected an `eyas capture` store)")
    return run_verify(cfg)
