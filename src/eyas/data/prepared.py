"""The prepared dataset on disk: what `eyas prepare` writes and every later stage reads.

Layout (a directory, written atomically: a crash never leaves one that looks complete):

    meta.json                 schema, target identity, tokenizer hash, settings, summary, per-split
                              fingerprints (sha256 of the split's arrays and ids)
    <split>.safetensors       input_ids int32 [total], loss_mask uint8 [total], offsets int64 [n+1]
    <split>.ids.json          the n sample ids (strings, unique within the dataset)

Sample i of a split is input_ids[offsets[i]:offsets[i+1]]. Splits are "train" and "eval".
Opening a split recomputes its fingerprint and refuses one that differs from meta.json's (files replaced,
swapped or edited after prepare): one hash pass over the arrays, cheap next to reading them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import atomic_directory, check_out_dir, honour_umask
from eyas.errors import EyasError

SCHEMA = "eyas.prepared/1"
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]: True where the token is part of an assistant answer


def _fingerprint(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, names: Sequence[str]) -> str:
    h = hashlib.sha256()
    for arr in (ids, mask, offsets):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(json.dumps(list(names)).encode())
    return h.hexdigest()


def pack(samples: Iterable[tuple[str, Sequence[int], Sequence[bool]]]) -> dict[str, Any]:
    names, ids, masks, offsets = [], [], [], [0]
    for sid, toks, mask in samples:
        if len(toks) != len(mask):
            raise ValueError(f"sample {sid}: {len(toks)} ids but {len(mask)} mask entries")
        names.append(str(sid))
        ids.append(np.asarray(toks, dtype=np.int32))
        masks.append(np.asarray(mask, dtype=np.uint8))
        offsets.append(offsets[-1] + len(toks))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return {
        "names": names,
        "input_ids": cat(ids, np.int32),
        "loss_mask": cat(masks, np.uint8),
        "offsets": np.asarray(offsets, dtype=np.int64),
    }


def write_prepared(
    out: Path,
    splits: dict[str, Iterable[tuple[str, Sequence[int], Sequence[bool]]]],
    meta: dict[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write a prepared dataset atomically. `splits` maps split name -> (id, token ids, loss mask)."""
    from safetensors.numpy import save_file

    out = Path(out)
    check_out_dir(out, kind="prepare", overwrite=overwrite)
    meta = dict(meta)
    meta["schema"] = SCHEMA
    meta["splits"] = {}
    seen: set[str] = set()
    with atomic_directory(out, overwrite=overwrite, kind="prepare") as tmp:
        for name, samples in splits.items():
            packed = pack(samples)
            counts = Counter(packed["names"])
            dup = sorted(seen.intersection(counts) | {k for k, c in counts.items() if c > 1})
            if dup:
                raise EyasError(
                    f"{len(dup)} sample id(s) appear more than once (split {name}; first: "
                    f"{', '.join(dup[:5])}): every sample needs its own id; give them distinct ids"
                )
            seen.update(packed["names"])
            save_file(
                {k: packed[k] for k in ("input_ids", "loss_mask", "offsets")},
                str(tmp / f"{name}.safetensors"),
            )
            honour_umask(tmp / f"{name}.safetensors")
            (tmp / f"{name}.ids.json").write_text(json.dumps(packed["names"]))
            meta["splits"][name] = {
                "samples": len(packed["names"]),
                "tokens": int(packed["offsets"][-1]),
                "assistant_tokens": int(packed["loss_mask"].sum()),
                "fingerprint": _fingerprint(
                    packed["input_ids"], packed["loss_mask"], packed["offsets"], packed["names"]
                ),
            }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


class PreparedSplit:
    """Random access to one split; arrays are memory-mapped by safetensors."""

    def __init__(self, root: Path, name: str, info: dict[str, Any], *, check: bool = True):
        from safetensors.numpy import load_file

        self.root, self.name, self.info = root, name, info
        path = root / f"{name}.safetensors"
        try:
            arrays = load_file(str(path))
            self.ids: list[str] = json.loads((root / f"{name}.ids.json").read_text())
        except Exception as exc:
            raise EyasError(f"prepared dataset {root}: cannot read split `{name}` ({exc})") from exc
        self._input_ids = arrays["input_ids"]
        self._loss_mask = arrays["loss_mask"]
        self.offsets = arrays["offsets"]
        if len(self.offsets) != len(self.ids) + 1:
            raise EyasError(
                f"prepared dataset {root}: split `{name}` has {len(self.ids)} ids but {len(self.offsets) - 1} samples"
            )
        self._index = {sid: i for i, sid in enumerate(self.ids)}
        if check and (now := self.content_fingerprint()) != info.get("fingerprint"):
            raise EyasError(
                f"prepared dataset {root}: split `{name}` ({path.name}, {name}.ids.json) does not match its "
                f"fingerprint in meta.json ({now[:12]} against {str(info.get('fingerprint'))[:12]}): its files "
                "were replaced, swapped or edited after `eyas prepare`; run `eyas prepare` again"
            )

    def content_fingerprint(self) -> str:
        """The fingerprint of the split's arrays and ids as they are on disk now."""
        return _fingerprint(self._input_ids, self._loss_mask, self.offsets, self.ids)

    @property
    def fingerprint(self) -> str:
        return self.info["fingerprint"]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.ids)

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise EyasError(f"prepared dataset {self.root}: no sample `{sample_id}` in split `{self.name}`") from None

    def __getitem__(self, i: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(
            id=self.ids[i],
            input_ids=torch.from_numpy(self._input_ids[a:b].astype(np.int64)),
            loss_mask=torch.from_numpy(self._loss_mask[a:b].astype(bool)),
        )

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class PreparedDataset:
    """A prepared dataset directory. `ds.split("train")[i]` -> Sample."""

    def __init__(self, root: str | Path, *, check: bool = True):
        root = Path(root)
        self.check = check  # (verify passes False: it reports a changed split as a failed check of its own)
        meta_path = root / "meta.json"
        if not meta_path.is_file():
            raise EyasError(f"{root} is not a prepared dataset (no meta.json): run `eyas prepare --out {root}` first")
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise EyasError(f"{meta_path}: malformed JSON ({exc})") from exc
        if self.meta.get("schema") != SCHEMA:
            raise EyasError(f"{root}: schema {self.meta.get('schema')!r}, expected {SCHEMA!r}")
        self.root = root
        self._splits: dict[str, PreparedSplit] = {}

    @property
    def split_names(self) -> list[str]:
        return list(self.meta["splits"])

    def split(self, name: str) -> PreparedSplit:
        if name not in self.meta["splits"]:
            raise EyasError(f"prepared dataset {self.root} has no split `{name}` (has {self.split_names})")
        if name not in self._splits:
            self._splits[name] = PreparedSplit(self.root, name, self.meta["splits"][name], check=self.check)
        return self._splits[name]

    @property
    def tokenizer_hash(self) -> str | None:
        return self.meta.get("tokenizer_hash")

    @property
    def target(self) -> dict[str, Any] | None:
        return self.meta.get("target")
