"""A stand-in for an SGLang server with the eyas plugin: what CI runs instead of real SGLang.

No machine of ours can run SGLang (CI has no GPU; the GPU image's Python/torch do not match the
wheels), so the client and `eyas verify-server` are tested against this local HTTP server. It
implements the parts of SGLang's contract the client relies on:

- `POST /generate` with `input_ids` (or `text`, tokenized with the target's tokenizer), `rid`,
  `sampling_params.max_new_tokens` / `temperature` (greedy only) / `stop_token_ids` / `ignore_eos`,
  `cache_salt`, `return_logprob` + `logprob_start_len` (the answer then carries SGLang's per-token logprob lists,
  with stand-in values); the answer's `output_ids` are the real model's
  greedy continuation (the first token from the scheduled prefill, the rest decoded per request; the
  EOS or stop token that ended it is kept) and its `meta_info` has `prompt_tokens`, `cached_tokens`,
  `completion_tokens`, `finish_reason`, and with `draft_accept_length` set, `spec_verify_ct`;
- `GET /server_info` (or only the older `/get_server_info`, `legacy_info_path=True`) with
  `disable_radix_cache`, `chunked_prefill_size`, `version`, ... and `internal_states[0]` carrying
  the plugin's `eyas_capture` status (absent with `plugin=False`); with `draft_accept_length` set it
  pretends a draft model runs (`speculative_algorithm` EAGLE3, `speculative_num_steps`, ...,
  and a cumulative `avg_spec_accept_length` in `internal_states[0]`), for `eyas bench-serve`;
- a scheduler thread that batches requests into EXTEND forwards under a token budget, splits long
  prompts into chunks (chunked prefill) interleaved with other requests, pads the packed rows to a
  bucket (as CUDA graphs do), and optionally keeps a radix cache: a new prompt's longest common
  prefix with earlier prompts (same cache_salt, capped by SGLang's Req._compute_max_prefix_len rule:
  L-1, and logprob_start_len when return_logprob is set, then by the plugin's AFTER hook on it) is
  "cached" and never computed, exactly the case the plugin must reject.

Hidden states are real: each piece's rows come from `eyas.target.forward_capture` on the target
(recomputing the prefix instead of keeping a KV cache; same numbers), at the layers the plugin
turned on. The plugin is driven through its real entry points, one state per simulated TP rank:
each rank is set up by `plugin.enable` (what its init_attention_backends hook calls) on a model
wrapper with SGLang's `set_eagle3_layers_to_capture`, and every forward runs the functions
`plugin.register_hooks` registers, called as SGLang's HookRegistry calls them, with `plugin._STATE`
pointing at that rank's state: BEFORE ModelRunner.forward(runner, live batch), then BEFORE
LogitsProcessor.forward(processor, input_ids, hidden, lm_head, logits batch, aux_hidden_states=aux);
server info goes through the AFTER get_internal_state hook. With `prefill_cuda_graph=True` (the
default, as on a CUDA SGLang server) the logits step gets the batch rebuilt for graph replay the way
SGLang's PrefillCudaGraphRunner.load_batch builds it: padded input_ids/positions slots, the length
lists copied, and NO `rids`. A plugin that reads request ids only from the batch it is handed, or
whose hook functions do nothing, writes nothing here, and CI fails.

Run by hand: `python -m eyas.sglang.standin --target DIR --port 30000 [--chunk 64] [--radix]`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import inspect
import json
import math
import queue
import threading
import time
import types
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from eyas.sglang import plugin as eyas_plugin
from eyas.sglang.core import DEFAULT_DUMP_DIR

STANDIN_VERSION = "0.5.23"


@dataclass(kw_only=True)
class StandinConfig:
    target: str | Path
    """Hugging Face model directory to serve (a tiny random model in tests)."""
    layer_ids: list[int] | None = None
    """Aux layers the 'plugin' captures (eyas convention); None = 2, N//2, N-3."""
    dump_dir: str | Path = DEFAULT_DUMP_DIR
    """Where the plugin write path puts dumps."""
    chunked_prefill_size: int = -1
    """Tokens per prefill chunk (-1 = off), as SGLang's --chunked-prefill-size."""
    max_forward_tokens: int = 512
    """Token budget of one EXTEND forward (several requests share it)."""
    disable_radix_cache: bool = True
    """False: keep a radix cache of earlier prompts and serve matching prefixes from it."""
    plugin: bool = True
    """False: behave like a server without the eyas plugin (no dumps, no status)."""
    version: str = STANDIN_VERSION
    """The `version` reported in server info."""
    pad_rows_to: int = 8
    """Pad each forward's packed rows to a multiple of this (CUDA-graph bucket padding)."""
    tp_size: int = 1
    """Simulated TP ranks: every rank's core sees the forward; only rank 0 may write."""
    fail_first: int = 0
    """Answer HTTP 503 to the first N /generate calls (to exercise retries)."""
    legacy_info_path: bool = False
    """Serve only the older /get_server_info (404 on /server_info)."""
    speculative_algorithm: str | None = None
    """Reported in server info only (a capture server must have none): the plugin, which would refuse to
    start, is not shown it, so the client's own refusal can be tested (a server with an older plugin)."""
    batch_wait_s: float = 0.01
    """How long the scheduler waits to gather requests into one forward."""
    prefill_cuda_graph: bool = True
    """True: the logits step gets a graph-replay batch without rids (SGLang's CUDA default)."""
    enable_dp_attention: bool = False
    """Reported in server info only (the client refuses DP attention; the plugin is not shown it)."""
    enable_two_batch_overlap: bool = False
    """Reported in server info only (the client refuses two-batch overlap; the plugin is not shown it)."""
    context_length: int | None = None
    """--context-length; None: the model's max_position_embeddings, reported as None in server info (as SGLang
    reports a flag that was not given). Longer prompts are answered HTTP 400 with SGLang's message."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """More ServerArgs fields the plugin's start-up check sees (it refuses some: then the stand-in does
    not start, as a real server would not)."""
    draft_accept_length: float | None = None
    """Pretend a draft model runs with this accept length: each answer reports spec_verify_ct =
    ceil(completion_tokens / this), and server info the speculative settings (the plugin is not shown them)."""
    tokenizer: str | Path | None = None
    """Tokenizer of `text` prompts; None = the target's (another one plays a server serving another model)."""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # a client with many requests in flight connects in bursts: the default backlog of 5 drops
    # connections a real server (uvicorn: 2048) accepts, and the client sees timeouts or resets
    request_queue_size = 1024


