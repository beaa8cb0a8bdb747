"""The product's import, state and size rules, checked on the source (AST): nothing under src/eyas imports lab, no
ALL_CAPS module-level name of src/eyas is rebound by code in src/ or tests/ (module flags that change what eyas
computes live as kernels in eyas.kernels, switched by EYAS_KERNELS, or as lab code that patches eyas for one run), no
module of drafter/ or train/ is longer than MODULE_LINES and no function of src/eyas longer than FUNCTION_LINES."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "eyas"
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")
MODULE_LINES = 600
"""The most lines of a module under src/eyas/drafter or src/eyas/train: a longer one is split along its concerns."""
FUNCTION_LINES = 150
"""The most lines of a function of src/eyas, from its `def` to its last line."""


def _trees(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _module_caps() -> dict[str, set[str]]:
    """ALL_CAPS names assigned at module level in src/eyas -> the modules that assign them."""
    out: dict[str, set[str]] = {}
    for path, tree in _trees(SRC):
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and CAPS.match(t.id):
                    out.setdefault(t.id, set()).add(str(path.relative_to(REPO)))
    return out


def _rebound(tree: ast.AST) -> set[str]:
    """ALL_CAPS attributes that `tree` rebinds on some object: `x.NAME = ...`, `setattr(x, "NAME", ...)`,
    `monkeypatch.setattr(x, "NAME", ...)`, `mock.patch.object(x, "NAME", ...)`, and `global NAME` in a function."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and CAPS.match(sub.attr) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.attr)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if (
                fname in ("setattr", "object")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and CAPS.match(node.args[1].value)
            ):
                names.add(node.args[1].value)
        elif isinstance(node, ast.Global):
            names.update(n for n in node.names if CAPS.match(n))
    return names


def test_nothing_in_src_imports_lab():
    bad = []
    for path, tree in _trees(SRC):
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {m}"
                for m in mods
                if m == "lab" or m.startswith("lab.")
            ]
    assert not bad, bad


def test_no_module_level_constant_of_src_is_rebound_by_src_or_tests():
    caps = _module_caps()
    assert "HEAD_CHUNK_ROWS" in caps and "ENV" in caps  # the scan sees module-level names
    rebound: dict[str, list[str]] = {}
    for root in (SRC, REPO / "tests"):
        for path, tree in _trees(root):
            for name in _rebound(tree) & set(caps):
                rebound.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not rebound, rebound


def test_the_rule_catches_a_rebinding():
    tree = ast.parse(
        "import m\nm.FLAG = True\ndef t(monkeypatch):\n    monkeypatch.setattr(m, 'OTHER', 1)\n"
        "    global THIRD\n    mock.patch.object(m, 'FOURTH', 2)\n"
    )
    assert _rebound(tree) == {"FLAG", "OTHER", "THIRD", "FOURTH"}


def test_no_dated_figures_in_src():
    dated = [
        f"{p.relative_to(REPO)}:{n}"
        for p in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", line)
    ]
    assert not dated, dated


def _long_functions(tree: ast.AST, limit: int) -> dict[str, int]:
    """Functions (methods and nested functions too) of `tree` over `limit` lines -> their lines."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit
    }


def test_no_module_of_drafter_or_train_is_over_the_size_limit():
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for pkg in ("drafter", "train")
        for p in sorted((SRC / pkg).rglob("*.py"))
    }
    assert "src/eyas/train/loop.py" in sizes  # the scan sees the modules
    long = {path: n for path, n in sizes.items() if n > MODULE_LINES}
    assert not long, f"over {MODULE_LINES} lines (split them along their concerns): {long}"


def test_no_function_of_src_is_over_the_length_limit():
    long = {
        f"{path.relative_to(REPO)}:{name}": n
        for path, tree in _trees(SRC)
        for name, n in _long_functions(tree, FUNCTION_LINES).items()
    }
    assert not long, f"over {FUNCTION_LINES} lines (split them): {long}"


def test_the_length_rule_counts_a_function_from_def_to_its_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(3))
    tree = ast.parse(f"def f(\n    a,\n):\n{body}\nclass C:\n    def g(self):\n{body.replace('    ', '        ')}")
    assert _long_functions(tree, 3) == {"f": 6, "g": 4}  # a method too
    assert _long_functions(tree, 5) == {"f": 6} and _long_functions(tree, 6) == {}  # at the limit is within it
