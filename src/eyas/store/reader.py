"""StoreReader: random access to one sample's hidden states through memory-mapped shards.

`StoreReader(path).get(sample_id)` reads only that sample's rows (one contiguous byte range of its
shard; the OS pages in nothing else) and returns (aux_TAD, final_TD) dequantised to bf16 or the
requested dtype. `raw(sample_id)` gives the stored rows and scales as they are on disk, for
checksums and fault finding. Opening a store parses its manifest and each shard's header only.

`StoreReader(path, verify_reads=True)` (training) checks each sample the first time it is read:
its sha256 against the manifest and that every value is finite, raising EyasError with the sample
id. Key trade-off: the check costs one hash pass over the sample's bytes, paid once per sample per
reader (a set of verified ids), not per epoch, so a corrupt store stops training instead of
silently turning the drafter into NaN.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.store.format import DTYPES, MANIFEST, SCHEMA, ShardLayout, dequantize, read_shard_layout


class StoreReader:
    """A hidden-state store opened for reading. `.manifest`, `.sample_ids`, `len()`, `get(id)`."""

    def __init__(self, path: str | Path, *, verify_reads: bool = False):
        self.path = Path(path)
        self.verify_reads = verify_reads
        self._verified: set[str] = set()
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise EyasError(
                f"{self.path} is not a hidden-state store (no {MANIFEST}): run `eyas capture --out {self.path}` first"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EyasError(f"{mpath}: unreadable manifest ({exc})") from exc
        if not isinstance(self.manifest, dict):
            raise EyasError(f"{mpath}: expected a JSON object, got {type(self.manifest).__name__}")
        if self.manifest.get("schema") != SCHEMA:
            raise EyasError(f"{mpath}: schema {self.manifest.get('schema')!r}, expected {SCHEMA!r}")
        _check_manifest(self.manifest, mpath)
        self.dtype: str = self.manifest["dtype"]
        self.aux_layer_ids: list[int] = list(self.manifest["aux_layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.slots = len(self.aux_layer_ids) + 1
        self._records: dict[str, dict[str, Any]] = {}
        for rec in self.manifest["samples"]:
            self._records.setdefault(rec["id"], rec)  # duplicates are reported by verify
        self._layouts: dict[int, ShardLayout] = {}
        self._maps: dict[int, np.memmap] = {}

    @property
    def sample_ids(self) -> list[str]:
        return [rec["id"] for rec in self.manifest["samples"]]

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete"

    def __len__(self) -> int:
        return len(self.manifest["samples"])

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._records

    def record(self, sample_id: str) -> dict[str, Any]:
        try:
            return self._records[sample_id]
        except KeyError:
            raise EyasError(f"store {self.path} has no sample `{sample_id}`") from None

    def shard_path(self, index: int) -> Path:
        return self.path / self.manifest["shards"][index]["name"]

    def layout(self, index: int) -> ShardLayout:
        """The shard's header, checked against the manifest and the file size."""
        if index not in self._layouts:
            path = self.shard_path(index)
            if not path.is_file():
                raise EyasError(f"store {self.path}: shard {path.name} is missing")
            lay = read_shard_layout(path)
            size = os.path.getsize(path)
            info = self.manifest["shards"][index]
            if size != lay.file_bytes or size != info["bytes"]:
                raise EyasError(
                    f"store {self.path}: shard {path.name} is truncated or altered: {size} bytes on disk, "
                    f"header says {lay.file_bytes}, manifest says {info['bytes']}"
                )
            if (lay.dtype, lay.slots, lay.hidden_size, lay.rows) != (
                self.dtype,
                self.slots,
                self.hidden_size,
                info["rows"],
            ):
                raise EyasError(f"store {self.path}: shard {path.name} holds {lay} which disagrees with the manifest")
            self._layouts[index] = lay
        return self._layouts[index]

    def _map(self, index: int) -> np.memmap:
        if index not in self._maps:
            self.layout(index)
            self._maps[index] = np.memmap(self.shard_path(index), dtype=np.uint8, mode="r")
        return self._maps[index]

    def raw_bytes(self, sample_id: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The sample's stored bytes (memory-mapped views): hidden rows, then scales (fp8) or None."""
        rec = self.record(sample_id)
        lay, mm = self.layout(rec["shard"]), self._map(rec["shard"])
        a, b = rec["start"], rec["start"] + rec["tokens"]
        if b > lay.rows:
            raise EyasError(
                f"store {self.path}: sample {sample_id} rows [{a}, {b}) exceed shard {rec['shard']}'s {lay.rows} rows"
            )
        hidden = mm[lay.hidden_offset + a * lay.row_bytes : lay.hidden_offset + b * lay.row_bytes]
        scale = None
        if lay.scale_offset is not None:
            sb = lay.slots * 4
            scale = mm[lay.scale_offset + a * sb : lay.scale_offset + b * sb]
        return hidden, scale

    def raw(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_TLD in the stored dtype, scale_TL float32 or None), copied out of the map."""
        hidden_u8, scale_u8 = self.raw_bytes(sample_id)
        t = self.record(sample_id)["tokens"]
        hidden = (
            torch.from_numpy(np.array(hidden_u8))
            .view(DTYPES[self.dtype].torch_dtype)
            .view(t, self.slots, self.hidden_size)
        )
        scale = (
            None if scale_u8 is None else torch.from_numpy(np.array(scale_u8)).view(torch.float32).view(t, self.slots)
        )
        return hidden, scale

    def get_hidden(self, sample_id: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """All stored slots of a sample, [T, A+1, D] in `dtype` (slot A = final)."""
        if self.verify_reads and sample_id not in self._verified:
            self.check_sample(sample_id)
        hidden, scale = self.raw(sample_id)
        return dequantize(hidden, scale, dtype)

    def check_sample(self, sample_id: str) -> None:
        """Raise EyasError unless the sample's bytes match its manifest sha256 and all values are finite."""
        rec = self.record(sample_id)
        hidden_u8, scale_u8 = self.raw_bytes(sample_id)
        want = rec.get("sha256")
        if want:
            from eyas.store.writer import _sample_digest  # the writer's own digest, so both always agree

            if _sample_digest(hidden_u8, scale_u8) != want:
                raise EyasError(
                    f"store {self.path}: sample {sample_id} fails its checksum (shard "
                    f"{self.manifest['shards'][rec['shard']]['name']}): the data are corrupt; run "
                    f"`eyas verify --store {self.path}` and capture the bad samples again"
                )
        ok = _all_finite(hidden_u8, self.dtype) and (scale_u8 is None or _all_finite(scale_u8, "fp32"))
        if not ok:
            raise EyasError(
                f"store {self.path}: sample {sample_id} holds NaN/Inf hidden states; training on it would "
                f"make the drafter NaN. Run `eyas verify --store {self.path}` and capture it again"
            )
        self._verified.add(sample_id)

    def get(self, sample_id: str, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_TAD, final_TD) of one sample in `dtype`; aux slots follow `aux_layer_ids`."""
        hidden = self.get_hidden(sample_id, dtype)
        return hidden[:, :-1], hidden[:, -1]


# exponent bits that mark NaN/Inf (all ones), per stored dtype: (view dtype, mask). fp8 e4m3fn has
# no Inf, and its NaN is the all-ones exponent+mantissa pattern.
_NONFINITE = {
    "bf16": (np.uint16, 0x7F80, 0x7F80),
    "fp32": (np.uint32, 0x7F800000, 0x7F800000),
    "fp8": (np.uint8, 0x7F, 0x7F),
}


def _all_finite(raw_u8: np.ndarray, dtype: str) -> bool:
    """No NaN/Inf in raw stored bytes, by a bit test on the exponent: a few times faster on the CPU
    than torch.isfinite over bf16, which matters because training checks every sample once."""
    view, mask, bad = _NONFINITE[dtype]
    words = np.asarray(raw_u8).view(view)
    return not bool(np.any((words & view(mask)) == view(bad)))


_MANIFEST_FIELDS = {"dtype": str, "aux_layer_ids": list, "hidden_size": int, "samples": list, "shards": list}
_SAMPLE_FIELDS = ("id", "shard", "start", "tokens")


def _check_manifest(man: dict[str, Any], mpath: Path) -> None:
    """Refuse a manifest missing a field the reader needs (named), instead of a KeyError later."""
    for key, typ in _MANIFEST_FIELDS.items():
        if key not in man:
            raise EyasError(
                f"{mpath}: the manifest has no `{key}` field; it is damaged or not written by eyas (capture again)"
            )
        if not isinstance(man[key], typ) or (typ is int and isinstance(man[key], bool)):
            raise EyasError(f"{mpath}: manifest field `{key}` is a {type(man[key]).__name__}, expected {typ.__name__}")
    if man["dtype"] not in DTYPES:
        raise EyasError(f"{mpath}: manifest dtype {man['dtype']!r} is not one of {sorted(DTYPES)}")
    for i, rec in enumerate(man["samples"]):
        missing = [k for k in _SAMPLE_FIELDS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise EyasError(
                f"{mpath}: sample entry {i} lacks {', '.join(missing)}; the manifest is damaged (capture again)"
            )
        if not 0 <= rec["shard"] < len(man["shards"]):
            raise EyasError(
                f"{mpath}: sample {rec['id']} names shard {rec['shard']}, the manifest lists "
                f"{len(man['shards'])}; the manifest is damaged (capture again)"
            )
    for i, sh in enumerate(man["shards"]):
        missing = [k for k in ("name", "rows", "bytes") if not isinstance(sh, dict) or k not in sh]
        if missing:
            raise EyasError(
                f"{mpath}: shard entry {i} lacks {', '.join(missing)}; the manifest is damaged (capture again)"
            )
