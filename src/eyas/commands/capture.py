"""`eyas capture`: run the target over a prepared split and store its hidden states.

Two backends write the same store (eyas/store): `transformers` runs the target in this process
(eyas/capture); `sglang` asks running SGLang servers with the eyas plugin for the states and checks
every sample before ingesting it (eyas/sglang, docs/sglang.md). The options shared by both are
CaptureSettings' fields (eyas/capture/run.py, via eyas/cli_options.py); the sglang backend's own are
declared here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_options import options_from


@options_from("eyas.capture.run:CaptureSettings")
def capture(
    cfg,
    backend: str = typer.Option(
        "transformers",
        help="`transformers` (the target runs here) or `sglang` (SGLang servers with the eyas plugin, see --url).",
    ),
    url: list[str] | None = typer.Option(
        None, help="sglang: server base URL, e.g. http://127.0.0.1:30000; repeat for several servers (data parallel)."
    ),
    sglang_dump_dir: Path | None = typer.Option(
        None, help="sglang: the plugin's dump directory as seen from here (default: what the server reports)."
    ),
    sglang_concurrency: int = typer.Option(16, help="sglang: requests in flight at each server."),
    sglang_cache_bypass: str = typer.Option(
        "auto",
        help="sglang: how a radix-cache prefix hit is prevented: auto (nothing when the cache is disabled, else the "
        "first the server offers of plugin, salt, logprob), plugin (the eyas plugin caps the match), salt, logprob, none.",
    ),
    sglang_max_retries: int = typer.Option(
        5, help="sglang: retries of a request on transient HTTP errors (exponential backoff)."
    ),
    sglang_request_timeout: float = typer.Option(600.0, help="sglang: seconds to wait for one request."),
    sglang_dump_wait: float = typer.Option(
        60.0, help="sglang: seconds to wait for a sample's dump to appear after its request returns."
    ),
    sglang_memory_gb: float | None = typer.Option(
        None,
        help="sglang: GiB of states this process holds at once between the servers and the store (a sample "
        "is sent when its states fit; a disk slower than the servers then waits instead of filling memory); "
        "default: an eighth of this machine's memory.",
    ),
    sglang_procs: int = typer.Option(
        0,
        help="sglang: processes that share the requests and read, check and encode their dumps, while this one "
        "only stores (0: this process does it all; more, for servers faster than one Python process can keep fed).",
    ),
) -> dict:
    """Capture the target's aux and final hidden states for every sample of a prepared split."""
    from eyas.capture.run import run_capture
    from eyas.config_checks import check_url
    from eyas.errors import EyasError

    if backend == "sglang":
        if not url:
            raise EyasError("--backend sglang needs at least one --url of a running SGLang server (see docs/sglang.md)")
        url = [check_url(u, option="--url") for u in url]
        for name, value in (
            ("--sglang-concurrency", sglang_concurrency),
            ("--sglang-max-retries", sglang_max_retries),
            ("--sglang-request-timeout", sglang_request_timeout),
            ("--sglang-dump-wait", sglang_dump_wait),
        ):
            if not value == value or value < (1 if name == "--sglang-concurrency" else 0):  # NaN or out of range
                raise EyasError(f"{name} must be >= {1 if name == '--sglang-concurrency' else 0}, got {value}")
        if sglang_memory_gb is not None and not sglang_memory_gb > 0:  # NaN too
            raise EyasError(f"--sglang-memory-gb must be > 0, got {sglang_memory_gb}")
        if sglang_procs < 0:
            raise EyasError(f"--sglang-procs must be >= 0, got {sglang_procs}")
        from eyas.sglang.client import capture_from_sglang

        return capture_from_sglang(
            url,
            cfg.data,
            cfg.split,
            cfg.out,
            cfg.aux_layers,
            target=cfg.target,
            dump_dir=sglang_dump_dir,
            concurrency=sglang_concurrency,
            cache_bypass=sglang_cache_bypass,
            dtype=cfg.store_dtype,
            limit=cfg.limit,
            max_retries=sglang_max_retries,
            request_timeout_s=sglang_request_timeout,
            dump_wait_s=sglang_dump_wait,
            calibrate=cfg.sglang_calibrate,
            device=cfg.device,
            memory_bytes=None if sglang_memory_gb is None else int(sglang_memory_gb * 2**30),
            procs=sglang_procs,
        )
    if backend != "transformers":
        raise EyasError(f"--backend: `{backend}`; choose transformers or sglang")
    if url:
        raise EyasError("--url is for --backend sglang; the transformers backend runs the target here")
    return run_capture(cfg)
