"""lab's tests: the product's fixtures (tests/conftest.py) and a loader for lab/scripts/<name>.py."""

from __future__ import annotations

import importlib.util
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
