"""Write the hidden states of an eyas store in SpecForge 0.2.0's offline EAGLE-3 training format.

SpecForge's offline trainer (`specforge train` with `data.hidden_states_path`) lists every `*.ckpt`
file under a directory (sorted by name, one sample a file) and `torch.load`s each one (mmap). What it
reads, from the 0.2.0 wheel (runtime/data_plane/offline_reader.py, feature_store.load_feature_file,
data/preprocessing.process_offline_eagle3_sample):

| key                | shape      | dtype        | eyas source                                    |
|--------------------|------------|--------------|------------------------------------------------|
| `input_ids`        | [T]        | int64        | the prepared dataset's token ids               |
| `loss_mask`        | [T]        | int64 (0/1)  | the prepared assistant-only mask (token t = 1 when t is an answer token) |
| `aux_hidden_state` | [1, T, 3H] | bfloat16     | the store's aux slots low/mid/high, concatenated in that order |
| `hidden_state`     | [1, T, H]  | bfloat16     | the store's final slot: the target's post-norm final state (SpecForge applies the target's lm_head to it) |

SpecForge itself zeroes the last position's mask and shifts ids and teacher states by one
(TargetHead.preprocess); the converter writes the unshifted sequence, as SpecForge's own capture does.

Also writes `vocab_mapping.pt` ({"d2t": int64 offsets [V], "t2d": bool [Vt]}, SpecForge's
`model.vocab_mapping_path` format, same conventions as eyas) from an eyas drafter with --drafter, so
both trainers use one draft vocabulary, and `eyas_convert.json` (source store, sample ids, counts).

Resumable: a sample file is written to a temporary name and renamed, and existing files are kept.
Disk: the files hold the same bf16 values as a bf16 store: tokens x 4 x H x 2 bytes.

    PYTHONPATH=src python lab/scripts/specforge_convert.py --store STORE --out DIR [--limit N] [--drafter DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

MANIFEST = "eyas_convert.json"


def sample_file(out: Path, index: int) -> Path:
    return out / f"data_{index:08d}.ckpt"  # zero-padded: SpecForge sorts names, so file order = store order


def convert(
    store: Path, out: Path, *, limit: int | None = None, max_length: int | None = None, drafter: Path | None = None
) -> dict:
    """Write one SpecForge sample file per store sample (the store's order); returns the manifest."""
    from eyas.common import log, progress
    from eyas.errors import EyasError
    from eyas.train.data import open_store, store_order

    reader, split, man = open_store(store)
    out.mkdir(parents=True, exist_ok=True)
    existing = out / MANIFEST
    if not existing.exists() and any(p.suffix == ".ckpt" for p in out.iterdir()):
        raise EyasError(f"--out {out} holds .ckpt files that this converter did not write; choose an empty directory")
    if existing.exists():
        old = json.loads(existing.read_text())
        if old.get("store") != str(Path(store).resolve()) or old.get("max_length") != max_length:
            raise EyasError(
                f"--out {out} holds a conversion of {old.get('store')} (max_length {old.get('max_length')}); "
                "choose another --out"
            )
    order = store_order(reader, split)[: limit or None]
    tokens = 0
    bar = progress(len(order), "convert", "sample")
    ids_written = []
    for k, idx in enumerate(order):
        s = split[idx]
        path = sample_file(out, k)
        T = len(s.input_ids) if max_length is None else min(len(s.input_ids), max_length)
        tokens += T
        ids_written.append(s.id)
        if not path.exists():
            aux_TAD, final_TD = reader.get(s.id, dtype=torch.bfloat16)
            if aux_TAD.shape[0] < T:
                raise EyasError(f"store {store}: sample {s.id} has {aux_TAD.shape[0]} rows, its prepared ids {T}")
            record = {
                "input_ids": torch.as_tensor(s.input_ids[:T], dtype=torch.long).clone(),
                "loss_mask": torch.as_tensor(s.loss_mask[:T]).to(torch.long).clone(),
                "aux_hidden_state": aux_TAD[:T].reshape(1, T, -1).contiguous().clone(),  # [1, T, A*H]: low|mid|high
                "hidden_state": final_TD[:T].reshape(1, T, -1).contiguous().clone(),
            }
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            torch.save(record, tmp)
            os.replace(tmp, path)
        bar.update(1)
    bar.close()
    manifest = {
        "schema": "eyas.specforge-offline/1",
        "store": str(Path(store).resolve()),
        "samples": len(order),
        "tokens": tokens,
        "max_length": max_length,
        "hidden_size": int(man["hidden_size"]),
        "aux_layer_ids_hf_input": list(man["aux_layer_ids"]),
        "sample_ids": ids_written,
        "files": "data_%08d.ckpt",
    }
    if drafter is not None:
        manifest["vocab_mapping"] = str(write_vocab_mapping(drafter, out / "vocab_mapping.pt"))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"specforge_convert: {len(order)} samples, {tokens:,} tokens -> {out}")
    return manifest


def write_vocab_mapping(drafter: Path, path: Path) -> Path:
    """An eyas (or SGLang-layout) drafter's d2t/t2d as SpecForge's vocab_mapping.pt."""
    from eyas.drafter.reader import read_drafter

    ckpt = read_drafter(drafter)
    d2t = ckpt.weights["d2t"].to(torch.long).cpu()
    t2d = ckpt.weights["t2d"].to(torch.bool).cpu()
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="convert only the first N store samples")
    ap.add_argument("--max-length", type=int, default=None, help="truncate samples to N tokens")
    ap.add_argument("--drafter", type=Path, default=None, help="also write vocab_mapping.pt from this drafter")
    args = ap.parse_args()
    from eyas.errors import EyasError

    try:
        m = convert(args.store, args.out, limit=args.limit, max_length=args.max_length, drafter=args.drafter)
    except EyasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({k: v for k, v in m.items() if k != "sample_ids"}))


if __name__ == "__main__":
    main()
