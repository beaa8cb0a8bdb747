"""`ruff check` on the whole tree (src, tests, benchmarks, lab) finds nothing, and `ruff format` would change
nothing, with pyproject.toml's [tool.ruff] settings. Skipped where ruff is not installed (it is in the test extras)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff")
    from ruff.__main__ import find_ruff_bin

    return subprocess.run([find_ruff_bin(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_finds_nothing():
    res = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert res.returncode == 0, (
        "ruff check found problems (fix them; `ruff check --fix` for the safe ones):\n"
        f"{res.stdout[-6000:]}{res.stderr[-2000:]}"
    )


def test_ruff_format_would_change_nothing():
    res = _ruff("format", "--check", "--no-cache", ".")
    assert res.returncode == 0, (
        "ruff format would reformat files (run `ruff format .`, then `ruff check .`: a "
        f"`# noqa` on a wrapped line may have to move):\n{res.stdout[-6000:]}{res.stderr[-2000:]}"
    )
