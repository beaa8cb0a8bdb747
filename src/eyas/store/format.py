"""The on-disk layout of a hidden-state store: stored dtypes, fp8 scaling, and shard files.

A store is a directory:

    manifest.json               schema, target identity, tokenizer hash, prepared dataset (path, split,
                                fingerprint), aux layer ids + convention, stored dtype, hidden size,
                                committed shards, and per sample: id, token count, shard, first row,
                                sha256 of its stored bytes; fields_sha256 covers the fields
                                that say how to read and judge it (format.MANIFEST_FIELDS)
    shard-00000.safetensors     committed shards (never partial: written as .shard-*.tmp, fsynced,
    shard-00001.safetensors     renamed, then listed in the manifest)

Each shard is a standard safetensors file holding the samples' rows back to back:

    hidden  [N, L, D]   stored dtype (BF16, F8_E4M3 or F32); L = A + 1 slots per token:
                        slots 0..A-1 = the aux layers in `aux_layer_ids` order (inputs to those
                        decoder layers, convention hf-input), slot A = the final hidden state after
                        the final norm (the teacher: logits = lm_head(slot A))
    scale   [N, L]      F32, fp8 stores only: value = float(hidden) * scale, one scale per token and
                        slot (amax / 448 of that row), so a token with large activations does not
                        crush the precision of the others

A sample of T tokens is rows [start, start + T) of one shard: one contiguous byte range of `hidden`
(and one of `scale`), which is what the per-sample sha256 covers (hidden bytes, then scale bytes).
The safetensors header is padded with spaces to a fixed HEADER_BYTES so that rows can be streamed
to disk before the row count is known; the data starts at a 4 KiB boundary.

Shape legend: N rows (tokens) in a shard, T tokens of one sample, L = A + 1 stored slots,
A aux layers, D hidden size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.dtypes import to_dtype
from eyas.errors import EyasError

SCHEMA = "eyas.store/1"
MANIFEST = "manifest.json"
HEADER_BYTES = 4096  # 8-byte length + JSON header padded with spaces; tensor data starts here
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CHECKSUM = "sha256"
# Manifest fields that decide how a store is read and judged (dtype, layer ids, the tolerance's
# model dtype, the target and data it came from); `fields_sha256` covers them, so an edit shows.
MANIFEST_FIELDS = (
    "schema",
    "checksum",
    "dtype",
    "aux_layer_ids",
    "convention",
    "hidden_size",
    "slots",
    "bytes_per_token",
    "model_dtype",
    "target",
    "tokenizer_hash",
    "prepared",
)
# Covered when present (older stores' checksums stay valid): a serving engine's calibrated numbers,
# which set the limits `eyas verify` holds that store to (eyas.store.numerics).
OPTIONAL_MANIFEST_FIELDS = ("engine_numerics",)


def manifest_fields_sha256(manifest: dict) -> str:
    """sha256 of the MANIFEST_FIELDS of a manifest (canonical JSON), stored as its `fields_sha256`."""
    payload = {k: manifest.get(k) for k in MANIFEST_FIELDS}
    payload.update({k: manifest[k] for k in OPTIONAL_MANIFEST_FIELDS if k in manifest})
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_fields_problem(manifest: dict, path: Path) -> str | None:
    """Why the manifest of the store at `path` cannot be trusted (its fields edited after capture), else None (also
    for a manifest written before fields_sha256 existed: its callers say that)."""
    recorded = manifest.get("fields_sha256")
    if recorded is None or recorded == manifest_fields_sha256(manifest):
        return None
    return (
        f"{path}/manifest.json: its fields (dtype, aux_layer_ids, model_dtype, target, prepared, ...) do not match "
        "their checksum fields_sha256: the manifest was edited after capture; restore it or capture again"
    )


@dataclass(frozen=True)
class StoredDtype:
    name: str  # the CLI / manifest name
    torch_dtype: torch.dtype
    safetensors: str  # the safetensors dtype tag
    itemsize: int
    scaled: bool  # carries a per-token-and-slot scale tensor


DTYPES: dict[str, StoredDtype] = {  # names from eyas.dtypes' vocabulary; only these three are stored
    "bf16": StoredDtype("bf16", to_dtype("bf16"), "BF16", 2, False),
    "fp8": StoredDtype("fp8", to_dtype("fp8"), "F8_E4M3", 1, True),
    "fp32": StoredDtype("fp32", to_dtype("fp32"), "F32", 4, False),
}


def stored_dtype(name: str) -> StoredDtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise EyasError(f"--store-dtype: `{name}` is not a stored dtype; choose one of {sorted(DTYPES)}") from None


def bytes_per_token(dtype: str, *, slots: int, hidden_size: int) -> int:
    """Bytes one token takes on disk: slots x D x itemsize, plus slots x 4 for fp8 scales."""
    sd = stored_dtype(dtype)
    return slots * hidden_size * sd.itemsize + (slots * 4 if sd.scaled else 0)


# ---------------------------------------------------------------------------------------------
# fp8 e4m3 with a scale per row (token, slot)


def quantize_fp8(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> (q float8_e4m3fn [..., D], scale float32 [...]) with x ~= q * scale.

    scale = amax(|row|) / 448, so every row uses the full e4m3 range; an all-zero row gets scale 1.
    A NaN/Inf row yields a NaN/Inf scale, which the store's finite check then reports.
    """
    xf = x_ND.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(hidden: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows -> `dtype` (fp8 rows are multiplied by their scale in fp32 first)."""
    if scale is None:
        return hidden.to(dtype)
    return (hidden.float() * scale.unsqueeze(-1)).to(dtype)


def encode_rows(hidden_NLD: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float rows -> (stored rows, scale or None), contiguous, on the input's device."""
    sd = stored_dtype(dtype)
    if sd.scaled:
        q, scale = quantize_fp8(hidden_NLD)
        return q.contiguous(), scale.contiguous()
    return hidden_NLD.to(sd.torch_dtype).contiguous(), None


# ---------------------------------------------------------------------------------------------
# shard header


def shard_header(*, rows: int, slots: int, hidden_size: int, dtype: str) -> bytes:
    """The fixed-size safetensors header for a shard of `rows` rows (padded to HEADER_BYTES)."""
    sd = stored_dtype(dtype)
    hidden_bytes = rows * slots * hidden_size * sd.itemsize
    header: dict = {
        "__metadata__": {"schema": SCHEMA, "layout": "hidden[N, A+1, D]; slot A = final post-norm"},
        "hidden": {"dtype": sd.safetensors, "shape": [rows, slots, hidden_size], "data_offsets": [0, hidden_bytes]},
    }
    if sd.scaled:
        header["scale"] = {
            "dtype": "F32",
            "shape": [rows, slots],
            "data_offsets": [hidden_bytes, hidden_bytes + rows * slots * 4],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    room = HEADER_BYTES - 8
    assert len(text) <= room, f"shard header of {len(text)} bytes does not fit in {room}"
    return struct.pack("<Q", room) + text + b" " * (room - len(text))


@dataclass(frozen=True)
class ShardLayout:
    """Where a shard's tensors lie in the file (parsed from its header)."""

    rows: int
    slots: int
    hidden_size: int
    dtype: str
    data_start: int  # byte offset of the data section
    hidden_offset: int  # absolute byte offsets
    scale_offset: int | None
    file_bytes: int  # the size the header implies

    @property
    def row_bytes(self) -> int:
        return self.slots * self.hidden_size * DTYPES[self.dtype].itemsize


def read_shard_layout(path: Path) -> ShardLayout:
    """Parse a shard's safetensors header (a few KB read; the data is never touched)."""
    by_tag = {sd.safetensors: name for name, sd in DTYPES.items()}
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 1 << 24:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        hidden = header["hidden"]
        dtype = by_tag[hidden["dtype"]]
        rows, slots, d = hidden["shape"]
        start = 8 + n
        scale = header.get("scale")
        end = max(hidden["data_offsets"][1], scale["data_offsets"][1] if scale else 0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise EyasError(f"shard {path}: unreadable header ({type(exc).__name__}: {exc})") from exc
    return ShardLayout(
        rows=rows,
        slots=slots,
        hidden_size=d,
        dtype=dtype,
        data_start=start,
        hidden_offset=start + hidden["data_offsets"][0],
        scale_offset=start + scale["data_offsets"][0] if scale else None,
        file_bytes=start + end,
    )
