"""`regenerate(config)`: source chats -> the target's own answers, turn by turn, resumable.

Order of work: validate options -> count the source (for progress/ETA; an empty source is an error
before anything is written) -> open or resume the output -> build the engine (in-process static
cache, transformers generate, or servers) -> drive it -> summary dict.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import log
from eyas.errors import EyasError

ENGINES = ("auto", "static", "generate", "server")
ATTENTIONS = ("auto", "triton", "sdpa")


@dataclass(kw_only=True)
class RegenConfig:
    """Everything `eyas regenerate` takes."""

    out: Path
    """Output directory (chats.jsonl + meta.json). An existing run with the same settings resumes."""
    source: str = "sharegpt"
    """Chats: `sharegpt` (embedded default), a .json/.jsonl file (OpenAI `messages` or ShareGPT
    `conversations`), or a dataset saved with save_to_disk."""
    target: str = "default"
    """Target model directory (Hugging Face layout); `default` = embedded SmolLM2-135M-Instruct. With
    --server-url: the model the servers serve (recorded as identity; its tokenizer is used)."""
    engine: str = "auto"
    """auto (server if --server-url, else static when the architecture is supported, else generate),
    static (static KV cache + CUDA graphs), generate (transformers generate), server."""
    max_new_tokens: int = 1024
    """Answer token limit per turn; answers that reach it are marked truncated."""
    max_turns: int | None = None
    """Keep only the first N user turns of each conversation."""
    max_length: int = 2048
    """Most tokens of prompt + answer (local engines); a prompt leaving no room is counted as context_overflow."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples from softmax(logits / T)."""
    top_p: float = 1.0
    """Nucleus sampling mass (with --temperature > 0)."""
    seed: int = 0
    """Sampling seed; each (conversation, turn) gets its own reproducible stream."""
    limit: int | None = None
    """Read at most this many source records."""
    hf_split: str | None = None
    """Split to read when --source is a saved DatasetDict."""
    batch_size: int = 0
    """Rows decoded together (local engines); 0 = auto (8 on CPU, up to 1024 on GPU as memory allows)."""
    attention: str = "auto"
    """Static engine decode attention: auto (per-row Triton kernel on CUDA when triton is installed, else
    sdpa), triton (error if unavailable), sdpa (masked, over a span covering every row)."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda or cuda:N."""
    model_dtype: str = "auto"
    """Dtype the target runs in: auto (GPU: the target's dtype, bfloat16 for an fp32 checkpoint; CPU: float32), float32, bfloat16, float16."""
    continue_after_truncated: bool = False
    """Answer later turns after an answer cut at --max-new-tokens (default: stop the conversation there)."""
    overwrite: bool = False
    """Delete an existing --out and start over."""
    server_urls: list[str] = field(default_factory=list, metadata={"flag": "--server-url"})
    """OpenAI-compatible server base URL (repeat --server-url for several), e.g. http://127.0.0.1:30000."""
    server_model: str | None = None
    """Served model name (default: the first id from GET /v1/models)."""
    concurrency: int = 64
    """Server requests in flight, over all URLs."""
    max_retries: int = 4
    """Retries per server request on connection errors, timeouts, 429 and 5xx (exponential backoff)."""
    request_timeout: float = 600.0
    """Seconds to wait for one server answer."""

    def __post_init__(self):
        from eyas.config_checks import check_device, check_number, check_url

        self.out = Path(self.out)
        check_number(self, "max_new_tokens", ge=1)
        check_number(self, "max_turns", ge=1, optional=True)
        check_number(self, "temperature", ge=0)
        check_number(self, "top_p", gt=0, le=1)
        check_number(self, "concurrency", ge=1)
        check_number(self, "max_retries", ge=0)
        check_number(self, "request_timeout", gt=0)
        if self.device == "mps":
            raise EyasError(f"--device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        check_device(self.device)
        self.server_urls = [check_url(u, option="--server-url") for u in self.server_urls]
        if self.engine not in ENGINES:
            raise EyasError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "auto":
            self.engine = "server" if self.server_urls else "auto"
        if self.server_urls and self.engine != "server":
            raise EyasError(f"--server-url was given with --engine {self.engine}; use --engine server (or auto)")
        if self.engine == "server" and not self.server_urls:
            raise EyasError("--engine server needs at least one --server-url")
        from eyas.dtypes import MODEL_DTYPES, to_dtype

        to_dtype(self.model_dtype, what="--model-dtype", allowed=MODEL_DTYPES, also=("auto",))
        if self.max_length < 2:
            raise EyasError(f"--max-length must be >= 2, got {self.max_length}")
        if self.attention not in ATTENTIONS:
            raise EyasError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.attention != "auto" and self.engine in ("generate", "server"):
            raise EyasError(
                f"--attention {self.attention} picks the static engine's decode attention; --engine "
                f"{self.engine} does not use it: drop --attention, or use --engine static"
            )
        if self.server_model is not None and not self.server_urls:
            raise EyasError(
                f"--server-model {self.server_model} names the model of the servers given with "
                "--server-url; pass --server-url too, or drop --server-model"
            )
        if self.batch_size < 0:
            raise EyasError(f"--batch-size must be >= 0 (0 = auto), got {self.batch_size}")
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"--limit must be >= 1, got {self.limit}")


