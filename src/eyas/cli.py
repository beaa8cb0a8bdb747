"""The `eyas` command line: one subcommand per pipeline stage.

Each subcommand lives in eyas/commands/<name>.py as a typed function (its signature and
`typer.Option` help texts are the CLI) that returns a summary dict. This file registers them and
applies the shared contract: the summary is printed as ONE JSON line, the last line of stdout;
diagnostics and progress go to stderr; a user error (EyasError) prints `error: ...` on stderr and
exits 2; a failed check (CheckFailed) prints its summary and exits 1. Any other exception is a
bug or an unforeseen input: the guard prints one line naming it plus a hint, and exits 3 (set
EYAS_DEBUG=1 or pass `eyas --debug ...` for the traceback). Exit 1 therefore always means "a check
ran and failed", never "eyas crashed".

Command modules import heavy libraries (torch, transformers) inside the function, so `eyas --help`
stays fast.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
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
    ("generate", "generate", "generate"),
    ("export", "export", "export"),
    ("demo", "demo", "demo"),
    ("pipeline", "pipeline", "pipeline"),
]


INTERNAL_ERROR = 3
"""Exit status of an unexpected exception (exit 1 = a check failed, 2 = bad input)."""


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an unexpected error.")) -> None:
    """Train EAGLE-3 draft models on verified target hidden states."""
    if debug:
        os.environ["EYAS_DEBUG"] = "1"


def _debug() -> bool:
    return os.environ.get("EYAS_DEBUG", "") not in ("", "0")


def emit(summary: dict) -> None:
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)


def _contract(fn, name: str):
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
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            print("interrupted; rerun the same command to resume where it stopped", file=sys.stderr, flush=True)
            raise typer.Exit(130) from None
        except MemoryError:
            print("error: out of memory; lower the batch size / --max-length or use a larger machine",
                  file=sys.stderr, flush=True)
            raise typer.Exit(INTERNAL_ERROR) from None
        except OSError as exc:  # disk full, read-only filesystem, permissions: the environment, not a bug
            if _debug():
                raise
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            print(f"error: {exc.strerror or exc}{where}; check free space and permissions, then rerun "
                  "(the command resumes where it stopped)", file=sys.stderr, flush=True)
            raise typer.Exit(2) from None
        except Exception as exc:
            if _debug():
                raise
            msg = " ".join(str(exc).split())[:300]
            print(f"internal error: {type(exc).__name__}: {msg} (in `eyas {name}`). This is a bug or an input "
                  "eyas does not check yet; rerun with EYAS_DEBUG=1 (or `eyas --debug ...`) for the traceback and "
                  "report it", file=sys.stderr, flush=True)
            raise typer.Exit(INTERNAL_ERROR) from None
        emit(summary if summary is not None else {})

    return wrapper


def _register() -> None:
    for name, module, func in COMMANDS:
        mod = importlib.import_module(f"eyas.commands.{module}")
        app.command(name)(_contract(getattr(mod, func), name))


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
