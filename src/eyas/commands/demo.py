"""`eyas demo`: the whole pipeline on the embedded default (see eyas/demo.py; the options are
DemoConfig's fields, via eyas/cli_options.py)."""

from __future__ import annotations

from eyas.cli_options import options_from


@options_from("eyas.demo:DemoConfig")
def demo(cfg) -> dict:
    """Run prepare -> capture -> verify -> train -> eval -> export on the embedded default."""
    from eyas.demo import run_demo

    return run_demo(cfg)
