"""`eyas regenerate`: replace every assistant turn with the target's own answer (see eyas/regen/)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def regenerate(
    out: Path = typer.Option(..., "--out", help="Output directory (chats.jsonl + meta.json). An existing run with the same settings resumes."),
    source: str = typer.Option("sharegpt", "--source", help="Chats: `sharegpt` (embedded default), a .json/.jsonl file (OpenAI `messages` or ShareGPT `conversations`), or a dataset saved with save_to_disk."),
    target: str = typer.Option("default", "--target", help="Target model directory (Hugging Face layout); `default` = embedded SmolLM2-135M-Instruct. With --server-url: the model the servers serve (recorded as identity)."),
    engine: str = typer.Option("auto", "--engine", help="auto (server if --server-url, else static when the architecture is supported, else generate), static (static KV cache + CUDA graphs), generate (transformers generate), server."),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", help="Answer token limit per turn; answers that reach it are marked truncated."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="Keep only the first N user turns of each conversation."),
    max_len: int = typer.Option(2048, "--max-len", help="Context for prompt + answer (local engines); a prompt leaving no room is counted as context_overflow."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples from softmax(logits / T)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (with --temperature > 0)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed; each (conversation, turn) gets its own reproducible stream."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Read at most this many source records."),
    hf_split: Optional[str] = typer.Option(None, "--hf-split", help="Split to read when --source is a saved DatasetDict."),
    batch_size: int = typer.Option(0, "--batch-size", help="Rows decoded together (local engines); 0 = auto (8 on CPU, up to 1024 on GPU as memory allows)."),
    attention: str = typer.Option("auto", "--attention", help="Static engine decode attention: auto (per-row Triton kernel on CUDA when triton is installed, else sdpa), triton, sdpa (masked, over a span covering every row)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (GPU: the target's dtype, bfloat16 for an fp32 checkpoint; CPU: float32), float32, bfloat16, float16."),
    continue_after_truncated: bool = typer.Option(False, "--continue-after-truncated", help="Answer later turns after an answer cut at --max-new-tokens (default: stop the conversation there)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing --out and start over."),
    server_url: Optional[List[str]] = typer.Option(None, "--server-url", help="OpenAI-compatible server base URL (repeat for several), e.g. http://127.0.0.1:30000."),
    server_model: Optional[str] = typer.Option(None, "--server-model", help="Served model name (default: the first id from GET /v1/models)."),
    concurrency: int = typer.Option(64, "--concurrency", help="Server requests in flight, over all URLs."),
    retries: int = typer.Option(4, "--retries", help="Retries per server request on connection errors, timeouts, 429 and 5xx (exponential backoff)."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds to wait for one server answer."),
) -> dict:
    """Regenerate the assistant turns of a chat dataset with the target itself, turn by turn."""
    from eyas.common import check_out_path, require_owned
    from eyas.config_checks import check_device, check_url, check_value
    from eyas.errors import EyasError
    from eyas.regen.run import RegenConfig, regenerate as run

    # numbers and paths are checked here, before any source is read or model loaded
    check_out_path(out)
    if overwrite:
        require_owned(out, option="--overwrite", kind="regenerate")
    check_value(max_new_tokens, "--max-new-tokens", ge=1)
    check_value(max_turns, "--max-turns", ge=1, optional=True)
    check_value(temperature, "--temperature", ge=0)
    check_value(top_p, "--top-p", gt=0, le=1)
    check_value(concurrency, "--concurrency", ge=1)
    check_value(retries, "--retries", ge=0)
    check_value(request_timeout, "--request-timeout", gt=0)
    if device != "auto" and not device.startswith("cuda") and device != "cpu":
        raise EyasError(f"--device must be auto, cpu, cuda or cuda:N; got {device!r}")
    check_device(device)
    server_url = [check_url(u, option="--server-url") for u in (server_url or [])]
    summary = run(RegenConfig(
        out=out, source=source, target=target, engine=engine, max_new_tokens=max_new_tokens, max_turns=max_turns,
        max_len=max_len, temperature=temperature, top_p=top_p, seed=seed, limit=limit, hf_split=hf_split,
        batch_size=batch_size, attention=attention, device=device, dtype=dtype, continue_after_truncated=continue_after_truncated,
        overwrite=overwrite, server_urls=list(server_url or []), server_model=server_model, concurrency=concurrency,
        retries=retries, request_timeout=request_timeout,
    ))
    if summary.get("conversations") and not summary.get("written"):  # nothing usable must not look like success
        reasons = ", ".join(f"{k}: {v}" for k, v in (summary.get("skipped") or {}).items()) or "none recorded"
        raise EyasError(f"--source {source}: none of its {summary['conversations']} conversations could be regenerated "
                        f"(skipped: {reasons}); it needs user turns followed by assistant turns. {out} holds no chats")
    return summary
