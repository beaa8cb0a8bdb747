"""Capture target hidden states from SGLang servers (the scale path: TP/EP-served targets).

- core.py     pure torch: split packed EXTEND forwards per request, stitch chunked prefill by
              absolute position, reject prefix-cache hits, write atomic dumps (no sglang import)
- plugin.py   the only SGLang-version-specific module: entry point, hooks, start-up contract check
- client.py   `capture_from_sglang`: preflight, bounded concurrent /generate, per-sample checks,
              ingestion into eyas.store, resume, retries, rejected-sample list
- standin.py  a local HTTP server implementing SGLang's /generate + server-info contract on a
              transformers model, writing dumps through core's write path (what CI tests against)

See docs/sglang.md for installing the plugin into a real server.
"""
