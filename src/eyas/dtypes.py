"""One dtype vocabulary and one device/dtype resolver for every command.

Names: the short ones the store and capture use (bf16, fp16, fp32, fp8) and torch's long ones
(bfloat16, float16, float32, float8_e4m3fn) mean the same dtype everywhere; each option still says
which of them it accepts (a store holds bf16, fp8 or fp32; a model runs in bf16, fp16 or fp32).
`auto` resolves once, here: cuda when present, and bf16 on cuda / fp32 on cpu. Errors name the option.

    to_dtype("bf16") is to_dtype("bfloat16") is torch.bfloat16
    resolve_device_dtype("auto", "auto") -> (device("cuda"), torch.bfloat16) on a GPU machine
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eyas.errors import EyasError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
SHORT: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
}
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a model can run in


LONG: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
}


def to_dtype(
    name: str | torch.dtype,
    *,
    what: str = "dtype",
    allowed: Iterable[torch.dtype] | None = None,
    also: Iterable[str] = (),
) -> torch.dtype | None:
    """A dtype name (either vocabulary) -> torch dtype; `allowed` limits it; the error names `what` and
    lists what it takes. `also`: the option's words besides dtypes (auto, keep), accepted as None for
    the caller to resolve, so an option taking `auto` is checked with one call."""
    if isinstance(name, str) and name in also:
        return None
    dt = name if isinstance(name, torch.dtype) else DTYPES.get(str(name).lower().removeprefix("torch."))
    allowed = tuple(allowed) if allowed is not None else tuple(SHORT)
    if dt not in allowed:
        takes = ", ".join([*also, *(SHORT[d] for d in allowed)])
        longs = ", ".join(LONG[d] for d in allowed)
        why = f"{SHORT[dt]} is not supported here" if dt is not None else "not a dtype eyas knows"
        raise EyasError(f"{what} {name}: {why}; it takes {takes} (or the long names {longs})")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> its short name (bf16, fp32, ...), the form stores and manifests record."""
    return SHORT.get(dtype, str(dtype).removeprefix("torch."))


def is_low_precision(name: str | torch.dtype | None) -> bool:
    """bf16 / fp16 / fp8 under any of their names."""
    dt = name if isinstance(name, torch.dtype) else DTYPES.get(str(name or "").lower().removeprefix("torch."))
    return dt in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def resolve_device(device: str, *, what: str = "--device") -> torch.device:
    """auto | cpu | cuda | cuda:N -> torch.device; refuses cuda where there is none."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise EyasError(f"{what}: `{device}` is not one of auto, cpu, cuda, cuda:N")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"{what} {device}: CUDA is not available on this machine; use --device cpu")
    return dev


def resolve_device_dtype(
    device: str,
    dtype: str | torch.dtype,
    *,
    what_device: str = "--device",
    what_dtype: str = "--model-dtype",
    auto_dtype: torch.dtype | None = None,
    allowed: Iterable[torch.dtype] = MODEL_DTYPES,
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) with `auto` resolved: the dtype is `auto_dtype` when given (a model's own),
    else bf16 on cuda; always fp32 on cpu (CPU bf16 matmuls are slow and this is where tests run)."""
    dev = resolve_device(device, what=what_device)
    if dtype == "auto":
        if dev.type == "cpu":
            return dev, torch.float32
        return dev, auto_dtype if auto_dtype in tuple(allowed) else torch.bfloat16
    return dev, to_dtype(dtype, what=what_dtype, allowed=allowed)
