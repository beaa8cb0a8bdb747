"""The SGLang server plugin: the ONLY module of eyas that knows SGLang's internals.

Pinned to SGLang 0.5.23 (the current 0.5.x release; its PyPI wheel was read for every hook below).
Supported range: >=0.5.22,<0.6 (0.5.22's wheel passes the same contract check). On start-up the
plugin checks that every hook point and ForwardBatch field it uses exists and refuses to start the
server otherwise, naming the version.
`CONTRACT` lists them; tests/test_sglang_contract.py checks the same list in the pinned wheel.

Install eyas into the server's Python environment; the entry point in eyas's pyproject

    [project.entry-points."sglang.srt.plugins"]
    eyas_capture = "eyas.sglang.plugin:register"

is loaded by SGLang in every server process (`sglang.srt.plugins.load_plugins`). The plugin is
inactive unless EYAS_CAPTURE=1, so installing eyas next to a serving deployment changes nothing.

Environment (read by every server process):
    EYAS_CAPTURE=1                  turn capture on
    EYAS_CAPTURE_LAYERS=2,15,27     aux layer ids in eyas's convention (hf-input: id i = INPUT to
                                    decoder layer i); default = 2, N//2, N-3. SGLang's own ids are
                                    these minus one; the plugin converts and reads the model back.
    EYAS_DUMP_DIR=/dev/shm/eyas-dumps

Hooks (sglang.srt.plugins.hook_registry.HookRegistry):
    BEFORE ModelRunner.init_attention_backends   runs after the weights are loaded and before CUDA
        graphs are captured: turns on EAGLE-3 aux capture (model.set_eagle3_layers_to_capture) so the
        graphs include the capture, and records this rank (attention-TP rank, PP rank).
    BEFORE LogitsProcessor.forward   every model hands the logits processor the final POST-NORM
        hidden states of all rows and the aux states, with the ForwardBatch. Under SGLang's default
        prefill CUDA graphs (breakable / full) this tail runs eagerly, so the hook sees every EXTEND
        forward. Rows of eyas requests go to CaptureCore (core.py), which stitches and writes dumps.
    AFTER SchedulerInternalStateController.get_internal_state   adds "eyas_capture" (layer ids,
        dump dir, model, counters) to /server_info's internal_states, which the client checks.
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
SUPPORTED_RANGE = ">=0.5.22,<0.6"  # 0.5.22 passes the same contract check (its wheel was read too)
PLUGIN_VERSION = "1"
WRITER_THREADS = 4  # dump writers per writing rank (safetensors serialisation + tmpfs copy)
ENTRY_POINT_GROUP = "sglang.srt.plugins"

# Every SGLang name the plugin relies on, as (module, qualified attribute, required parameters).
CONTRACT: dict[str, Any] = {
    "entry_point_group": ("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", ENTRY_POINT_GROUP),
    "hook_registry": ("sglang.srt.plugins.hook_registry", "HookRegistry.register", ()),
    "hook_types": ("sglang.srt.plugins.hook_registry", "HookType", ("BEFORE", "AFTER")),
    "hooks": {
        "enable": ("sglang.srt.model_executor.model_runner", "ModelRunner.init_attention_backends", ("self",)),
        "logits": ("sglang.srt.layers.logits_processor", "LogitsProcessor.forward",
                   ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")),
        "status": ("sglang.srt.managers.scheduler_components.internal_state",
                   "SchedulerInternalStateController.get_internal_state", ("self", "recv_req")),
    },
    "forward_batch": ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch",
                      ("forward_mode", "rids", "extend_prefix_lens_cpu", "extend_seq_lens_cpu", "positions",
                       "input_ids", "batch_size")),
    "forward_mode": ("sglang.srt.model_executor.forward_batch_info", "ForwardMode",
                     ("EXTEND", "MIXED", "is_extend", "is_target_verify")),
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
    def from_env(cls, env: dict[str, str] | None = None) -> "PluginConfig":
        env = os.environ if env is None else env
        raw = env.get("EYAS_CAPTURE_LAYERS", "").strip()
        layers = None
        if raw:
            try:
                layers = [int(x) for x in raw.split(",") if x.strip()]
            except ValueError:
                raise PluginConfigError(f"EYAS_CAPTURE_LAYERS={raw!r}: expected comma-separated integers "
                                        "(eyas convention: id i = input to decoder layer i)") from None
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
    mod, name, fields = CONTRACT["forward_batch"]
    if (fb := get(mod, name)) is not None:
        have = {f.name for f in dataclasses.fields(fb)} if dataclasses.is_dataclass(fb) else set(dir(fb))
        problems += [f"ForwardBatch.{f} is missing" for f in fields if f not in have]
    mod, name, members = CONTRACT["forward_mode"]
    if (fm := get(mod, name)) is not None:
        problems += [f"ForwardMode.{m} is missing" for m in members if not hasattr(fm, m)]
    get(*CONTRACT["parallel"][:2])
    return problems


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
    for mod, qual, want_params in CONTRACT["hooks"].values():
        cls_name, meth = qual.split(".")
        if (cls := top(mod, cls_name)) is None:
            continue
        fn = member(cls, meth)
        if not isinstance(fn, ast.FunctionDef):
            problems.append(f"{mod}.{qual} not defined")
            continue
        missing = [p for p in want_params if p not in params(fn)]
        if missing:
            problems.append(f"{mod}.{qual} has parameters {params(fn)}, missing {missing}")
    for key in ("forward_batch", "forward_mode"):
        mod, name, members = CONTRACT[key]
        if (cls := top(mod, name)) is not None:
            problems += [f"{name}.{m} not defined" for m in members if member(cls, m) is None]
    mod, name, names = CONTRACT["parallel"]
    if top(mod, name) is not None:
        text = (root.joinpath(*mod.split(".")).with_suffix(".py")).read_text()
        problems += [f"{mod}: parallel rank {n!r} not declared" for n in names if f'"{n}"' not in text]
    return problems


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
    return (0, 5, 22) <= tuple(nums) < (0, 6, 0)


# ----------------------------------------------------------------------------- live state


class _State:
    """Process-wide plugin state (one scheduler process per GPU rank)."""

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

    def status(self) -> dict[str, Any]:
        return plugin_status(
            layer_ids=self.layer_ids or [], dump_dir=self.cfg.dump_dir, sglang_version=sglang_version(),
            plugin_version=PLUGIN_VERSION, model=self.model,
            extra={"enabled": self.enabled, "ranks": self.ranks, "stats": dict(self.core.stats),
                   "write_errors": len(self.writer.errors) if self.writer else 0,
                   "hook_errors": self.errors, "last_error": self.last_error,
                   "pending": len(self.core.pending_rids())},
        )


_STATE: _State | None = None


def _ranks() -> dict[str, int]:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return {"attn_tp_rank": int(p.attn_tp_rank), "pp_rank": int(p.pp_rank), "pp_size": int(p.pp_size)}


def _check_server_args(runner) -> None:
    args = getattr(runner, "server_args", None)
    if args is None:
        return
    spec = getattr(args, "speculative_algorithm", None)
    if spec:
        raise PluginConfigError(f"--speculative-algorithm {spec} is set: a capture server runs the target alone "
                                "(drop the speculative flags)")
    if getattr(args, "enable_return_aux_hidden_states", False):
        raise PluginConfigError("--enable-return-aux-hidden-states is set: eyas turns aux capture on itself; "
                                "drop that flag (and --return-aux-hidden-state-layer-ids), use EYAS_CAPTURE_LAYERS")
    if int(getattr(args, "pp_size", 1) or 1) > 1:
        raise PluginConfigError("--pp-size > 1: SGLang captures aux states only on the last pipeline stage, so aux "
                                "layers of earlier stages would be missing; capture with --pp-size 1 (use TP/EP)")
    if int(getattr(args, "attn_cp_size", 1) or 1) > 1:
        raise PluginConfigError("--attn-cp-size > 1 splits a prompt's rows across ranks; capture needs attn_cp_size 1")


def _on_init_attention_backends(runner, *args, **kwargs):
    """BEFORE ModelRunner.init_attention_backends: weights are loaded, CUDA graphs not captured yet."""
    st = _STATE
    if st is None or getattr(runner, "is_draft_worker", False):
        return None
    _check_server_args(runner)
    model = runner.model
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    try:
        layer_ids = check_layer_ids(st.cfg.layer_ids, n) if st.cfg.layer_ids else default_aux_layer_ids(n)
    except EyasError as exc:
        raise PluginConfigError(f"EYAS_CAPTURE_LAYERS={st.cfg.layer_ids}: {type(model).__name__} has {n} layers: {exc}") from exc
    if not hasattr(model, CONTRACT["model_method"]):
        raise PluginConfigError(f"{type(model).__name__} has no {CONTRACT['model_method']}: SGLang {sglang_version()} "
                                "cannot capture EAGLE-3 aux hidden states for this architecture")
    model.set_eagle3_layers_to_capture(sglang_layer_ids(layer_ids))
    inner = getattr(model, "model", None)
    readback = getattr(inner, "layers_to_capture", None)
    adjusted = False
    if readback is not None and list(readback) != list(layer_ids):
        # Some families (DeepSeek-V2/V3) add the +1 only when the first id is 1: layers_to_capture
        # always means "capture the input of layer i", so set the ids we mean directly.
        inner.layers_to_capture = list(layer_ids)
        adjusted = True
    st.layer_ids = list(layer_ids)
    st.ranks = _ranks()
    st.model = {"class": type(model).__name__, "num_layers": n, "hidden_size": int(getattr(text, "hidden_size", 0) or 0),
                "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
                "layers_to_capture": list(getattr(inner, "layers_to_capture", []) or []),
                "layers_to_capture_adjusted": adjusted}
    writer = {**st.ranks, "pid": os.getpid()}
    st.writer = DumpWriter(st.cfg.dump_dir, layer_ids=layer_ids, writer=writer, threads=WRITER_THREADS)
    st.enabled = True
    logger.info("eyas capture: layers %s (hf-input; SGLang ids %s), dump dir %s, ranks %s, writer=%s",
                layer_ids, sglang_layer_ids(layer_ids), st.cfg.dump_dir, st.ranks,
                st.ranks["attn_tp_rank"] == 0 and st.ranks["pp_rank"] == st.ranks["pp_size"] - 1)
    return None


def _forward_info(st: _State, bound: dict[str, Any]) -> ForwardInfo | None:
    """Read one logits-processor call; None when there is nothing for eyas in it."""
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    fb = bound.get("logits_metadata")
    if not isinstance(fb, ForwardBatch):
        return None
    mode = fb.forward_mode
    if mode is None or not mode.is_extend() or mode.is_target_verify():
        return None
    rids = fb.rids or []
    if not any(parse_rid(r) is not None for r in rids):
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    hidden = bound["hidden_states"]
    aux = bound.get("aux_hidden_states")
    if aux is None:
        for r in rids:
            if parse_rid(r) is not None:
                st.writer.submit([CompletedSample(rid=str(r), num_tokens=parse_rid(r), status="rejected",
                                                  reason="the forward carried no aux hidden states (capture is not "
                                                         "active on this model path)")])
        return None
    if isinstance(aux, torch.Tensor) and aux.dim() == 2:  # packed [T, A*H]
        aux = aux.view(aux.shape[0], -1, hidden.shape[-1])
    return ForwardInfo(
        rids=rids, extend_prefix_lens=[int(x) for x in fb.extend_prefix_lens_cpu],
        extend_seq_lens=[int(x) for x in fb.extend_seq_lens_cpu], aux=aux, final_TD=hidden,
        positions_T=fb.positions, input_ids_T=fb.input_ids, **st.ranks,
    )


def _on_logits(proc, *args, **kwargs):
    """BEFORE LogitsProcessor.forward. Never raises into the forward: errors are counted and logged."""
    st = _STATE
    if st is None or not st.enabled:
        return None
    try:
        bound = st.logits_sig.bind(proc, *args, **kwargs).arguments
        info = _forward_info(st, bound)
        if info is not None and info.is_writer():
            with st.lock:
                done = st.core.observe(info)
            st.writer.submit(done)
    except Exception as exc:
        st.errors += 1
        st.last_error = f"{type(exc).__name__}: {exc}"
        if st.errors <= 5:
            logger.exception("eyas capture hook failed (the forward continues)")
    return None


def _on_internal_state(result, *args, **kwargs):
    """AFTER get_internal_state: add the plugin's status to /server_info."""
    st = _STATE
    if st is not None and result is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["eyas_capture"] = st.status()
    return result


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
            + "\n  - ".join(problems) + f"\ninstall sglang=={PINNED_SGLANG} or unset EYAS_CAPTURE")
    if not version_supported(v):
        logger.warning("eyas capture: SGLang %s is outside the supported range %s (pinned %s); every hook point "
                       "was found, continuing", v, SUPPORTED_RANGE, PINNED_SGLANG)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _STATE = _State(PluginConfig.from_env())
    mod, qual, _ = CONTRACT["hooks"]["logits"]
    _STATE.logits_sig = inspect.signature(_resolve(mod, qual))
    for key, fn, kind in (("enable", _on_init_attention_backends, HookType.BEFORE),
                          ("logits", _on_logits, HookType.BEFORE),
                          ("status", _on_internal_state, HookType.AFTER)):
        mod, qual, _ = CONTRACT["hooks"][key]
        HookRegistry.register(f"{mod}.{qual}", fn, kind)
    logger.info("eyas capture plugin registered (SGLang %s, dump dir %s)", v, _STATE.cfg.dump_dir)
