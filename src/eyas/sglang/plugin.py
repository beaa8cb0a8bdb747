"""The SGLang server plugin: the ONLY module of eyas that knows SGLang's internals.

Pinned to SGLang 0.5.23 (the newest 0.5.x release; its PyPI wheel was read for every hook below).
Supported: every release in SUPPORTED_VERSIONS (0.5.15 to 0.5.23; each wheel was read and passes the
same contract check in tests/test_sglang_contract.py). On start-up the plugin checks that every
hook point and ForwardBatch field it uses exists and refuses to start the server otherwise, naming
the version. `CONTRACT` lists them.

Install eyas into the server's Python environment; the entry point in eyas's pyproject

    [project.entry-points."sglang.srt.plugins"]
    eyas_capture = "eyas.sglang.plugin:register"

is loaded by SGLang in every server process (`sglang.srt.plugins.load_plugins`). The plugin is
inactive unless EYAS_CAPTURE=1, so installing eyas next to a serving deployment changes nothing.

Environment (read by every server process):
    EYAS_CAPTURE=1                  turn capture on
    EYAS_CAPTURE_LAYERS=2,15,27     aux layer ids in eyas's convention (hf-input: id i = INPUT to
                                    decoder layer i); default = 2, N//2, N-3. The plugin passes the
                                    ids each model's own rule needs (Llama: SGLang id + 1; DeepSeek-V2/V3
                                    and Kimi-K2.5: + 1 only when the first id is 1) and reads the
                                    model's `layers_to_capture` back; ids it cannot express are refused.
    EYAS_DUMP_DIR=/dev/shm/eyas-dumps

Hooks (sglang.srt.plugins.hook_registry.HookRegistry):
    BEFORE ModelRunner.init_attention_backends   runs after the weights are loaded and before CUDA
        graphs are captured: refuses server settings that scatter or skip rows, turns on EAGLE-3 aux
        capture (model.set_eagle3_layers_to_capture) so the graphs include it, reads the layer ids
        back (through multimodal wrappers such as Kimi-K2.5's) and records this rank.
    BEFORE ModelRunner.forward   remembers the scheduler's live ForwardBatch, which carries `rids`.
        SGLang's default prefill CUDA graph on CUDA ("breakable") hands the model, and so the logits
        processor, a ForwardBatch rebuilt for graph replay (PrefillCudaGraphRunner.load_batch) that
        does NOT copy `rids`; it does copy `extend_seq_lens_cpu` / `extend_prefix_lens_cpu`, so the
        logits hook takes the request ids of the live batch whose lengths match. A forward it cannot
        match rejects its eyas requests with a reason naming --disable-prefill-cuda-graph; one with no
        live batch on its thread has no requests to reject and is counted (`rid_less_forwards`).
    BEFORE LogitsProcessor.forward   every model hands the logits processor the final POST-NORM
        hidden states of all rows and the aux states, with the batch. The graph runners replay the
        transformer body only; this tail runs eagerly, so the hook sees every EXTEND forward. Only
        the writing rank (attention-TP rank 0 on the last pipeline rank) reads or submits anything;
        rows of eyas requests go to CaptureCore (core.py), which stitches and writes dumps.
    AFTER Req._compute_max_prefix_len   caps the radix-cache match of an eyas request at 0 tokens: the prefill
        computes the whole prompt, so the forward holds every row (the cap SGLang itself applies to a request
        asking for every prompt token's logprob, without computing and sending those logprobs). The
        client's `--sglang-cache-bypass plugin` (its choice when the status says `prefix_cap`).
    BEFORE release_kv_cache (sglang.srt.mem_cache.common)   marks a finished eyas request
        `skip_radix_cache_insert` (SGLang's own flag, honoured there by every supported release): its KV is freed,
        not inserted into the radix cache. The prompt is never matched (the cap above), so inserting it would only
        cost the scheduler the insertion and, once the cache is full, an eviction for every later request, and it
        would push other requests' cached prefixes out. Only the release is marked: chunked prefill, which caches
        a request's earlier chunks on the way, is left as it is.
    AFTER get_internal_state (SchedulerInternalStateController from 0.5.22, Scheduler before)   adds
        "eyas_capture" (layer ids, dump dir, model, counters) to /server_info, which the client checks.

Refused at start-up (PluginConfigError, the server does not start): speculative decoding,
--enable-return-aux-hidden-states, --pp-size > 1, prefill context parallelism (--enable-prefill-cp:
a prefill's tokens split over ranks), --attn-cp-size > 1, DP attention (--enable-dp-attention /
--attn-dp-size > 1: rows of one batch spread over ranks), two-batch and single-batch overlap
(DeepSeek skips aux capture for the overlapped stages), and the torch.compile prefill graph backend
(tc_piecewise, 0.5.15-0.5.21: the tail would be compiled), whether set by a flag or chosen by SGLang
(its default off CUDA up to 0.5.21). Every setting is read as SGLang resolved it (`server_arg`:
from 0.5.19 the ServerArgs fields keep the raw input and SGLang's decisions are declarations).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
from typing import Any

from eyas.drafter.layouts import check_layer_ids, default_aux_layer_ids
from eyas.errors import EyasError
from eyas.sglang.core import (
    DEFAULT_DUMP_DIR,
    REPLAY_FLAG,
    CaptureCore,
    CompletedSample,
    DumpWriter,
    ForwardInfo,
    parse_rid,
    plugin_status,
    sglang_layer_ids,
)

logger = logging.getLogger("eyas.sglang")

PINNED_SGLANG = "0.5.23"
# Every release whose wheel was read and passes the contract check (tests/test_sglang_contract.py
# checks each one). 0.5.15-0.5.17 pin torch 2.11; 0.5.18-0.5.21 torch 2.13; 0.5.22+ torch 2.14.
SUPPORTED_VERSIONS = (
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)
SUPPORTED_RANGE = ">=0.5.15,<0.6"
PLUGIN_VERSION = "4"
WRITER_THREADS = 4  # dump writers per writing rank (safetensors serialisation + tmpfs copy)
ENTRY_POINT_GROUP = "sglang.srt.plugins"

# Every SGLang name the plugin relies on, as (module, qualified attribute, required parameters).
CONTRACT: dict[str, Any] = {
    "entry_point_group": ("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", ENTRY_POINT_GROUP),
    "hook_registry": ("sglang.srt.plugins.hook_registry", "HookRegistry.register", ()),
    "hook_types": ("sglang.srt.plugins.hook_registry", "HookType", ("BEFORE", "AFTER")),
    "hooks": {
        "enable": ("sglang.srt.model_executor.model_runner", "ModelRunner.init_attention_backends", ("self",)),
        "live_batch": ("sglang.srt.model_executor.model_runner", "ModelRunner.forward", ("self", "forward_batch")),
        "logits": (
            "sglang.srt.layers.logits_processor",
            "LogitsProcessor.forward",
            ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"),
        ),
        "prefix_cap": ("sglang.srt.managers.schedule_batch", "Req._compute_max_prefix_len", ("self", "input_len")),
        "release": ("sglang.srt.mem_cache.common", "release_kv_cache", ("req", "tree_cache")),
    },
    # The status hook moved in 0.5.22: the first of these that exists is used.
    "status_hooks": (
        (
            "sglang.srt.managers.scheduler_components.internal_state",
            "SchedulerInternalStateController.get_internal_state",
            ("self", "recv_req"),
        ),
        ("sglang.srt.managers.scheduler", "Scheduler.get_internal_state", ("self", "recv_req")),
    ),
    "forward_batch": (
        "sglang.srt.model_executor.forward_batch_info",
        "ForwardBatch",
        (
            "forward_mode",
            "rids",
            "extend_prefix_lens_cpu",
            "extend_seq_lens_cpu",
            "positions",
            "input_ids",
            "batch_size",
        ),
    ),
    "forward_mode": (
        "sglang.srt.model_executor.forward_batch_info",
        "ForwardMode",
        ("EXTEND", "MIXED", "is_extend", "is_target_verify"),
    ),
    "parallel": ("sglang.srt.runtime_context", "get_parallel", ("attn_tp_rank", "pp_rank", "pp_size")),
    "model_method": "set_eagle3_layers_to_capture",
}


class PluginConfigError(SystemExit):
    """Refuses to start the server: SGLang catches Exception from plugins and carries on, which
    would leave a capture server that silently captures nothing."""

    def __init__(self, message: str):
        logger.error("eyas capture plugin: %s", message)
        super().__init__(f"eyas capture plugin: {message}")


@dataclasses.dataclass(kw_only=True)
class PluginConfig:
    layer_ids: list[int] | None
    """Aux layer ids, eyas convention; None = the EAGLE-3 default for the model (2, N//2, N-3)."""
    dump_dir: str
    """Where dumps are written (a tmpfs keeps it fast; the client deletes each dump it ingests)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PluginConfig:
        env = os.environ if env is None else env
        raw = env.get("EYAS_CAPTURE_LAYERS", "").strip()
        layers = None
        if raw:
            try:
                layers = [int(x) for x in raw.split(",") if x.strip()]
            except ValueError:
                raise PluginConfigError(
                    f"EYAS_CAPTURE_LAYERS={raw!r}: expected comma-separated integers "
                    "(eyas convention: id i = input to decoder layer i)"
                ) from None
            if not layers or min(layers) < 1 or len(set(layers)) != len(layers):
                raise PluginConfigError(f"EYAS_CAPTURE_LAYERS={raw!r}: expected distinct ids >= 1")
        return cls(layer_ids=layers, dump_dir=env.get("EYAS_DUMP_DIR", DEFAULT_DUMP_DIR))


def capture_enabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("EYAS_CAPTURE", "").strip().lower() in ("1", "true", "yes", "on")


# ----------------------------------------------------------------------------- contract checks


def _resolve(module: str, qualname: str):
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_runtime_contract() -> list[str]:
    """Problems with the installed SGLang (empty list = every hook and field is there)."""
    problems: list[str] = []

    def get(module, qualname):
        try:
            return _resolve(module, qualname)
        except Exception as exc:  # ImportError, AttributeError, or an import-time failure
            problems.append(f"{module}.{qualname} is missing ({type(exc).__name__}: {exc})")
            return None

    mod, name, want = CONTRACT["entry_point_group"]
    if (got := get(mod, name)) is not None and got != want:
        problems.append(f"{mod}.{name} = {got!r}, expected {want!r}")
    get(*CONTRACT["hook_registry"][:2])
    mod, name, members = CONTRACT["hook_types"]
    if (ht := get(mod, name)) is not None:
        problems += [f"{mod}.{name}.{m} is missing" for m in members if not hasattr(ht, m)]
    for mod, qual, params in CONTRACT["hooks"].values():
        fn = get(mod, qual)
        if fn is not None:
            have = list(inspect.signature(fn).parameters)
            missing = [p for p in params if p not in have]
            if missing:
                problems.append(f"{mod}.{qual} has parameters {have}, missing {missing}")
    if status_hook_target() is None:
        problems.append(
            "no get_internal_state hook point: tried " + ", ".join(f"{m}.{q}" for m, q, _ in CONTRACT["status_hooks"])
        )
    mod, name, fields = CONTRACT["forward_batch"]
    if (fb := get(mod, name)) is not None:
        have = {f.name for f in dataclasses.fields(fb)} if dataclasses.is_dataclass(fb) else set(dir(fb))
        problems += [f"ForwardBatch.{f} is missing" for f in fields if f not in have]
    mod, name, members = CONTRACT["forward_mode"]
    if (fm := get(mod, name)) is not None:
        problems += [f"ForwardMode.{m} is missing" for m in members if not hasattr(fm, m)]
    get(*CONTRACT["parallel"][:2])
    return problems


def status_hook_target() -> tuple[str, str] | None:
    """(module, qualname) of the installed SGLang's get_internal_state, or None."""
    for mod, qual, params in CONTRACT["status_hooks"]:
        try:
            fn = _resolve(mod, qual)
        except Exception:
            continue
        if all(p in inspect.signature(fn).parameters for p in params):
            return mod, qual
    return None


def check_contract_in_source(root) -> list[str]:
    """The same contract, checked by reading SGLang's source (an unpacked wheel at `root`, the
    directory holding `sglang/`) without importing it: CI has no GPU and SGLang's dependencies."""
    import ast
    from pathlib import Path

    root = Path(root)
    problems: list[str] = []
    trees: dict[str, ast.Module] = {}

    def tree(module: str) -> ast.Module | None:
        if module not in trees:
            base = root.joinpath(*module.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if not path.is_file():
                problems.append(f"module {module} not found ({path})")
                trees[module] = None
            else:
                trees[module] = ast.parse(path.read_text())
        return trees[module]

    def top(module: str, name: str):
        t = tree(module)
        if t is None:
            return None
        for node in t.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(x, ast.Name) and x.id == name for x in node.targets):
                return node
        problems.append(f"{module}.{name} not defined")
        return None

    def member(cls: ast.ClassDef, name: str):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(x, ast.Name) and x.id == name for x in node.targets):
                return node
        return None

    def params(fn: ast.FunctionDef) -> list[str]:
        a = fn.args
        return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]

    mod, name, want = CONTRACT["entry_point_group"]
    node = top(mod, name)
    if isinstance(node, ast.Assign) and not (isinstance(node.value, ast.Constant) and node.value.value == want):
        problems.append(f"{mod}.{name} is not {want!r}")
    mod, qual, _ = CONTRACT["hook_registry"]
    cls = top(mod, qual.split(".")[0])
    if cls is not None and member(cls, "register") is None:
        problems.append(f"{mod}.{qual} not defined")
    mod, name, members = CONTRACT["hook_types"]
    if (cls := top(mod, name)) is not None:
        problems += [f"{mod}.{name}.{m} not defined" for m in members if member(cls, m) is None]

    def method_problem(mod: str, qual: str, want_params) -> str | None:
        """Why the method (Class.name) or module function (name) `qual` of `mod` falls short; None if it does not."""
        cls_name, _, meth = qual.rpartition(".")
        if not cls_name:
            fn = top(mod, meth)  # a missing one is said there, in the words returned below
        elif (cls := top(mod, cls_name)) is None:
            return f"{mod}.{cls_name} not defined"
        else:
            fn = member(cls, meth)
        if not isinstance(fn, ast.FunctionDef):
            return f"{mod}.{qual} not defined"
        missing = [p for p in want_params if p not in params(fn)]
        return f"{mod}.{qual} has parameters {params(fn)}, missing {missing}" if missing else None

    for mod, qual, want_params in CONTRACT["hooks"].values():
        if (why := method_problem(mod, qual, want_params)) is not None and why not in problems:
            problems.append(why)
    # the first status hook point that exists is used; the others' absence is no problem
    found, tried = False, []
    for mod, qual, want_params in CONTRACT["status_hooks"]:
        saved = list(problems)
        base = root.joinpath(*mod.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            tried.append(f"{mod}.{qual} (no module)")
            continue
        why = method_problem(mod, qual, want_params)
        problems[:] = saved
        if why is None:
            found = True
            break
        tried.append(why)
    if not found:
        problems.append("no get_internal_state hook point: " + "; ".join(tried))
    for key in ("forward_batch", "forward_mode"):
        mod, name, members = CONTRACT[key]
        if (cls := top(mod, name)) is not None:
            problems += [f"{name}.{m} not defined" for m in members if member(cls, m) is None]
    mod, name, names = CONTRACT["parallel"]
    if top(mod, name) is not None:
        declared = code_words(tree(mod))
        problems += [f"{mod}: parallel rank {n!r} not declared" for n in names if n not in declared]
    return problems


def code_words(tree) -> set[str]:
    """The words a module's code uses: defined, read and keyword names, attributes, and whole string
    literals (field-name tuples, dict keys). Comments are not in the tree; docstrings, other bare
    string statements and the text of f-strings are left out, so prose never counts as code."""
    import ast

    prose = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            prose.add(id(node.value))
        elif isinstance(node, ast.JoinedStr):
            prose.update(id(v) for v in node.values)
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            words.add(node.value)
    return words


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def version_supported(v: str | None) -> bool:
    if v is None:
        return False
    try:
        nums = [int(x) for x in v.split(".post")[0].split(".")[:3]]
    except ValueError:
        return False
    return (0, 5, 15) <= tuple(nums) < (0, 6, 0)


# ----------------------------------------------------------------------------- live state


class _State:
    """Plugin state of one server process (one scheduler process per GPU rank).

    The hook functions registered with SGLang are one-line calls into these methods, so the
    stand-in server (standin.py) can drive the very same code with one state per simulated rank.
    """

    def __init__(self, cfg: PluginConfig):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.core = CaptureCore()
        self.writer: DumpWriter | None = None
        self.layer_ids: list[int] | None = cfg.layer_ids
        self.ranks = {"attn_tp_rank": 0, "pp_rank": 0, "pp_size": 1}
        self.model: dict[str, Any] = {}
        self.enabled = False
        self.errors = 0
        self.last_error = ""
        self.logits_sig: inspect.Signature | None = None
        self._live: tuple[int, Any] | None = None  # (thread id, the scheduler's ForwardBatch)
        self.counts = {
            "live_batches": 0,
            "rids_from_live_batch": 0,
            "unmatched_forwards": 0,
            "rid_less_forwards": 0,
            "prefix_caps": 0,  # eyas requests whose radix-cache match _on_max_prefix_len capped at 0
            "insert_skips": 0,  # finished eyas requests released without a radix-cache insert (_on_release)
        }

    def is_writer(self) -> bool:
        r = self.ranks
        return r["attn_tp_rank"] == 0 and r["pp_rank"] == r["pp_size"] - 1

    def status(self) -> dict[str, Any]:
        return plugin_status(
            layer_ids=self.layer_ids or [],
            dump_dir=self.cfg.dump_dir,
            sglang_version=sglang_version(),
            plugin_version=PLUGIN_VERSION,
            model=self.model,
            extra={
                "enabled": self.enabled,
                "ranks": self.ranks,
                "writer": self.is_writer(),
                "stats": {**self.core.stats, **self.counts},
                "write_errors": len(self.writer.errors) if self.writer else 0,
                "hook_errors": self.errors,
                "last_error": self.last_error,
                "pending": len(self.core.pending_rids()),
                "prefix_cap": True,  # an eyas request's radix-cache match is capped at 0 (_on_max_prefix_len)
                "skip_insert": True,  # and its prompt is not inserted into the cache when it ends (_on_release)
            },
        )

    # --- hook bodies

    def on_model_runner_forward(self, forward_batch: Any) -> None:
        """BEFORE ModelRunner.forward: remember the live batch (it has `rids`; a replay batch may not)."""
        if not self.enabled or not self.is_writer():
            return
        self._live = (threading.get_ident(), forward_batch)
        self.counts["live_batches"] += 1

    def on_logits(self, proc: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE LogitsProcessor.forward. Never raises into the forward: errors are counted and logged."""
        if not self.enabled or not self.is_writer():
            return  # non-writer ranks hold the same rows: they read and submit nothing
        try:
            bound = self.logits_sig.bind(proc, *args, **kwargs).arguments
            info = self.forward_info(bound)
            if info is not None:
                with self.lock:
                    done = self.core.observe(info)
                self.writer.submit(done)
        except Exception as exc:
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.errors <= 5:
                logger.exception("eyas capture hook failed (the forward continues)")

    def request_ids(self, fb: Any) -> list | None:
        """The batch's request ids: its own, or those of the live batch it was rebuilt from.

        Worked case (prefill CUDA-graph replay): the scheduler's batch has rids [a, b], seq lens
        [5, 3], prefix lens [0, 0]; the replay batch has rids None and the same two length lists
        (copied by reference), so it takes [a, b]. A replay batch whose lengths differ from the live
        batch's cannot be matched: its eyas requests are rejected, never written under another rid.
        With no live batch on this thread (or one without rids) nobody can be told: the forward is
        counted in `rid_less_forwards`, which the client and `eyas verify-server` report with REPLAY_FLAG.
        """
        rids = getattr(fb, "rids", None)
        live, self._live = self._live, None  # consumed: a later, unrelated call never reuses it
        if rids is not None:
            return list(rids)
        lb = live[1] if live is not None and live[0] == threading.get_ident() else None
        live_rids = list(getattr(lb, "rids", None) or [])
        if not live_rids:
            self.counts["rid_less_forwards"] += 1
            if self.counts["rid_less_forwards"] == 1:
                logger.warning(
                    "eyas capture: a forward without request ids and no scheduler batch to take them from "
                    "was dropped (prefill CUDA-graph replay?); restart the server with %s",
                    REPLAY_FLAG,
                )
            return None
        if not any(parse_rid(r) is not None for r in live_rids):
            return None
        same = (
            list(getattr(lb, "extend_seq_lens_cpu", None) or []) == list(fb.extend_seq_lens_cpu or [])
            and list(getattr(lb, "extend_prefix_lens_cpu", None) or []) == list(fb.extend_prefix_lens_cpu or [])
            and len(live_rids) == len(fb.extend_seq_lens_cpu or [])
        )
        if not same:
            self.counts["unmatched_forwards"] += 1
            self.writer.submit(
                [
                    CompletedSample(
                        rid=str(r),
                        num_tokens=parse_rid(r),
                        status="rejected",
                        reason="the logits step got a batch without request ids whose lengths do not match the scheduler's "
                        f"batch (prefill CUDA-graph replay?); restart the server with {REPLAY_FLAG}",
                    )
                    for r in live_rids
                    if parse_rid(r) is not None
                ]
            )
            return None
        self.counts["rids_from_live_batch"] += 1
        return live_rids

    def forward_info(self, bound: dict[str, Any]) -> ForwardInfo | None:
        """Read one logits-processor call; None when there is nothing for eyas in it."""
        import torch

        fb = bound.get("logits_metadata")
        mode = getattr(fb, "forward_mode", None)
        if mode is None or not hasattr(fb, "extend_seq_lens_cpu"):
            return None
        if not mode.is_extend() or mode.is_target_verify():
            self._live = None
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        rids = self.request_ids(fb)
        if not rids or not any(parse_rid(r) is not None for r in rids):
            return None
        hidden = bound["hidden_states"]
        aux = bound.get("aux_hidden_states")
        if aux is None:
            self.writer.submit(
                [
                    CompletedSample(
                        rid=str(r),
                        num_tokens=parse_rid(r),
                        status="rejected",
                        reason="the forward carried no aux hidden states (capture is not active on this model path)",
                    )
                    for r in rids
                    if parse_rid(r) is not None
                ]
            )
            return None
        if isinstance(aux, torch.Tensor) and aux.dim() == 2:  # packed [T, A*H]
            aux = aux.view(aux.shape[0], -1, hidden.shape[-1])
        return ForwardInfo(
            rids=rids,
            extend_prefix_lens=[int(x) for x in fb.extend_prefix_lens_cpu],
            extend_seq_lens=[int(x) for x in fb.extend_seq_lens_cpu],
            aux=aux,
            final_TD=hidden,
            positions_T=fb.positions,
            input_ids_T=fb.input_ids,
            **self.ranks,
        )


_STATE: _State | None = None


def _ranks() -> dict[str, int]:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return {"attn_tp_rank": int(p.attn_tp_rank), "pp_rank": int(p.pp_rank), "pp_size": int(p.pp_size)}


def server_arg(args, name: str, default: Any = None) -> Any:
    """ServerArgs.<name> as SGLang resolved it, which is what the server runs with.

    Up to 0.5.18 ServerArgs.__post_init__ leaves its decisions on the fields. From 0.5.19 the fields
    keep the operator's raw input (`_raw_input` holds a copy) and each decision is a declaration
    appended to `_resolved_overrides`, a list of (source, {field: value}) where the last writer wins;
    SGLang reads them through arg_groups.overrides.resolution_result, which this mirrors without
    importing SGLang. There, only a declaration carries e.g. the prefill CUDA-graph backend that the
    platform's default or the compatibility cascade chose (the raw cuda_graph_config is None unless
    the operator passed --cuda-graph-config), or enable_prefill_cp set by the older
    --enable-prefill-context-parallel (0.5.19).
    """
    if isinstance(getattr(args, "_raw_input", None), dict):
        for _source, declared in reversed(getattr(args, "_resolved_overrides", None) or ()):
            if name in declared:
                return declared[name]
    return getattr(args, name, default)


def _default_prefill_backend() -> str | None:
    """SGLang's own default prefill CUDA-graph backend on this platform, None without SGLang.

    0.5.15-0.5.21: breakable on CUDA, tc_piecewise on every other platform (ROCm, NPU, XPU, CPU,
    out-of-tree platforms); 0.5.22+: breakable on CUDA, disabled elsewhere."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import default_prefill_backend

        backend = default_prefill_backend()
    except Exception:  # no SGLang here (tests, the stand-in), or a release without the function
        return None
    return str(getattr(backend, "value", backend))


def _prefill_graph_backend(args) -> str | None:
    """The prefill CUDA-graph backend the server runs: the resolved cuda_graph_config.prefill.backend,
    which folds in --cuda-graph-backend-prefill, --disable-prefill-cuda-graph, the JSON config, the
    platform default and SGLang's compatibility cascade. Args without a resolved config (never a real
    server) follow SGLang's precedence: the flags, then the platform default, which is NOT breakable
    off CUDA. None: unknown (no config, no flag, no SGLang to ask)."""
    cfg = server_arg(args, "cuda_graph_config")
    prefill = cfg.get("prefill") if isinstance(cfg, dict) else getattr(cfg, "prefill", None)
    backend = prefill.get("backend") if isinstance(prefill, dict) else getattr(prefill, "backend", None)
    if backend is None:
        backend = server_arg(args, "cuda_graph_backend_prefill")
        if backend is None and (
            server_arg(args, "disable_prefill_cuda_graph", False) or server_arg(args, "disable_cuda_graph", False)
        ):
            backend = "disabled"
        if backend is None:
            backend = _default_prefill_backend()
    return None if backend is None else str(getattr(backend, "value", backend))


def check_server_args(args) -> None:
    """Refuse server settings under which capture would be wrong or incomplete (see module docstring).
    Every setting is read as SGLang resolved it (server_arg)."""
    if args is None:
        return
    spec = server_arg(args, "speculative_algorithm")
    if spec:
        raise PluginConfigError(
            f"--speculative-algorithm {spec} is set: a capture server runs the target alone "
            "(drop the speculative flags)"
        )
    if server_arg(args, "enable_return_aux_hidden_states", False):
        raise PluginConfigError(
            "--enable-return-aux-hidden-states is set: eyas turns aux capture on itself; "
            "drop that flag (and --return-aux-hidden-state-layer-ids), use EYAS_CAPTURE_LAYERS"
        )
    if int(server_arg(args, "pp_size", 1) or 1) > 1:
        raise PluginConfigError(
            "--pp-size > 1: SGLang captures aux states only on the last pipeline stage, so aux "
            "layers of earlier stages would be missing; capture with --pp-size 1 (use TP/EP)"
        )
    if server_arg(args, "enable_prefill_cp", False):
        raise PluginConfigError(
            "--enable-prefill-cp is set: prefill context parallelism splits each prompt's tokens "
            "across ranks, so the writing rank's logits step would see only part of a sequence's "
            "states; start the capture server without it (plain TP)"
        )
    if int(server_arg(args, "attn_cp_size", 1) or 1) > 1:
        raise PluginConfigError("--attn-cp-size > 1 splits a prompt's rows across ranks; capture needs attn_cp_size 1")
    if server_arg(args, "enable_dp_attention", False) or int(server_arg(args, "attn_dp_size", 1) or 1) > 1:
        raise PluginConfigError(
            "DP attention is on (--enable-dp-attention / --attn-dp-size > 1): one batch's rows are "
            "spread over attention-DP ranks and the writing rank would see only its share; start "
            "the capture server without DP attention (plain TP, or --dp-size replicas)"
        )
    for flag in ("enable_two_batch_overlap", "enable_single_batch_overlap"):
        if server_arg(args, flag, False):
            raise PluginConfigError(
                f"--{flag.replace('_', '-')} is set: DeepSeek-family models skip EAGLE-3 aux "
                "capture for overlapped micro-batches, so their states would be missing; drop it"
            )
    if _prefill_graph_backend(args) == "tc_piecewise":
        raise PluginConfigError(
            "the prefill CUDA graph backend is tc_piecewise (SGLang's default off CUDA up to "
            "0.5.21, and for some multimodal models): it compiles the logits step the plugin "
            f"hooks; start the server with {REPLAY_FLAG}, or --cuda-graph-backend-prefill "
            "breakable or full where the platform supports them"
        )


def capture_owner(model) -> Any:
    """The module whose `layers_to_capture` the model's decoder loop reads.

    Llama: `model.model`. Kimi-K2.5: `model.model` is a property returning the DeepSeek-V3 language
    model, which holds no `layers_to_capture`; its own `.model` does. Walks `.model` /
    `.language_model` down at most three levels.
    """
    obj = model
    for _ in range(3):
        nxt = getattr(obj, "model", None)
        if nxt is None:
            nxt = getattr(obj, "language_model", None)
        if nxt is None:
            return None
        if hasattr(nxt, "layers_to_capture"):
            return nxt
        obj = nxt
    return None


def apply_layer_ids(model, layer_ids: list[int]) -> tuple[list[int], str]:
    """Turn on aux capture of `layer_ids` (eyas convention) following the model's own +1 rule.

    SGLang id k means "output of layer k"; models turn it into `layers_to_capture` (inputs):
        Llama family            layers_to_capture = [k + 1 for k in ids]
        DeepSeek-V2/V3, Kimi    + 1 only when ids[0] == 1, else ids unchanged
    So eyas [2, 6, 9] -> pass [1, 5, 8] to either; eyas [3, 6, 9] -> pass [2, 5, 8] to Llama but
    [3, 6, 9] to DeepSeek; eyas [1, ...] cannot be expressed under DeepSeek's rule (passing
    [0, ...] keeps 0, passing [1, ...] adds 1) and is refused. The ids are tried in that order and
    the model's `layers_to_capture` read back; returns (ids passed, rule name).
    """
    owner = capture_owner(model)
    if owner is None:
        raise PluginConfigError(
            f"{type(model).__name__}: no `layers_to_capture` under .model / .language_model, so "
            "the captured layers cannot be read back; this architecture is not supported"
        )
    want = [int(i) for i in layer_ids]
    seen = []
    for rule, passed in (("plus-one", sglang_layer_ids(want)), ("plus-one-if-first-is-1", list(want))):
        model.set_eagle3_layers_to_capture(passed)
        got = [int(i) for i in (owner.layers_to_capture or [])]
        if got == want:
            return passed, rule
        seen.append(f"ids {passed} -> layers_to_capture {got}")
    raise PluginConfigError(
        f"EYAS_CAPTURE_LAYERS={','.join(map(str, want))}: {type(model).__name__} cannot capture the inputs of layers "
        f"{want} ({'; '.join(seen)}). DeepSeek-family models add 1 only when the first id is 1, so a first eyas id "
        "of 1 cannot be captured there: choose a first id >= 2"
    )


def _on_init_attention_backends(runner, *args, **kwargs):
    """BEFORE ModelRunner.init_attention_backends: weights are loaded, CUDA graphs not captured yet."""
    st = _STATE
    if st is None or getattr(runner, "is_draft_worker", False):
        return None
    enable(st, runner.model, server_args=getattr(runner, "server_args", None), ranks=_ranks())
    return None


def enable(st: _State, model, *, server_args, ranks: dict[str, int]) -> None:
    """Check the server, turn capture on in `model`, start the writer (writing rank only)."""
    check_server_args(server_args)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    try:
        layer_ids = check_layer_ids(st.cfg.layer_ids, n) if st.cfg.layer_ids else default_aux_layer_ids(n)
    except EyasError as exc:
        raise PluginConfigError(
            f"EYAS_CAPTURE_LAYERS={st.cfg.layer_ids}: {type(model).__name__} has {n} layers: {exc}"
        ) from exc
    if not hasattr(model, CONTRACT["model_method"]):
        raise PluginConfigError(
            f"{type(model).__name__} has no {CONTRACT['model_method']}: SGLang {sglang_version()} "
            "cannot capture EAGLE-3 aux hidden states for this architecture"
        )
    passed, rule = apply_layer_ids(model, list(layer_ids))
    st.layer_ids = list(layer_ids)
    st.ranks = dict(ranks)
    st.model = {
        "class": type(model).__name__,
        "num_layers": n,
        "hidden_size": int(getattr(text, "hidden_size", 0) or 0),
        "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 0),
        "layers_to_capture": list(capture_owner(model).layers_to_capture),
        "ids_passed": passed,
        "layer_id_rule": rule,
    }
    if st.is_writer():
        writer = {**st.ranks, "pid": os.getpid()}
        st.writer = DumpWriter(st.cfg.dump_dir, layer_ids=layer_ids, writer=writer, threads=WRITER_THREADS)
    st.enabled = True
    logger.info(
        "eyas capture: layers %s (hf-input; passed %s, rule %s), dump dir %s, ranks %s, writer=%s",
        layer_ids,
        passed,
        rule,
        st.cfg.dump_dir,
        st.ranks,
        st.is_writer(),
    )


def _on_model_runner_forward(runner, forward_batch=None, *args, **kwargs):
    """BEFORE ModelRunner.forward."""
    st = _STATE
    if st is not None and not getattr(runner, "is_draft_worker", False):
        st.on_model_runner_forward(forward_batch if forward_batch is not None else kwargs.get("forward_batch"))
    return None


def _on_logits(proc, *args, **kwargs):
    """BEFORE LogitsProcessor.forward."""
    st = _STATE
    if st is not None:
        st.on_logits(proc, *args, **kwargs)
    return None


def _on_max_prefix_len(result, req=None, *args, **kwargs):
    """AFTER Req._compute_max_prefix_len: 0 for an eyas request (no cached prefix), SGLang's own cap otherwise.
    Counted, so that the client's probe can tell the cap is in effect."""
    if parse_rid(getattr(req, "rid", None)) is None:
        return None
    st = _STATE
    if st is not None:
        st.counts["prefix_caps"] += 1
    return 0


def _on_release(req=None, *args, **kwargs):
    """BEFORE release_kv_cache: a finished eyas request's KV is freed without a radix-cache insert (SGLang's
    `skip_radix_cache_insert`); any other request is left alone."""
    if parse_rid(getattr(req, "rid", None)) is None:
        return None
    req.skip_radix_cache_insert = True
    st = _STATE
    if st is not None:
        st.counts["insert_skips"] += 1
    return None


def _on_internal_state(result, *args, **kwargs):
    """AFTER get_internal_state: add the plugin's status to /server_info."""
    st = _STATE
    if st is not None and result is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["eyas_capture"] = st.status()
    return result


def hook_target(key: str) -> str:
    """The dotted method name SGLang's HookRegistry takes for the hook point CONTRACT["hooks"][key]."""
    mod, qual, _ = CONTRACT["hooks"][key]
    return f"{mod}.{qual}"


def register_hooks(registry, hook_type, *, status_target: tuple[str, str] | None = None) -> list[str]:
    """Register the plugin's hooks with SGLang's HookRegistry; returns the targets."""
    targets = []
    for key, fn, kind in (
        ("enable", _on_init_attention_backends, hook_type.BEFORE),
        ("live_batch", _on_model_runner_forward, hook_type.BEFORE),
        ("logits", _on_logits, hook_type.BEFORE),
        ("prefix_cap", _on_max_prefix_len, hook_type.AFTER),
        ("release", _on_release, hook_type.BEFORE),
    ):
        registry.register(hook_target(key), fn, kind)
        targets.append(hook_target(key))
    if status_target is not None:
        registry.register(".".join(status_target), _on_internal_state, hook_type.AFTER)
        targets.append(".".join(status_target))
    return targets


def register() -> None:
    """The `sglang.srt.plugins` entry point: check the contract, then register the hooks."""
    global _STATE
    if not capture_enabled():
        return
    v = sglang_version()
    problems = check_runtime_contract()
    if problems:
        raise PluginConfigError(
            f"SGLang {v} lacks what the plugin needs (pinned {PINNED_SGLANG}, supported {SUPPORTED_RANGE}):\n  - "
            + "\n  - ".join(problems)
            + f"\ninstall sglang=={PINNED_SGLANG} or unset EYAS_CAPTURE"
        )
    if not version_supported(v):
        logger.warning(
            "eyas capture: SGLang %s is outside the supported range %s (pinned %s); every hook point "
            "was found, continuing",
            v,
            SUPPORTED_RANGE,
            PINNED_SGLANG,
        )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _STATE = _State(PluginConfig.from_env())
    mod, qual, _ = CONTRACT["hooks"]["logits"]
    _STATE.logits_sig = inspect.signature(_resolve(mod, qual))
    register_hooks(HookRegistry, HookType, status_target=status_hook_target())
    logger.info("eyas capture plugin registered (SGLang %s, dump dir %s)", v, _STATE.cfg.dump_dir)
