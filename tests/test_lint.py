"""`ruff check` on the whole tree (src, tests, benchmarks, lab) finds nothing, with pyproject.toml's [tool.ruff]
rules. Skipped where ruff is not installed (it is in the test extras)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_finds_nothing():
    pytest.importorskip("ruff")
    from ruff.__main__ import find_ruff_bin

    res = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, ("ruff check found problems (fix them; `ruff check --fix` for the safe ones):\n"
                                 f"{res.stdout[-6000:]}{res.stderr[-2000:]}")
