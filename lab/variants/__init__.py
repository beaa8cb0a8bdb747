"""Model variants as patches of eyas for one run (lab/README.md): each module's `patched(variant)` and entry point."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager


def run_eyas(args: list[str], patch: AbstractContextManager, what: str) -> None:
    """eyas's command line `args` in this process, inside `patch`; `what` names the variant(s) on stderr."""
    from eyas.cli import main as eyas_main

    print(f"{what}: eyas patched for this run", file=sys.stderr, flush=True)
    with patch:
        sys.argv = ["eyas", *args]
        eyas_main()
