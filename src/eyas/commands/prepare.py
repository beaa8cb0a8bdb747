"""`eyas prepare`: chats -> token ids + assistant-only loss masks (see eyas/data/prepare.py).

The options are PrepareConfig's fields (eyas/data/prepare.py, via eyas/cli_options.py).
"""

from __future__ import annotations

from eyas.cli_options import options_from


@options_from("eyas.data.prepare:PrepareConfig")
def prepare(cfg) -> dict:
    """Render chats with the target's chat template into ids + assistant-only loss masks."""
    from eyas.data.prepare import prepare as run

    return run(cfg)
