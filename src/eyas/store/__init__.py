"""Hidden-state stores: sharded safetensors + a manifest, written atomically, read by memory map.

Public API (see each module for details):

- `StoreSpec(aux_layer_ids=, hidden_size=, dtype="bf16"|"fp8"|"fp32", convention="hf-input",
  target=model_identity(...), tokenizer_hash=, prepared={path, split, fingerprint, limit, samples},
  model_dtype=, producer={})`: what a store holds; checked when a store is resumed.
- `StoreWriter(path, spec, shard_bytes=1<<30)`: create or resume a store. `.committed_ids` (skip
  these), `.add(sample_id, aux_TAD, final_TD)`, `.add_packed(ids, lengths, hidden_NLD, scale_NL)`
  (rows already in the stored dtype), `.commit()`, `.close(complete=True)`, `.abort()`.
- `StoreReader(path)`: `.manifest` (dict), `.sample_ids`, `len()`, `.get(sample_id, dtype=bf16) ->
  (aux_TAD, final_TD)`, `.get_hidden(sample_id) -> [T, A+1, D]`, `.raw(sample_id)` (stored dtype).
- `HiddenStateDataset(store_path, split=None)`: items `{"id", "input_ids", "loss_mask", "aux", "final"}`.
- `verify_store(store, numbers=8, seed=None, tolerance=None, device="cpu", invariants=True)`: coverage,
  every-sample invariants and a fresh random recompute; raises `CheckFailed` listing failing
  samples (eyas.store.verify, eyas.store.invariants).

Layout, dtypes and fp8 scaling: eyas/store/format.py.
"""

from eyas.store.dataset import HiddenStateDataset
from eyas.store.format import SCHEMA, bytes_per_token, dequantize, quantize_fp8
from eyas.store.reader import StoreReader
from eyas.store.writer import StoreSpec, StoreWriter

__all__ = [
    "SCHEMA",
    "HiddenStateDataset",
    "StoreReader",
    "StoreSpec",
    "StoreWriter",
    "bytes_per_token",
    "dequantize",
    "quantize_fp8",
]