def auto_batch(model, *, max_len: int, device: str, dtype) -> int:
    """8 on CPU; on GPU the largest multiple of 8 up to 1024 whose KV cache fits in half the free memory
    (more rows keep a small target's decode steps busy)."""
    import torch

    if not device.startswith("cuda"):
        return 8
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_row = 2 * cfg.num_hidden_layers * kv * head_dim * max_len * torch.empty(0, dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    rows = int(0.5 * free // per_row) // 8 * 8
    if rows < 8:
        raise EyasError(
            f"a KV cache of --max-length {max_len} needs {per_row / 2**20:.0f} MiB a row; "
            f"{free / 2**30:.1f} GiB free is too little: lower --max-length or --batch-size"
        )
    return min(1024, rows)


def _count(config: RegenConfig) -> int:
    from eyas.data.sources import iter_conversations

    return sum(1 for _ in iter_conversations(config.source, limit=config.limit, hf_split=config.hf_split))


def _build_local(config: RegenConfig, sampling):
    import torch
    from transformers import AutoConfig

    from eyas.defaults import resolve_target
    from eyas.dtypes import DTYPES, resolve_device_dtype
    from eyas.regen.local import make_local_engine
    from eyas.target import load_target, load_tokenizer

    cfg = AutoConfig.from_pretrained(resolve_target(config.target))
    own = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)  # the target's own dtype, for auto
    own = own if isinstance(own, torch.dtype) else DTYPES.get(str(own or "float32"), torch.float32)
    dev, dtype = resolve_device_dtype(config.device, config.model_dtype, auto_dtype=own, what_dtype="--model-dtype")
    if config.model_dtype == "auto" and dev.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16  # as a serving engine would run it (the converted embedded target is fp32)
    device = str(dev)
    tokenizer = load_tokenizer(config.target)
    if getattr(tokenizer, "chat_template", None) is None:
        raise EyasError(
            f"target `{config.target}`: the tokenizer has no chat template; regenerate renders prompts with it"
        )
    model = load_target(config.target, device=device, dtype=dtype)
    batch = config.batch_size or auto_batch(model, max_len=config.max_length, device=device, dtype=dtype)
    engine = make_local_engine(
        model,
        tokenizer,
        sampling=sampling,
        max_len=config.max_length,
        batch=batch,
        max_new_tokens=config.max_new_tokens,
        engine="auto" if config.engine == "auto" else config.engine,
        **({"attention": config.attention} if config.attention != "auto" else {}),
    )
    return engine, {"device": device, "dtype": str(dtype).removeprefix("torch.")}


@contextlib.contextmanager
def _sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def regen_settings(config: RegenConfig) -> dict[str, Any]:
    """The settings an output records and a resume must match: target identity (config, weights and
    tokenizer hashes), sampling, limits and source. Reads files only; no model is loaded."""
    from eyas.regen.sampling import Sampling
    from eyas.target import load_tokenizer, model_identity, tokenizer_hash

    try:
        sampling = Sampling(temperature=config.temperature, top_p=config.top_p, seed=config.seed)
    except ValueError as exc:
        raise EyasError(str(exc)) from None
    identity = model_identity(config.target)
    identity["tokenizer_sha256"] = tokenizer_hash(load_tokenizer(config.target))
    return {
        "target": identity,
        "sampling": sampling.as_dict(),
        "max_new_tokens": config.max_new_tokens,
        "max_turns": config.max_turns,
        "max_len": config.max_length if config.engine != "server" else None,  # key kept: older runs resume
        "continue_after_truncated": config.continue_after_truncated,
        "source": {"spec": str(config.source), "hf_split": config.hf_split},
    }


def regenerate(config: RegenConfig) -> dict[str, Any]:
    from eyas.data.sources import iter_conversations
    from eyas.regen.driver import Regenerator, RegenOptions
    from eyas.regen.output import ChatsWriter, check_out_before_load
    from eyas.regen.sampling import Sampling

    try:
        sampling = Sampling(temperature=config.temperature, top_p=config.top_p, seed=config.seed)
        options = RegenOptions(
            max_new_tokens=config.max_new_tokens,
            max_turns=config.max_turns,
            continue_after_truncated=config.continue_after_truncated,
        )
    except ValueError as exc:
        raise EyasError(str(exc)) from None

    total = _count(config)
    if total == 0:
        raise EyasError(f"--source {config.source}: no records (empty dataset); nothing to regenerate")
    settings = regen_settings(config)
    # what would be refused after the engine is built is refused now, before any model loads
    check_out_before_load(config.out, settings, overwrite=config.overwrite)
    if config.attention == "triton":  # RegenConfig refused it with the server engine
        from eyas.dtypes import resolve_device
        from eyas.regen.attention import triton_unavailable

        why = triton_unavailable(resolve_device(config.device))
        if why is not None:
            raise EyasError(f"--attention triton: {why}; use --attention sdpa or auto")

    if config.engine == "server":
        from eyas.regen.server import ServerEngine, ServerOptions

        try:
            sopt = ServerOptions(
                urls=list(config.server_urls),
                model=config.server_model,
                concurrency=config.concurrency,
                retries=config.max_retries,
                timeout_s=config.request_timeout,
            )
        except ValueError as exc:
            raise EyasError(str(exc)) from None
        engine, placement = ServerEngine(sopt, sampling=sampling), {}
        options.max_in_flight = max(options.max_in_flight, 4 * config.concurrency)
    else:
        try:
            engine, placement = _build_local(config, sampling)
        except ValueError as exc:
            if isinstance(exc, EyasError):
                raise
            raise EyasError(str(exc)) from None
        options.max_in_flight = max(options.max_in_flight, 4 * getattr(engine, "batch", 1))

    info_out: list = []
    writer = ChatsWriter(
        config.out,
        settings=settings,
        overwrite=config.overwrite,
        extra_meta={
            "engine": {**engine.describe(), **placement},
            "source_info": {"spec": str(config.source), "limit": config.limit, "records": total},
        },
    )
    if writer.resumed:
        log(f"regen: resuming {config.out}: {len(writer.done):,} of {total:,} conversations already decided")
    items = enumerate(
        iter_conversations(config.source, limit=config.limit, hf_split=config.hf_split, info_out=info_out)
    )
    driver = Regenerator(items, writer, sampling=sampling, options=options, total=total)
    t0 = time.perf_counter()
    with _sigterm_as_interrupt():  # a preempted job commits what it finished before exiting
        driver.run(engine)
    elapsed = time.perf_counter() - t0
    if info_out:
        writer.extra_meta["source_info"].update(
            path=info_out[0].path, format=info_out[0].format, truncated=info_out[0].truncated, notes=info_out[0].notes
        )
        driver.commit(complete=True)
    counts = writer.counts()
    return {
        "out": str(config.out),
        "resumed": writer.resumed,
        "engine": engine.describe().get("engine"),
        **counts,
        "tokens_this_run": driver.tokens,
        "tokens_per_s": round(driver.tokens / elapsed, 1) if elapsed > 0 else None,
        "elapsed_s": round(elapsed, 2),
        # occupancy, attention efficiency and the prefill/decode/host split (StaticEngine.stats)
        "engine_stats": engine.stats() if hasattr(engine, "stats") else None,
        "config": {k: v for k, v in asdict(config).items() if k not in ("out",)},
    }
