"""Several lab variants in one run: eyas patched by each in turn, then eyas's command line in this process.

The patches are entered in the order given and undone in reverse. Each variant's pieces wrap whatever is there when
its patch starts (eagle31 and lk both wrap `pipeline.fingerprint` and `writer.write_eyas`), so the train stage's
fingerprint and the drafter's config.json carry every variant of the run, whatever the order.

Run: `python lab/variants/run.py --variant eagle31 [EAGLE31 OPTIONS] --variant lk [--kl-weight W] -- EYAS ARGS...`,
e.g. `python lab/variants/run.py --variant eagle31 --variant lk -- pipeline recipes/smollm2-gpu.toml`: each
`--variant NAME` takes that variant's own options (its entry point's) up to the next `--variant` or `--`.
From Python: `with stacked([eagle31.Variant(), lk.Variant()]): ...`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VARIANTS = {"eagle31": "lab.variants.eagle31", "lk": "lab.variants.lk"}
USAGE = (
    "usage: python lab/variants/run.py --variant NAME [ITS OPTIONS] [--variant NAME [ITS OPTIONS] ...] -- EYAS ARGS..."
    f" (NAME: {', '.join(VARIANTS)})"
)


def variant_module(name: str):
    if name not in VARIANTS:
        raise SystemExit(f"--variant {name!r}: expected one of {', '.join(VARIANTS)}")
    return importlib.import_module(VARIANTS[name])


@contextlib.contextmanager
def stacked(variants: list[Any]) -> Iterator[list[Any]]:
    """eyas patched with every variant (each its module's `Variant`), the first entered first; undone in reverse."""
    with contextlib.ExitStack() as stack:
        for v in variants:
            stack.enter_context(importlib.import_module(type(v).__module__).patched(v))
        yield variants


def parse_args(argv: list[str]) -> tuple[list[Any], list[str]]:
    """The variants with their options, then the eyas command line after `--`."""
    if "--" not in argv:
        raise SystemExit(USAGE)
    cut = argv.index("--")
    head, rest = list(argv[:cut]), list(argv[cut + 1 :])
    groups: list[tuple[str, list[str]]] = []
    for arg in head:
        if arg == "--variant" or arg.startswith("--variant="):
            groups.append((arg.partition("=")[2], []))
        elif not groups:
            raise SystemExit(f"{arg!r} before any --variant: {USAGE}")
        elif groups[-1][0] == "":  # the name after a bare --variant
            groups[-1] = (arg, [])
        else:
            groups[-1][1].append(arg)
    names = [name for name, _ in groups]
    if not groups or not rest or "" in names:
        raise SystemExit(USAGE)
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant {names}: each variant at most once")
    variants = []
    for name, opts in groups:
        v, left = variant_module(name).parse_args([*opts, "--"])  # (its parser stops at the first non-option)
        if left != ["--"]:
            raise SystemExit(f"--variant {name}: unknown options {left[:-1]}")
        variants.append(v)
    return variants, rest


def main(argv: list[str] | None = None) -> None:
    """Patch eyas with every variant, then run eyas's command line in this process."""
    from lab.variants import run_eyas

    variants, args = parse_args(sys.argv[1:] if argv is None else argv)
    run_eyas(args, stacked(variants), "lab variants " + " + ".join(v.describe() for v in variants))


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "src"), str(root)]  # the eyas and the lab of this checkout
    main()
