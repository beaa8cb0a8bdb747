"""Every `eyas` command line in the README's and the docs' code blocks runs as written: its command exists, each
--option is one that command has, and it gives no bare argument to a command that takes none (a user copies
these lines; docs/performance.md is the rendered ledger, whose commands are history)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from eyas.cli import app

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS = [p for p in DOCS if p.name != "performance.md"]


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each `eyas ...` line inside ```bash blocks (the others are diagrams and
    layouts), continuations joined, comments cut."""
    out, block, pending = [], False, None
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            block, pending = (not block and line.strip() == "```bash"), None
            continue
        if not block:
            continue
        pending = (n, line.strip()) if pending is None else (pending[0], pending[1] + " " + line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        n0, cmd = pending
        pending = None
        for part in re.split(r"&&|;", cmd.split(" #")[0]):
            m = re.match(r"^\s*(?:\S*/)?eyas ([a-z][a-z-]*)(.*)$", part)
            if m:
                out.append((n0, (m.group(1) + m.group(2)).strip()))
    return out


def test_the_scan_finds_the_lines_a_user_copies():
    text = "```bash\nbash scripts/setup.sh && .venv/bin/eyas demo\neyas capture --url U \\\n    --out s  # c\n```\n"
    assert command_lines(text) == [(2, "demo"), (3, "capture --url U --out s")]
    assert command_lines("eyas verify --store s\n") == []  # prose, not a code block
    assert command_lines("```\n eyas client (this host)\n```\n") == []  # a diagram


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_eyas_command_in_the_docs_runs_as_written(doc):
    root = typer.main.get_command(app)
    problems = []
    for n, line in command_lines(doc.read_text()):
        # [--optional ...] parts are checked where written out; <placeholder> values stand for one word
        words = shlex.split(re.sub(r"<[^>]*>", "VALUE", re.sub(r"\[[^\]]*\]", "", line)))
        name, args = words[0], words[1:]
        cmd = getattr(root, "commands", {}).get(name)  # typer may vendor its own click: no isinstance
        if cmd is None:
            problems.append(f"{doc.name}:{n}: no command `eyas {name}`")
            continue
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        takes_arguments = any(p.param_type_name == "argument" for p in cmd.params)
        for i, w in enumerate(args):
            if w.startswith("--") and w.split("=")[0] not in opts:
                problems.append(f"{doc.name}:{n}: `eyas {name}` has no option {w.split('=')[0]}")
            elif w != "..." and not w.startswith("-") and not takes_arguments and (i == 0 or args[i - 1][0] != "-"):
                problems.append(f"{doc.name}:{n}: `eyas {name}` takes no argument, the docs give it {w!r}")
    assert not problems, problems
