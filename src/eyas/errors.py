"""Error types shared by every stage.

`EyasError` is for users: bad input, missing files, mismatched artifacts. Its message says what was
seen, what was expected and what to do next; the CLI prints it on one line and exits with status 2.
`CheckFailed` is for verification commands whose check ran and found problems: the CLI prints the
summary it carries as the last stdout line and exits with status 1. `Interrupted` is a stop on
SIGINT/SIGTERM whose message says what was saved and how to continue (exit 130, like any Ctrl-C).
Internal invariants use assert.
"""

from __future__ import annotations

from typing import Any


class EyasError(ValueError):
    """A user-facing error: the message names the file/option, what was wrong and what to do."""


class CheckFailed(Exception):
    """A check ran and failed; `summary` is printed as the command's JSON line."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


class Interrupted(KeyboardInterrupt):
    """A stop on SIGINT/SIGTERM; the message says what was saved and how (or whether) a rerun continues."""
