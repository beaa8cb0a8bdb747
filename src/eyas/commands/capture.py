"""`eyas capture`: run the target over a prepared split and store its hidden states.

Two backends write the same store (eyas/store): `transformers` runs the target in this process
(eyas/capture); `sglang` asks running SGLang servers with the eyas plugin for the states and checks
every sample before ingesting it (eyas/sglang, docs/sglang.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def capture(
    target: Optional[str] = typer.Option(None, help="Target: a local Hugging Face model directory, or `default` (SmolLM2-135M-Instruct). transformers backend: defaults to `default`; sglang backend: the server's model directory when it exists here (needed for `eyas verify` numbers)."),
    data: Path = typer.Option(..., help="Prepared dataset directory (from `eyas prepare`)."),
    split: str = typer.Option("train", help="Split of the prepared dataset to capture."),
    out: Path = typer.Option(..., help="Store directory; rerunning with the same settings resumes it."),
    layers: str = typer.Option("default", help="Aux layer ids, comma-separated, convention hf-input (id i = input to decoder layer i); default = EAGLE-3's 2,N//2,N-3 (sglang: the server's)."),
    dtype: str = typer.Option("bf16", help="Stored dtype: bf16, fp8 (e4m3, a scale per token and layer; half the bytes) or fp32."),
    limit: int = typer.Option(None, help="Capture only the first N samples of the split."),
    backend: str = typer.Option("transformers", help="`transformers` (the target runs here) or `sglang` (SGLang servers with the eyas plugin, see --url)."),
    device: str = typer.Option("cpu", help="transformers: where the target runs: cpu, cuda or cuda:K."),
    model_dtype: str = typer.Option("auto", help="transformers: dtype the target runs in: bf16, fp32, or auto (bf16 on CUDA, fp32 on CPU)."),
    token_budget: int = typer.Option(16384, help="transformers: most tokens per forward (batch size x padded length); longer samples run alone."),
    shard_bytes: str = typer.Option("1GB", help="transformers: commit a shard once it holds this many bytes (e.g. 512MB, 2GiB)."),
    queue_depth: int = typer.Option(3, help="transformers: batches in flight between forward and disk (pinned buffers on CUDA)."),
    url: Optional[List[str]] = typer.Option(None, help="sglang: server base URL, e.g. http://127.0.0.1:30000; repeat for several servers (data parallel)."),
    sglang_dump_dir: Optional[Path] = typer.Option(None, help="sglang: the plugin's dump directory as seen from here (default: what the server reports)."),
    sglang_concurrency: int = typer.Option(16, help="sglang: requests in flight over all servers."),
    sglang_cache_bypass: str = typer.Option("auto", help="sglang: how a radix-cache prefix hit is prevented: auto (unique cache salt per request, or nothing when the cache is disabled), salt, logprob, none."),
    sglang_max_retries: int = typer.Option(5, help="sglang: retries of a request on transient HTTP errors (exponential backoff)."),
    sglang_request_timeout: float = typer.Option(600.0, help="sglang: seconds to wait for one request."),
    sglang_dump_wait: float = typer.Option(60.0, help="sglang: seconds to wait for a sample's dump to appear after its request returns."),
) -> dict:
    """Capture the target's aux and final hidden states for every sample of a prepared split."""
    from eyas.capture.run import CaptureSettings, parse_bytes, parse_layers, run_capture
    from eyas.errors import EyasError

    from eyas.common import check_out_path
    from eyas.config_checks import check_url

    check_out_path(out)
    if backend == "sglang":
        if not url:
            raise EyasError("--backend sglang needs at least one --url of a running SGLang server (see docs/sglang.md)")
        url = [check_url(u, option="--url") for u in url]
        for name, value in (("--sglang-concurrency", sglang_concurrency), ("--sglang-max-retries", sglang_max_retries),
                            ("--sglang-request-timeout", sglang_request_timeout), ("--sglang-dump-wait", sglang_dump_wait)):
            if not value == value or value < (1 if name == "--sglang-concurrency" else 0):  # NaN or out of range
                raise EyasError(f"{name} must be >= {1 if name == '--sglang-concurrency' else 0}, got {value}")
        from eyas.sglang.client import capture_from_sglang

        return capture_from_sglang(
            url, data, split, out, parse_layers(layers), target=target, dump_dir=sglang_dump_dir,
            concurrency=sglang_concurrency, cache_bypass=sglang_cache_bypass, dtype=dtype, limit=limit,
            max_retries=sglang_max_retries, request_timeout_s=sglang_request_timeout, dump_wait_s=sglang_dump_wait,
        )
    if backend != "transformers":
        raise EyasError(f"--backend: `{backend}`; choose transformers or sglang")
    if url:
        raise EyasError("--url is for --backend sglang; the transformers backend runs the target here")
    settings = CaptureSettings(
        target=target or "default", data=data, split=split, out=out, layers=parse_layers(layers), dtype=dtype,
        device=device, model_dtype=model_dtype, token_budget=token_budget, shard_bytes=parse_bytes(shard_bytes),
        limit=limit, queue_depth=queue_depth,
    )
    return run_capture(settings)
