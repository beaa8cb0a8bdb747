"""HiddenStateDataset: a store joined with the prepared dataset it was captured from, for training.

Item i is the store's i-th sample: {"id", "input_ids" int64[T], "loss_mask" bool[T],
"aux" [T, A, D], "final" [T, D]} (aux slots in `aux_layer_ids` order, dequantised to `dtype`).
Token ids come from the prepared dataset (path recorded in the manifest, or `prepared_path`), whose
split fingerprint must equal the one recorded at capture: hidden states of other tokens would train
the drafter on garbage, so a changed dataset is refused, not patched over. Reads are memory-mapped,
so DataLoader workers share the page cache and a sample costs only its own bytes.

Training refuses corrupt data: a sample listed twice in the manifest is refused here, and each
sample's checksum and finiteness are checked the first time it is read (StoreReader verify_reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.store.reader import StoreReader


class HiddenStateDataset(torch.utils.data.Dataset):
    """Training view of a store (see the module docstring)."""

    def __init__(
        self,
        store_path: str | Path,
        split: str | None = None,
        *,
        prepared_path: str | Path | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        from eyas.data.prepared import PreparedDataset
        from eyas.locks import require_idle

        require_idle(store_path, what="store")  # a capture still running: training would see a part of it
        self.store = StoreReader(store_path, verify_reads=True)
        seen: set[str] = set()
        dups = [sid for sid in self.store.sample_ids if sid in seen or seen.add(sid)]
        if dups:
            raise EyasError(
                f"store {store_path} lists {len(dups)} sample(s) more than once (first: {dups[0]}); "
                f"training would weight them twice. Run `eyas verify --store {store_path}` and capture again"
            )
        self.dtype = dtype
        prep = self.store.manifest.get("prepared") or {}
        if split is not None and prep.get("split") not in (None, split):
            raise EyasError(
                f"store {store_path} holds split `{prep.get('split')}`, not `{split}`: capture split `{split}` into its own store"
            )
        root = Path(prepared_path) if prepared_path is not None else Path(prep.get("path", ""))
        if not (root / "meta.json").is_file():
            raise EyasError(
                f"store {store_path}: its prepared dataset {str(root)!r} is not there; pass its new location (--data)"
            )
        self.split = PreparedDataset(root).split(split or prep["split"])
        if self.split.fingerprint != prep.get("fingerprint"):
            raise EyasError(
                f"the prepared dataset {root} (split {self.split.name}) changed since the store {store_path} was captured "
                f"(fingerprint {self.split.fingerprint[:12]}, store has {str(prep.get('fingerprint'))[:12]}): the stored "
                "hidden states belong to other tokens; capture again"
            )
        if not self.store.complete:
            from eyas.common import log

            log(
                f"eyas: store {store_path} is not complete ({len(self.store)} samples so far); rerun `eyas capture` to finish it"
            )
        self.ids = self.store.sample_ids

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> list[int]:
        """Token count of each item (from the manifest: no shard is read), for length-bucketed sampling."""
        return [rec["tokens"] for rec in self.store.manifest["samples"]]

    def __getitem__(self, i: int) -> dict[str, Any]:
        sid = self.ids[i]
        sample = self.split[self.split.index_of(sid)]
        aux, final = self.store.get(sid, self.dtype)
        if aux.shape[0] != sample.input_ids.numel():
            raise EyasError(
                f"store {self.store.path}: sample {sid} has {aux.shape[0]} rows but {sample.input_ids.numel()} tokens"
            )
        return {"id": sid, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask, "aux": aux, "final": final}
