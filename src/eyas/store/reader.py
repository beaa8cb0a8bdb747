"""StoreReader: random access to one sample's hidden states through memory-mapped shards.

`StoreReader(path).get(sample_id)` reads only that sample's rows (one contiguous byte range of its
shard; the OS pages in nothing else) and returns (aux_TAD, final_TD) dequantised to bf16 or the
requested dtype. `raw(sample_id)` gives the stored rows and scales as they are on disk, for
checksums and fault finding. Opening a store parses its manifest and each shard's header only.
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

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise EyasError(f"{self.path} is not a hidden-state store (no {MANIFEST}): run `eyas capture --out {self.path}` first")
        try:
            self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EyasError(f"{mpath}: unreadable manifest ({exc})") from exc
        if self.manifest.get("schema") != SCHEMA:
            raise EyasError(f"{mpath}: schema {self.manifest.get('schema')!r}, expected {SCHEMA!r}")
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
            if (lay.dtype, lay.slots, lay.hidden_size, lay.rows) != (self.dtype, self.slots, self.hidden_size, info["rows"]):
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
            raise EyasError(f"store {self.path}: sample {sample_id} rows [{a}, {b}) exceed shard {rec['shard']}'s {lay.rows} rows")
        hidden = mm[lay.hidden_offset + a * lay.row_bytes: lay.hidden_offset + b * lay.row_bytes]
        scale = None
        if lay.scale_offset is not None:
            sb = lay.slots * 4
            scale = mm[lay.scale_offset + a * sb: lay.scale_offset + b * sb]
        return hidden, scale

    def raw(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_TLD in the stored dtype, scale_TL float32 or None), copied out of the map."""
        hidden_u8, scale_u8 = self.raw_bytes(sample_id)
        t = self.record(sample_id)["tokens"]
        hidden = torch.from_numpy(np.array(hidden_u8)).view(DTYPES[self.dtype].torch_dtype).view(t, self.slots, self.hidden_size)
        scale = None if scale_u8 is None else torch.from_numpy(np.array(scale_u8)).view(torch.float32).view(t, self.slots)
        return hidden, scale

    def get_hidden(self, sample_id: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """All stored slots of a sample, [T, A+1, D] in `dtype` (slot A = final)."""
        hidden, scale = self.raw(sample_id)
        return dequantize(hidden, scale, dtype)

    def get(self, sample_id: str, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_TAD, final_TD) of one sample in `dtype`; aux slots follow `aux_layer_ids`."""
        hidden = self.get_hidden(sample_id, dtype)
        return hidden[:, :-1], hidden[:, -1]
