"""Capture target hidden states into a store (the transformers backend, in-process).

- `batching`: batches by length under a token budget, right padding, rows_index of real tokens.
- `hooks.forward_capture_packed`: one base-model forward whose hooks write the real rows of each aux
  layer and of the final norm straight into the stored layout and dtype (fp8 quantised on device).
- `pipeline.CapturePipeline`: forward -> side-stream D2H into pinned slots -> writer thread, so the
  GPU never waits on copies or disk.
- `run.run_capture(CaptureSettings(...))`: what `eyas capture` runs (create or resume a store,
  disk-space check, progress, summary).

Other backends (an SGLang dump ingester) write through `eyas.store.StoreWriter` directly.
"""