class ForwardMode(enum.IntEnum):
    """The ForwardMode members and predicates the plugin reads (SGLang's values)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY


@dataclass(kw_only=True)
class ForwardBatch:
    """The ForwardBatch fields the plugin reads, under SGLang's names."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    rids: list[str] | None = None


def replay_batch(live: ForwardBatch, *, bucket: int) -> ForwardBatch:
    """The batch SGLang's prefill CUDA-graph runner hands the model (PrefillCudaGraphRunner.load_batch):
    input_ids and positions live in static slots padded to the graph bucket, MIXED replays as
    EXTEND, the CPU length lists are the live batch's own objects, and `rids` is not copied."""
    T = int(live.input_ids.shape[0])
    padded = -(-T // bucket) * bucket
    ids, pos = torch.zeros(padded, dtype=torch.long), torch.zeros(padded, dtype=torch.long)
    ids[:T], pos[:T] = live.input_ids, live.positions
    mode = ForwardMode.EXTEND if live.forward_mode == ForwardMode.MIXED else live.forward_mode
    return ForwardBatch(
        forward_mode=mode,
        batch_size=live.batch_size,
        input_ids=ids,
        positions=pos,
        extend_prefix_lens_cpu=live.extend_prefix_lens_cpu,
        extend_seq_lens_cpu=live.extend_seq_lens_cpu,
    )


class HookType(enum.Enum):
    """SGLang's HookType members the plugin registers with."""

    BEFORE = "before"
    AFTER = "after"


LIVE_BATCH_TARGET, LOGITS_TARGET = eyas_plugin.hook_target("live_batch"), eyas_plugin.hook_target("logits")
PREFIX_CAP_TARGET = eyas_plugin.hook_target("prefix_cap")
RELEASE_TARGET = eyas_plugin.hook_target("release")
STATUS_TARGET = eyas_plugin.CONTRACT["status_hooks"][0][:2]  # SGLang 0.5.22+ (STANDIN_VERSION)
STATUS_HOOK = ".".join(STATUS_TARGET)

_PLUGIN_STATE_LOCK = threading.Lock()


@contextlib.contextmanager
def plugin_state(st):
    """Point `plugin._STATE` (one per server process, i.e. per GPU rank) at one simulated rank's state
    while its hook runs; the lock keeps ranks and stand-in servers in one process from mixing."""
    with _PLUGIN_STATE_LOCK:
        saved, eyas_plugin._STATE = eyas_plugin._STATE, st
        try:
            yield
        finally:
            eyas_plugin._STATE = saved


class HookTable:
    """What `plugin.register_hooks` registers, by target, and the calls SGLang's HookRegistry makes:
    a BEFORE hook gets the method's arguments (self first; a non-None result replaces them), an
    AFTER hook the result, then the arguments."""

    def __init__(self):
        self.hooks: dict[str, list[tuple[HookType, Any]]] = {}

    def register(self, target: str, fn, hook_type: HookType = HookType.AFTER) -> None:
        self.hooks.setdefault(target, []).append((hook_type, fn))

    def before(self, target: str, st, *args, **kwargs) -> tuple[tuple, dict]:
        for kind, fn in self.hooks.get(target, []):
            if kind is HookType.BEFORE:
                with plugin_state(st):
                    got = fn(*args, **kwargs)
                if got is not None:
                    args, kwargs = got
        return args, kwargs

    def after(self, target: str, st, result, *args, **kwargs):
        for kind, fn in self.hooks.get(target, []):
            if kind is HookType.AFTER:
                with plugin_state(st):
                    got = fn(result, *args, **kwargs)
                result = result if got is None else got
        return result


class CaptureModel:
    """The SGLang model as `plugin.enable` sees it: `config`, `.model.layers_to_capture` and
    `set_eagle3_layers_to_capture` with LlamaForCausalLM's rule (SGLang id k: capture the input of
    decoder layer k + 1; None: 2, N//2, N-3). The stand-in captures the layers this ends up with."""

    def __init__(self, config):
        self.config = config
        self.model = types.SimpleNamespace(layers_to_capture=[])

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        if layer_ids is None:
            n = int(self.config.num_hidden_layers)
            self.model.layers_to_capture = [2, n // 2, n - 3]
        else:
            self.model.layers_to_capture = [v + 1 for v in layer_ids]


@dataclass
class ModelRunner:
    """One simulated rank's ModelRunner: what the plugin's ModelRunner hooks are handed."""

    model: CaptureModel
    server_args: Any
    state: Any
    is_draft_worker: bool = False


class LogitsProcessor:
    """SGLang's LogitsProcessor.forward signature; the plugin's BEFORE hook runs ahead of it."""

    def __init__(self, states: list, hooks: HookTable):
        self.states, self.hooks = states, hooks

    def forward(
        self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, hidden_states_before_norm=None
    ):
        for st in self.states:  # every TP rank runs the same tail on the same (replicated) rows
            self.hooks.before(
                LOGITS_TARGET,
                st,
                self,
                input_ids,
                hidden_states,
                lm_head,
                logits_metadata,
                aux_hidden_states=aux_hidden_states,
            )
        return None


def _standin_logprob(token: int) -> float:
    """A logprob-shaped number for a token (not the model's: the stand-in returns SGLang's lists for their size)."""
    return -math.log1p(token % 1000 + 0.5)


@dataclass
class _Req:
    rid: str
    ids: list[int]
    salt: str | None
    logprob_start: int | None
    done: threading.Event = field(default_factory=threading.Event)
    prefix: int = 0  # tokens matched in the radix cache
    computed: int = 0  # positions computed so far (absolute)
    result: dict[str, Any] | None = None
    skip_radix_cache_insert: bool = False  # SGLang's flag: released without a radix-cache insert

    def _compute_max_prefix_len(self, input_len: int) -> int:
        """SGLang's Req._compute_max_prefix_len: at most L-1, at most logprob_start_len when logprobs are asked for."""
        cap = input_len - 1
        if self.logprob_start is not None:
            cap = min(cap, self.logprob_start)
        return max(cap, 0)


class StandinServer:
    """The server: `start()`, `.url`, `close()` (or use as a context manager)."""

    def __init__(self, cfg: StandinConfig, *, host: str = "127.0.0.1", port: int = 0):
        from eyas.drafter.layouts import default_aux_layer_ids
        from eyas.target import load_target, num_layers_of

        self.cfg = cfg
        self.model = load_target(cfg.target)
        n = num_layers_of(self.model.config)
        self.num_layers = n
        self.dump_dir = Path(cfg.dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.hooks = HookTable()
        self.runners = [self._enable_rank(rank) for rank in range(cfg.tp_size)] if cfg.plugin else []
        self.states = [r.state for r in self.runners]
        if self.runners:  # the layers the plugin turned on in the model (every rank the same)
            captured = {tuple(r.model.model.layers_to_capture) for r in self.runners}
            assert len(captured) == 1, f"ranks capture different layers: {captured}"
            self.layer_ids = list(captured.pop())
        else:
            self.layer_ids = list(cfg.layer_ids) if cfg.layer_ids is not None else default_aux_layer_ids(n)
        self.logits = LogitsProcessor(self.states, self.hooks)
        self.radix: list[tuple[str | None, list[int]]] = []
        self.queue: queue.Queue[_Req] = queue.Queue()
        self.forwards: list[dict[str, Any]] = []  # (rids, prefix, lens) of each forward, for tests
        self.generate_calls = 0
        self.spec_totals = [0, 0]  # completion tokens and verify rounds of every answer (draft_accept_length)
        self._tokenizer = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.httpd = _HTTPServer((host, port), self._handler())
        self.url = f"http://{host}:{self.httpd.server_address[1]}"

    def server_args(self) -> types.SimpleNamespace:
        """The ServerArgs the plugin's start-up check reads: the stand-in's settings and cfg.server_args
        (not the flags it only reports: see StandinConfig)."""
        cfg = self.cfg
        return types.SimpleNamespace(
            **{
                "tp_size": cfg.tp_size,
                "pp_size": 1,
                "dp_size": 1,
                "disable_radix_cache": cfg.disable_radix_cache,
                "chunked_prefill_size": cfg.chunked_prefill_size,
                "disable_prefill_cuda_graph": not cfg.prefill_cuda_graph,
                "speculative_algorithm": None,
                "enable_dp_attention": False,
                "enable_two_batch_overlap": False,
                **cfg.server_args,
            }
        )

    def _enable_rank(self, rank: int) -> ModelRunner:
        """One TP rank, set up as in a server process: register() builds the state from the environment
        and registers the hooks; the init_attention_backends hook calls plugin.enable on the rank's model
        (here directly: the hook reads the ranks from SGLang's runtime context, which needs SGLang)."""
        env = {"EYAS_CAPTURE": "1", "EYAS_DUMP_DIR": str(self.dump_dir)}
        if self.cfg.layer_ids is not None:
            env["EYAS_CAPTURE_LAYERS"] = ",".join(str(i) for i in self.cfg.layer_ids)
        st = eyas_plugin._State(eyas_plugin.PluginConfig.from_env(env))
        st.logits_sig = inspect.signature(LogitsProcessor.forward)  # register() reads SGLang's
        if rank == 0:
            eyas_plugin.register_hooks(self.hooks, HookType, status_target=STATUS_TARGET)
        runner = ModelRunner(model=CaptureModel(self.model.config), server_args=self.server_args(), state=st)
        eyas_plugin.enable(
            st, runner.model, server_args=runner.server_args, ranks={"attn_tp_rank": rank, "pp_rank": 0, "pp_size": 1}
        )
        if st.writer is not None:
            st.writer.writer["standin"] = True
        return runner

    # -- lifecycle

    def start(self) -> StandinServer:
        threading.Thread(target=self.httpd.serve_forever, name="standin-http", daemon=True).start()
        threading.Thread(target=self._schedule_loop, name="standin-scheduler", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.flush()

    def flush(self) -> None:
        for st in self.states:
            if st.writer is not None:
                st.writer.flush()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- server info

    def server_info(self) -> dict[str, Any]:
        cfg = self.cfg
        state: dict[str, Any] = {"effective_max_running_requests_per_dp": 64}
        if cfg.plugin:  # SchedulerInternalStateController.get_internal_state(recv_req), then its AFTER hook
            result = types.SimpleNamespace(internal_state=state)
            state = self.hooks.after(STATUS_HOOK, self.states[0], result, None, None).internal_state
            if isinstance(state.get("eyas_capture"), dict):
                state["eyas_capture"].update(sglang_version=cfg.version, standin=True)
        return {
            "model_path": str(cfg.target),
            "version": cfg.version,
            "disable_radix_cache": cfg.disable_radix_cache,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "context_length": cfg.context_length,
            "enable_mixed_chunk": False,
            "tp_size": cfg.tp_size,
            "dp_size": 1,
            "pp_size": 1,
            "enable_dp_attention": cfg.enable_dp_attention,
            "enable_two_batch_overlap": cfg.enable_two_batch_overlap,
            "page_size": 1,
            "disable_prefill_cuda_graph": not cfg.prefill_cuda_graph,
            "speculative_algorithm": cfg.speculative_algorithm,
            "internal_states": [state],
        } | self._speculative_info(state)

    def _speculative_info(self, state: dict[str, Any]) -> dict[str, Any]:
        """SGLang's speculative ServerArgs and the cumulative accept length, when a draft is pretended."""
        if self.cfg.draft_accept_length is None:
            return {}
        with self._lock:
            tokens, rounds = self.spec_totals
        state["avg_spec_accept_length"] = tokens / rounds if rounds else 0.0
        return {
            "speculative_algorithm": self.cfg.speculative_algorithm or "EAGLE3",
            "speculative_draft_model_path": "standin-draft",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
        }

    # -- HTTP

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                legacy = server.cfg.legacy_info_path
                if self.path == "/get_server_info" or (self.path == "/server_info" and not legacy):
                    self._send(200, server.server_info())
                elif self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                if self.path != "/generate":
                    return self._send(404, {"detail": "Not Found"})
                n = int(self.headers.get("Content-Length", 0))
                try:
                    body = json.loads(self.rfile.read(n))
                except json.JSONDecodeError as exc:
                    return self._send(400, {"error": f"bad JSON: {exc}"})
                with server._lock:
                    server.generate_calls += 1
                    fail = server.generate_calls <= server.cfg.fail_first
                if fail:
                    return self._send(503, {"error": "simulated overload"})
                code, obj = server.generate(body)
                self._send(code, obj)

        return Handler

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.tokenizer or self.cfg.target)
        return self._tokenizer

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):  # SGLang tokenizes with add_special_tokens
            ids = self.tokenizer().encode(body["text"])
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": "input_ids: expected a non-empty list of ints (text prompts are not supported here)"}
        vocab = int(self.model.config.vocab_size)
        if max(ids) >= vocab or min(ids) < 0:
            return 400, {"error": f"input_ids out of range for vocab {vocab}"}
        limit = self.cfg.context_length or int(self.model.config.max_position_embeddings)
        if len(ids) > limit:
            return 400, {
                "error": {
                    "message": f"The input ({len(ids)} tokens) is longer than the model's context "
                    f"length ({limit} tokens)."
                }
            }
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 1))
        if max_new < 1 or float(sp.get("temperature", 0.0)) != 0.0:
            return 400, {"error": "the stand-in serves greedy answers (temperature 0) of max_new_tokens >= 1 only"}
        logprob_start = int(body.get("logprob_start_len", -1)) if body.get("return_logprob") else None
        req = _Req(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            ids=ids,
            salt=body.get("cache_salt"),
            logprob_start=logprob_start if logprob_start is not None and logprob_start >= 0 else None,
        )
        self.queue.put(req)
        req.done.wait()
        result = req.result
        if "output_ids" in (result or {}):
            stop = set() if sp.get("ignore_eos") else self._eos_ids()
            stop |= {int(t) for t in sp.get("stop_token_ids") or []}
            out = self._decode(ids, result["output_ids"][0], max_new, stop)
            meta = result["meta_info"]
            meta["completion_tokens"] = len(out)
            meta["finish_reason"] = (
                {"type": "stop", "matched": out[-1]} if out[-1] in stop else {"type": "length", "length": len(out)}
            )
            if self.cfg.draft_accept_length is not None:
                meta["spec_verify_ct"] = math.ceil(len(out) / self.cfg.draft_accept_length)
                with self._lock:
                    self.spec_totals[0] += len(out)
                    self.spec_totals[1] += meta["spec_verify_ct"]
            result["output_ids"] = out
            if body.get("text") is not None:
                result["text"] = self.tokenizer().decode(out, skip_special_tokens=True)
        return 200, result

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.model.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None)
            ids |= set() if e is None else {int(e)} if isinstance(e, int) else {int(x) for x in e}
        return ids

    @torch.no_grad()
    def _decode(self, ids: list[int], first: int, max_new: int, stop: set[int]) -> list[int]:
        """The greedy continuation after the prefill's token `first` (Hugging Face generate, batch 1: the same ids
        whatever else is in flight), ending after a stop token (kept) or at max_new tokens."""
        from transformers import GenerationConfig

        if max_new == 1 or first in stop:
            return [first]
        config = GenerationConfig(
            max_new_tokens=max_new - 1,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            eos_token_id=sorted(stop) or None,
            pad_token_id=min(stop) if stop else 0,
        )
        seq = torch.tensor([ids + [first]])
        more = self.model.generate(input_ids=seq, attention_mask=torch.ones_like(seq), generation_config=config)[
            0, seq.shape[1] :
        ].tolist()
        cut = next((j + 1 for j, t in enumerate(more) if t in stop), len(more))
        return [first] + more[:cut]

    # -- scheduler

    def _match_prefix(self, req: _Req) -> int:
        """SGLang's rule: the longest cached prefix (same salt), at most Req._compute_max_prefix_len, which the
        plugin's AFTER hook on it may lower (every rank's scheduler runs it: the first rank's state stands in). SGLang
        computes the cap also with the radix cache off."""
        L = len(req.ids)
        cap = req._compute_max_prefix_len(L)
        if self.cfg.plugin:
            cap = self.hooks.after(PREFIX_CAP_TARGET, self.states[0], cap, req, L)
        if self.cfg.disable_radix_cache:
            return 0
        best = 0
        for salt, seq in self.radix:
            if salt != req.salt:
                continue
            k = 0
            for a, b in zip(seq, req.ids):
                if a != b:
                    break
                k += 1
            best = max(best, k)
        return max(0, min(best, cap))

    def _schedule_loop(self) -> None:
        running: list[_Req] = []
        while not self._stop.is_set():
            try:
                timeout = 0.0 if running else 0.05
                first = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
                time.sleep(self.cfg.batch_wait_s)
                new = [first]
                while True:
                    try:
                        new.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                for r in new:
                    r.prefix = r.computed = self._match_prefix(r)
                running += new
            except queue.Empty:
                pass
            if running:
                try:
                    running = self._forward(running)
                except Exception as exc:  # answer every request rather than hang the clients
                    for r in running:
                        r.result = {"error": f"{type(exc).__name__}: {exc}"}
                        r.done.set()
                    running = []

    def _forward(self, running: list[_Req]) -> list[_Req]:
        """One EXTEND forward over as many pieces as the token budget allows."""
        from eyas.target import forward_capture

        budget, chunk = self.cfg.max_forward_tokens, self.cfg.chunked_prefill_size
        pieces: list[tuple[_Req, int, int]] = []  # (req, start, length)
        for r in running:
            if budget <= 0:
                break
            n = len(r.ids) - r.computed
            if chunk > 0:
                n = min(n, chunk)
            n = min(n, budget)
            pieces.append((r, r.computed, n))
            budget -= n
        aux, final, pos, toks = [], [], [], []
        for r, start, n in pieces:
            ids = torch.tensor(r.ids[: start + n], dtype=torch.long)[None]
            a_BTAD, f_BTD = forward_capture(self.model, ids, layer_ids=self.layer_ids)
            aux.append(a_BTAD[0, start:]), final.append(f_BTD[0, start:])
            pos.append(torch.arange(start, start + n)), toks.append(ids[0, start:])
            r.computed += n
        T = sum(n for _, _, n in pieces)
        pad = (-T) % max(1, self.cfg.pad_rows_to)
        # the scheduler's batch: real rows only, with the request ids
        live = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(pieces),
            input_ids=torch.cat(toks),
            positions=torch.cat(pos),
            rids=[r.rid for r, _, _ in pieces],
            extend_prefix_lens_cpu=[s for _, s, _ in pieces],
            extend_seq_lens_cpu=[n for _, _, n in pieces],
        )
        self.forwards.append(
            {
                "rids": live.rids,
                "extend_prefix_lens": live.extend_prefix_lens_cpu,
                "extend_seq_lens": live.extend_seq_lens_cpu,
            }
        )
        if self.cfg.plugin:
            for runner in self.runners:  # ModelRunner.forward(live batch) on every rank
                self.hooks.before(LIVE_BATCH_TARGET, runner.state, runner, live)
            fb = replay_batch(live, bucket=max(1, self.cfg.pad_rows_to)) if self.cfg.prefill_cuda_graph else live
            if pad:  # rows past the real ones hold garbage, as a replayed CUDA graph's do
                aux.append(torch.full((pad,) + aux[0].shape[1:], 1e4))
                final.append(torch.full((pad, final[0].shape[1]), 1e4))
            hidden_TD, aux_TAD = torch.cat(final), torch.cat(aux)
            # the model's tail: logits_processor(input_ids, hidden, lm_head, batch, aux) with packed aux [T, A*H]
            self.logits.forward(
                fb.input_ids, hidden_TD, self.model.lm_head, fb, aux_hidden_states=aux_TAD.reshape(aux_TAD.shape[0], -1)
            )
            self.flush()  # as in SGLang, the dump may lag the forward; flushing keeps tests simple
        still = []
        for r in running:
            if r.computed < len(r.ids):
                still.append(r)
                continue
            final_last = final[[p[0] for p in pieces].index(r)][-1]
            next_id = int(torch.argmax(self.model.lm_head(final_last)))
            if self.cfg.plugin:  # SGLang's release_kv_cache, which the plugin's BEFORE hook may flag
                self.hooks.before(RELEASE_TARGET, self.states[0], r, None)
            if not self.cfg.disable_radix_cache and not r.skip_radix_cache_insert:
                self.radix.append((r.salt, list(r.ids)))
            r.result = {
                "text": "",
                "output_ids": [next_id],
                "meta_info": {
                    "id": r.rid,
                    "prompt_tokens": len(r.ids),
                    "cached_tokens": r.prefix,
                    "completion_tokens": 1,
                    "finish_reason": {"type": "length", "length": 1},
                },
            }
            if r.logprob_start is not None:  # SGLang's lists, as long as its; the values are stand-ins
                r.result["meta_info"]["input_token_logprobs"] = [
                    [None if i == 0 else _standin_logprob(t), t, None]
                    for i, t in enumerate(r.ids[r.logprob_start :], start=r.logprob_start)
                ]
                r.result["meta_info"]["output_token_logprobs"] = [[_standin_logprob(next_id), next_id, None]]
            r.done.set()
        return still


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dump-dir", default=DEFAULT_DUMP_DIR)
    ap.add_argument("--layers", default=None, help="comma-separated eyas layer ids")
    ap.add_argument("--chunk", type=int, default=-1)
    ap.add_argument("--radix", action="store_true", help="keep a radix cache (disable_radix_cache = false)")
    ap.add_argument("--no-prefill-graph", action="store_true", help="hand the logits step the live batch (with rids)")
    a = ap.parse_args()
    cfg = StandinConfig(
        target=a.target,
        dump_dir=a.dump_dir,
        chunked_prefill_size=a.chunk,
        disable_radix_cache=not a.radix,
        prefill_cuda_graph=not a.no_prefill_graph,
        layer_ids=[int(x) for x in a.layers.split(",")] if a.layers else None,
    )
    srv = StandinServer(cfg, port=a.port).start()
    print(f"stand-in SGLang server at {srv.url} (dumps in {srv.dump_dir})", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.close()


if __name__ == "__main__":
    main()
