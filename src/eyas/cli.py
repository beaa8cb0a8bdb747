"""The `eyas` command line: one subcommand per pipeline stage.

Each subcommand lives in eyas/commands/<name>.py as a typed function (its signature and
`typer.Option` help texts are the CLI) that returns a summary dict. This file registers them and
applies the shared contract: the summary is printed as ONE JSON line, the last line of stdout;
diagnostics and progress go to stderr; a user error (EyasError) prints `error: ...` on stderr and
exits 2; a failed check (CheckFailed) prints its summary and exits 1.

Command modules import heavy libraries (torch, transformers) inside the function, so `eyas --help`
stays fast.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys

import typer

from eyas.errors import CheckFailed, EyasError

app = typer.Typer(
    name="eyas",
    help="Train EAGLE-3 draft models on verified target hidden states.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (subcommand, module under eyas.commands, function name)
COMMANDS = [
    ("prepare", "prepare", "prepare"),
    ("regenerate", "regenerate", "regenerate"),
    ("capture", "capture", "capture"),
    ("verify", "verify", "verify"),
    ("verify-server", "verify_server", "verify_server"),
    ("train", "train", "train"),
    ("eval", "evaluate", "evaluate"),
    ("export", "export", "export"),
    ("demo", "demo", "demo"),
    ("pipeline", "pipeline", "pipeline"),
]


@app.callback()
def _root() -> None:
    """Train EAGLE-3 draft models on verified target hidden states."""


def emit(summary: dict) -> None:
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)


def _contract(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            summary = fn(*args, **kwargs)
        except EyasError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise typer.Exit(2) from None
        except CheckFailed as exc:
            print(f"check failed: {exc}", file=sys.stderr, flush=True)
            emit(exc.summary)
            raise typer.Exit(1) from None
        emit(summary if summary is not None else {})

    return wrapper


def _register() -> None:
    for name, module, func in COMMANDS:
        mod = importlib.import_module(f"eyas.commands.{module}")
        app.command(name)(_contract(getattr(mod, func)))


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
