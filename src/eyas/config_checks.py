"""Option checks shared by every command's config dataclass (`__post_init__`).

Each check names the option as the CLI spells it (`lr` -> `--lr`), the value seen and what is
allowed, and raises EyasError (exit 2) before any model loads. Numbers are refused when NaN or
infinite as well as out of range: `nan <= x` is False for every bound, so a plain comparison would
let NaN through silently.

Run: used by the configs; `pytest tests/test_bad_inputs.py` exercises every check through the CLI.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlparse

from eyas.errors import EyasError

_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_INPUTS_LATER: ContextVar[bool] = ContextVar("eyas_inputs_later", default=False)


@contextmanager
def inputs_made_later():
    """Build configs whose input paths an earlier stage will create (`eyas pipeline`): the checks
    that those inputs exist are skipped; every other option check still runs."""
    token = _INPUTS_LATER.set(True)
    try:
        yield
    finally:
        _INPUTS_LATER.reset(token)


def input_must_exist() -> bool:
    """False inside `inputs_made_later()`."""
    return not _INPUTS_LATER.get()


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_number(
    obj: Any,
    field: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    optional: bool = False,
    option: str | None = None,
) -> None:
    """`getattr(obj, field)` must be a finite number within the given bounds (None allowed if optional)."""
    value = getattr(obj, field)
    check_value(value, option or option_name(field), ge=ge, gt=gt, le=le, lt=lt, optional=optional)


def check_value(
    value: Any,
    option: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    optional: bool = False,
) -> None:
    if value is None:
        if optional:
            return
        raise EyasError(f"{option} is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EyasError(f"{option} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise EyasError(f"{option} must be a finite number, got {value}")
    bounds = [
        (ge, lambda v, b: v >= b, ">="),
        (gt, lambda v, b: v > b, ">"),
        (le, lambda v, b: v <= b, "<="),
        (lt, lambda v, b: v < b, "<"),
    ]
    for bound, ok, _sym in bounds:
        if bound is not None and not ok(value, bound):
            allowed = " and ".join(f"{s} {b:g}" for b, _, s in bounds if b is not None)
            raise EyasError(f"{option} must be {allowed}, got {value:g}")


def check_choice(obj: Any, field: str, choices: Iterable[str], *, option: str | None = None) -> None:
    check_in(getattr(obj, field), option or option_name(field), choices)


def check_in(value: Any, option: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise EyasError(f"{option} must be one of {', '.join(choices)}; got {value!r}")


def check_device(device: str, *, option: str = "--device") -> None:
    """auto, cpu, mps, cuda or cuda:N; a CUDA device must exist on this machine."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise EyasError(f"{option} must be auto, cpu, cuda or cuda:N; got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise EyasError(f"{option} {device}: CUDA is not available on this machine; use --device cpu")
        if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
            raise EyasError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_url(url: str, *, option: str) -> str:
    """An http(s)://host[:port][/path] URL; returns it without a trailing slash."""
    u = urlparse(url.strip()) if isinstance(url, str) else None
    try:
        port_ok = u is not None and (u.port is None or 0 < u.port < 65536)
    except ValueError:
        port_ok = False
    if u is None or u.scheme not in ("http", "https") or not u.hostname or not port_ok:
        raise EyasError(f"{option} {url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:30000")
    return url.strip().rstrip("/")


def parse_int_list(text: str | None, *, option: str, min_value: int | None = 0) -> list[int] | None:
    """'2,14,27' -> [2, 14, 27]; None/'' -> None; anything else is refused naming the option."""
    if text is None or not str(text).strip():
        return None
    try:
        values = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise EyasError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if min_value is not None and any(v < min_value for v in values):
        raise EyasError(f"{option}: values must be >= {min_value}, got {text!r}")
    return values
