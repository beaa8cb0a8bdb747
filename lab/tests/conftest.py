"""lab's tests: the product's fixtures (tests/conftest.py) and a loader for lab/scripts/<name>.py."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import *  # noqa: F401,F403  (fixtures: smol_dir, smol_tokenizer)
from tests.conftest import _fresh_kernel_checks  # noqa: F401  (autouse)

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """lab/scripts/<name>.py as a module (registered in sys.modules: dataclasses resolve annotations there)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "lab" / "scripts" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


SMOKE = REPO / "recipes" / "smollm2-cpu-smoke.toml"


def smoke_sets(target_dir: Path, *more: str) -> list[str]:
    """--set values for a seconds-long CPU pipeline of the smoke recipe on a tiny target."""
    values = [
        f"target={json.dumps(str(target_dir))}",
        "regenerate.limit=6",
        "regenerate.max_new_tokens=12",
        "train.steps=2",
        "train.draft_vocab=256",
        *more,
    ]
    return [x for v in values for x in ("--set", v)]


def variant_pipeline(tmp_path: Path, variant: str, *, until: str, sets: list[str]) -> tuple[Path, Path, str]:
    """A plain smoke pipeline up to `until` in tmp_path/base, its regenerate/ and prepared/ copied into tmp_path/run,
    then `python lab/variants/<variant>.py pipeline` there: checks that it ran train, eval and export on the copied
    stages (skipped), 2 steps, a finite loss and a tau; returns (base, run, the variant's stderr)."""
    from typer.testing import CliRunner

    from eyas.cli import app

    base, run = tmp_path / "base", tmp_path / "run"
    res = CliRunner().invoke(app, ["pipeline", str(SMOKE), "--workdir", str(base), "--until", until, *sets])
    assert res.exit_code == 0, res.output
    for stage in ("regenerate", "prepared"):  # the stage folders, without the regeneration itself
        shutil.copytree(base / stage, run / stage, ignore=shutil.ignore_patterns("run"))
    script = REPO / "lab" / "variants" / f"{variant}.py"
    proc = subprocess.run(
        [sys.executable, str(script), "pipeline", str(SMOKE), "--workdir", str(run), *sets],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    statuses = {k: r["status"] for k, r in s["stages"].items()}
    assert statuses == {"regenerate": "skipped", "prepare": "skipped", "train": "ran", "eval": "ran", "export": "ran"}
    assert s["stages"]["train"]["steps"] == 2 and math.isfinite(s["stages"]["train"]["final_loss"])
    assert s["tau_chain"] >= 1.0 and s["tau_tree"] >= 1.0
    return base, run, proc.stderr
