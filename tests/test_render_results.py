"""benchmarks/render_results.py: docs/performance.md and the README's results table are rendered from the ledger."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "render_results.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_rendered_files_match_the_ledger():
    p = _run("--check")
    assert p.returncode == 0, p.stderr


def test_a_new_ledger_row_makes_both_files_stale_until_rendered(tmp_path):
    for rel in ("benchmarks/results.jsonl", "docs/performance.md", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    row = {
        "metric": "train_smol_supervised_tok_s",
        "value": 123456.0,
        "unit": "tokens/s",
        "date": "2999-01-01",
        "commit": "abc1234",
        "device": "a test GPU",
        "command": "train_bench.py --suite smol",
    }
    with open(tmp_path / "benchmarks" / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    p = _run("--check", "--root", str(tmp_path))
    assert p.returncode == 1 and "docs/performance.md" in p.stderr and "README.md" in p.stderr, p.stderr
    assert _run("--root", str(tmp_path)).returncode == 0
    assert _run("--check", "--root", str(tmp_path)).returncode == 0
    readme = (tmp_path / "README.md").read_text()
    assert "123,456 tokens/s | abc1234 (2999-01-01)" in readme
    assert (
        "| train_smol_supervised_tok_s | 123,456 | tokens/s | 2999-01-01 | abc1234 |"
        in (tmp_path / "docs" / "performance.md").read_text()
    )
    assert readme.replace("123,456", "") != (REPO / "README.md").read_text().replace("123,456", "")
