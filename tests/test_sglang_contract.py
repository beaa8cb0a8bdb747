"""Contract tests: every SGLang release the plugin claims still has what the plugin relies on.

For each version in plugin.SUPPORTED_VERSIONS (and the newest 0.5.x on the package index), the
cp311 manylinux wheel is fetched with `pip download --no-deps` (whatever Python runs the test),
and the few source files the plugin depends on are unpacked and read WITHOUT importing SGLang (CI
has no GPU nor SGLang's dependencies). Checks look at code, not comments: names and signatures by
AST, and the rules the plugin depends on by running SGLang's own functions, pulled out of its
source (the layer-id rules of Llama, DeepSeek-V2/V3 and the Kimi-K2.5 wrapper), or by reading
`ast.unparse` output, which has no comments. The hook registry module is standard-library only,
so the real one is loaded and the plugin's real hook functions are registered and run through it.

Wheels and unpacked files are cached in $EYAS_SGLANG_WHEEL_DIR (default <eyas cache>/sglang-wheels, the
eyas cache being $EYAS_CACHE or ~/.cache/eyas; pip's own cache is bypassed, so nothing lands elsewhere):
the first run downloads about 250 MB, later runs read the cache (a few seconds in all; a change to
NEEDED unpacks the cached wheels again). A version whose download fails for network reasons is
skipped with the reason; a claimed version the index does not have fails, as does any other failure.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import types
import typing
import zipfile
from pathlib import Path

import pytest
import torch

from eyas.sglang import plugin
from eyas.sglang.core import make_rid, read_dump
from eyas.sglang.standin import ForwardBatch, ForwardMode, replay_batch

# Only these mean the index could not be reached. "No matching distribution" alone is not one of them: pip
# says it when the index answered without the version (a claimed release was yanked or deleted), which fails.
NETWORK_ERRORS = (
    "NewConnectionError",
    "ConnectionError",
    "Temporary failure in name resolution",
    "Max retries",
    "timed out",
    "Network is unreachable",
    "ProxyError",
    "Connection refused",
)
# the files read below, relative to the wheel root (prefixes: a package's whole folder)
NEEDED = (
    "sglang/srt/plugins/",
    "sglang/srt/model_executor/model_runner.py",
    "sglang/srt/layers/logits_processor.py",
    "sglang/srt/managers/scheduler_components/internal_state",
    "sglang/srt/managers/scheduler.py",
    "sglang/srt/model_executor/forward_batch_info.py",
    "sglang/srt/runtime_context",
    "sglang/srt/models/llama.py",
    "sglang/srt/models/deepseek_v2.py",
    "sglang/srt/models/kimi_k25.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/managers/schedule_batch.py",
    "sglang/srt/mem_cache/radix_cache.py",
    "sglang/srt/mem_cache/common.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py",
    "sglang/srt/model_executor/cuda_graph_config.py",
    "sglang/srt/server_args.py",
    "sglang/srt/arg_groups/",
)


def cache_dir() -> Path:
    from eyas.defaults import cache_dir as eyas_cache

    d = Path(os.environ.get("EYAS_SGLANG_WHEEL_DIR") or eyas_cache() / "sglang-wheels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _vkey(v: str) -> tuple:
    base, _, post = v.partition(".post")
    return tuple(int(x) for x in base.split(".")) + (int(post or 0),)


def release(sglang_src: Path) -> tuple:
    """The release an unpacked wheel's source directory (`src-<version>`) holds, as a version key."""
    return _vkey(sglang_src.name.removeprefix("src-"))


def download_failure(version: str, output: str) -> tuple[bool, str]:
    """(skip?, message) for a failed `pip download sglang==version`: skip only when the index could not be
    reached; a version it does not list (yanked or deleted, yet claimed in SUPPORTED_VERSIONS) fails."""
    tail = output.strip()[-300:]
    if any(e in output for e in NETWORK_ERRORS):
        return True, f"cannot download sglang=={version} (package index unreachable): {tail}"
    if "No matching distribution" in output:
        return False, (
            f"sglang=={version} is claimed in plugin.SUPPORTED_VERSIONS but the package index has no "
            f"cp311 manylinux wheel of it (yanked or deleted?): {tail}"
        )
    return False, f"pip download sglang=={version} failed:\n{output[-2000:]}"


def sglang_source(version: str) -> Path:
    """The unpacked files of sglang==version (downloaded once, then cached; unpacked again when NEEDED changes)."""
    cache = cache_dir()
    src = cache / f"src-{version}"
    stamp = "\n".join((version,) + NEEDED)
    if (src / ".done").is_file() and (src / ".done").read_text() == stamp:
        return src
    wheels = [w for w in cache.glob(f"sglang-{version}-*.whl")]
    if not wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_34_x86_64",
            f"sglang=={version}",
            "-d",
            str(cache),
            "-q",
            "--no-cache-dir",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            skip, why = download_failure(version, res.stderr + res.stdout)
            (pytest.skip if skip else pytest.fail)(why)
        wheels = list(cache.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(src, [n for n in z.namelist() if n.endswith(".py") and n.startswith(NEEDED)])
    assert (src / "sglang/srt/plugins/hook_registry.py").is_file(), f"{wheels[0]} has no sglang/srt/plugins"
    (src / ".done").write_text(stamp)
    return src


@pytest.fixture(scope="module", params=plugin.SUPPORTED_VERSIONS)
def sglang_src(request) -> Path:
    return sglang_source(request.param)


# ----------------------------------------------------------------------------- reading code


@functools.lru_cache(maxsize=64)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def codes(path: Path, kind: type) -> list[str]:
    """Every node of one kind in a file, as comment-free code."""
    return [code(n) for n in ast.walk(parse(path)) if isinstance(n, kind)]


def class_def(path: Path, name: str) -> ast.ClassDef:
    for node in parse(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not in {path}")


def method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    for node in class_def(path, cls).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{cls}.{name} not in {path}")


def code(node) -> str:
    """Source without comments, in one normal form (ast.unparse)."""
    return ast.unparse(node)


def load_methods(path: Path, cls: str, names: list[str]) -> dict:
    """SGLang's own method bodies, compiled standalone (they only touch `self`)."""
    ns = {"Optional": typing.Optional, "List": typing.List}  # noqa: UP006 (what SGLang imports)
    for name in names:
        exec(compile(ast.Module([method(path, cls, name)], []), f"{path}:{cls}.{name}", "exec"), ns)
    return {n: ns[n] for n in names}


# ----------------------------------------------------------------------------- names and signatures


def test_every_hook_point_and_field_exists(sglang_src):
    assert plugin.check_contract_in_source(sglang_src) == []


def test_contract_check_would_catch_a_missing_field(tmp_path):
    # The check can fail (shown once, on the pinned release): drop `rids` from a copy of ForwardBatch
    # and rename the logits hook's parameter.
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(sglang_source(plugin.PINNED_SGLANG), copy)
    fbi = copy / "sglang/srt/model_executor/forward_batch_info.py"
    text = fbi.read_text()
    assert "    rids: Optional[List[str]] = None" in text
    fbi.write_text(text.replace("    rids: Optional[List[str]] = None", "    request_ids: Optional[List[str]] = None"))
    lp = copy / "sglang/srt/layers/logits_processor.py"
    tree = ast.parse(lp.read_text())
    fn = next(
        n for n in class_def(lp, "LogitsProcessor").body if isinstance(n, ast.FunctionDef) and n.name == "forward"
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "forward" and node.lineno == fn.lineno:
            for a in node.args.args + node.args.kwonlyargs:
                if a.arg == "aux_hidden_states":
                    a.arg = "aux_states"
    lp.write_text(ast.unparse(tree))
    problems = plugin.check_contract_in_source(copy)
    assert any("ForwardBatch.rids" in p for p in problems)
    assert any("LogitsProcessor.forward" in p and "aux_hidden_states" in p for p in problems)


# ----------------------------------------------------------------------------- semantics, by code


def test_the_replay_batch_copies_the_lengths_the_plugin_matches_on(sglang_src):
    # PrefillCudaGraphRunner.load_batch rebuilds the batch for graph replay; the plugin matches it to
    # the scheduler's batch by these two lists, so they must be copied from the live batch.
    runner = sglang_src / "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py"
    fn = method(runner, "PrefillCudaGraphRunner", "load_batch")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ForwardBatch"]
    assert calls, "load_batch no longer builds a ForwardBatch: re-read the graph-replay path"
    kw = {k.arg: code(k.value) for k in calls[0].keywords}
    assert kw["extend_seq_lens_cpu"] == "forward_batch.extend_seq_lens_cpu"
    assert kw["extend_prefix_lens_cpu"] == "forward_batch.extend_prefix_lens_cpu"
    # the stand-in builds its replay batch the same way: the lengths, no rids unless SGLang copies them
    live = ForwardBatch(
        forward_mode=ForwardMode.MIXED,
        batch_size=1,
        input_ids=torch.arange(3),
        positions=torch.arange(3),
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[3],
        rids=["r"],
    )
    rb = replay_batch(live, bucket=8)
    assert rb.extend_seq_lens_cpu is live.extend_seq_lens_cpu and rb.forward_mode == ForwardMode.EXTEND
    assert (rb.rids is None) == ("rids" not in kw)
    # and ModelRunner.forward, which the plugin hooks for the live batch, receives the scheduler's batch
    mr = method(sglang_src / "sglang/srt/model_executor/model_runner.py", "ModelRunner", "forward")
    assert [a.arg for a in mr.args.args[:2]] == ["self", "forward_batch"]
    assert_breakable_replay_runs_the_tail_eagerly_on_the_static_batch(sglang_src)


def _parents(tree) -> dict:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_model_forward_call(node, batch: str | None = None) -> bool:
    """`self.model_runner.model.forward(B.input_ids, B.positions, B, ...)`: the whole model, tail included."""
    if not (
        isinstance(node, ast.Call) and code(node.func) == "self.model_runner.model.forward" and len(node.args) >= 3
    ):
        return False
    b = code(node.args[2])
    return (batch in (None, b)) and [code(a) for a in node.args[:2]] == [f"{b}.input_ids", f"{b}.positions"]


def assert_breakable_replay_runs_the_tail_eagerly_on_the_static_batch(sglang_src: Path) -> None:
    """On the default CUDA prefill graph (breakable) the replay runs the captured transformer body and
    then the model's forward, so its LogitsProcessor (the plugin's hook), eagerly on the batch load_batch
    rebuilt (no rids). 0.5.15 does it in `execute` under `self.layer_model is not None` (set only for the
    breakable and full backends); 0.5.16+ moved it to `_execute_body_capture`, called from `execute`
    under `self._uses_eager_prefill_tail()` (breakable or full). The full backend runs its tail on the
    live batch instead (a copy of it from 0.5.20): the plugin handles both. Not checked here: the prefill
    context-parallel branch `execute` takes first from 0.5.17 (execute_prefill_cp_bcg, --enable-prefill-cp)."""
    runner = sglang_src / "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py"
    version = release(sglang_src)
    cls = class_def(runner, "PrefillCudaGraphRunner")
    fns = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    # the default prefill backend on CUDA is the breakable one
    cfg = next(
        n
        for n in parse(sglang_src / "sglang/srt/model_executor/cuda_graph_config.py").body
        if isinstance(n, ast.FunctionDef) and n.name == "default_prefill_backend"
    )
    assert code(cfg.body[-1]).startswith("return Backend.BREAKABLE if is_cuda() else"), code(cfg)
    assert "self._is_full_backend = isinstance(self.backend, FullCudaGraphBackend)" in code(fns["__init__"])
    # the scheduler's replay goes through execute, whose static batch is load_batch's rebuilt one
    mr = code(class_def(sglang_src / "sglang/srt/model_executor/model_runner.py", "ModelRunner"))
    assert "self.prefill_cuda_graph_runner.execute(" in mr
    load = fns["load_batch"]
    built = [
        n
        for n in ast.walk(load)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "id", None) == "ForwardBatch"
    ]
    assert [code(t) for n in built for t in n.targets] == ["static_forward_batch"]
    assert code(load.body[-1]) in ("return static_forward_batch", "return (static_forward_batch, shared_read_ends)")
    execute = fns["execute"]
    assert any(
        code(n).startswith(
            (
                "static_forward_batch = self.load_batch(forward_batch",
                "static_forward_batch, shared_read_ends = self.load_batch(forward_batch",
            )
        )
        for n in ast.walk(execute)
        if isinstance(n, ast.Assign)
    ), code(execute)
    if version < (0, 5, 16):
        tail_fn = execute
        guard = next(
            n for n in ast.walk(execute) if isinstance(n, ast.If) and code(n.test) == "self.layer_model is not None"
        )
        assert any(_is_model_forward_call(n) for n in ast.walk(guard))
        init = code(fns["__init__"])
        sets = init.index("self.layer_model = language_model.model")
        assert "if isinstance(self.backend, (BreakableCudaGraphBackend, FullCudaGraphBackend)):" in init[:sets]
    else:
        tail_fn = fns["_execute_body_capture"]
        assert "Backend.BREAKABLE" in code(fns["_uses_eager_prefill_tail"])
        guard = next(
            n for n in ast.walk(execute) if isinstance(n, ast.If) and code(n.test) == "self._uses_eager_prefill_tail()"
        )
        calls = [code(n) for n in ast.walk(ast.Module(guard.body, [])) if isinstance(n, ast.Call)]
        assert any(c.startswith("self._execute_body_capture(forward_batch, static_forward_batch") for c in calls), calls
    # the tail: the model's forward on `tail_batch`, which is the static batch unless the backend is full
    tail_calls = [n for n in ast.walk(tail_fn) if _is_model_forward_call(n, "tail_batch")]
    assert len(tail_calls) == 1, code(tail_fn)
    body = code(tail_fn)
    assert "full_path = self._is_full_backend" in body
    assert "tail_batch = forward_batch if full_path else static_forward_batch" in body or any(
        code(n.test) == "full_path" and [code(x) for x in n.orelse] == ["tail_batch = static_forward_batch"]
        for n in ast.walk(tail_fn)
        if isinstance(n, ast.If)
    ), body
    # ... run while the body's forward is swapped for the graph replay, so only the body replays
    assert "self.layer_model.forward = replay_layer_forward" in body
    swap = body.index("self.layer_model.forward = replay_layer_forward")
    assert swap < body.index("self.model_runner.model.forward(")
    replay = next(n for n in ast.walk(tail_fn) if isinstance(n, ast.FunctionDef) and n.name == "replay_layer_forward")
    assert "self.backend.replay(" in code(replay)
    # ... eagerly: not under a graph-capture context, and not on a capture path
    parents = _parents(tail_fn)
    node = tail_calls[0]
    while node is not tail_fn:
        node = parents[node]
        if isinstance(node, ast.With):
            items = " ".join(code(i) for i in node.items)
            assert "capture" not in items and "cuda.graph" not in items, items
    for name, fn in fns.items():
        if "capture" in name and fn is not tail_fn:
            called = {code(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
            assert not called & {"self.execute", f"self.{tail_fn.name}"}, name


def test_layer_id_rules_run_from_sglangs_own_code(sglang_src):
    models = sglang_src / "sglang/srt/models"
    cfg = types.SimpleNamespace(num_hidden_layers=12)

    def build(path, cls):
        fns = load_methods(path, cls, ["set_eagle3_layers_to_capture"])
        return type(
            cls,
            (),
            {
                "__init__": lambda self: self.__dict__.update(
                    pp_group=types.SimpleNamespace(is_last_rank=True),
                    config=cfg,
                    model=types.SimpleNamespace(layers_to_capture=[]),
                ),
                **fns,
            },
        )

    Llama = build(models / "llama.py", "LlamaForCausalLM")
    Deepseek = build(models / "deepseek_v2.py", "DeepseekV2ForCausalLM")
    kimi_fns = load_methods(
        models / "kimi_k25.py", "KimiK25ForConditionalGeneration", ["model", "set_eagle3_layers_to_capture"]
    )
    assert isinstance(kimi_fns["model"], property), "Kimi-K2.5's .model is no longer a property"
    Kimi = type("Kimi", (), {"__init__": lambda self: setattr(self, "language_model", Deepseek()), **kimi_fns})

    def inner(m):
        return m.language_model.model if isinstance(m, Kimi) else m.model

    # the rules as plugin.apply_layer_ids documents them
    llama, ds = Llama(), Deepseek()
    llama.set_eagle3_layers_to_capture([1, 5, 8]), ds.set_eagle3_layers_to_capture([1, 5, 8])
    assert llama.model.layers_to_capture == [2, 6, 9] == ds.model.layers_to_capture
    llama.set_eagle3_layers_to_capture([2, 5, 8]), ds.set_eagle3_layers_to_capture([2, 5, 8])
    assert llama.model.layers_to_capture == [3, 6, 9] and ds.model.layers_to_capture == [2, 5, 8]
    # Kimi's .model is the language model, which has no layers_to_capture: read-back must go deeper
    assert not hasattr(Kimi().model, "layers_to_capture")
    # the plugin reaches the requested layers through each model's own code, or refuses
    for cls in (Llama, Deepseek, Kimi):
        for want in ([2, 6, 9], [3, 6, 9], [4, 7, 10]):
            m = cls()
            plugin.apply_layer_ids(m, want)
            assert inner(m).layers_to_capture == want, (cls.__name__, want)
            assert plugin.capture_owner(m) is inner(m)
    plugin.apply_layer_ids(Llama(), [1, 6, 9])
    for cls in (Deepseek, Kimi):
        with pytest.raises(plugin.PluginConfigError, match="first id >= 2"):
            plugin.apply_layer_ids(cls(), [1, 6, 9])


def test_semantics_the_plugin_relies_on(sglang_src):
    srt = sglang_src / "sglang/srt"
    # rids are the requests' ids, one per request, in batch order
    init_new = method(srt / "model_executor/forward_batch_info.py", "ForwardBatch", "init_new")
    assert "rids=[req.rid for req in batch.reqs]" in code(init_new)
    # a single /generate request keeps the rid the client chose (the plugin reads the length from it)
    single = code(method(srt / "managers/io_struct.py", "GenerateReqInput", "_normalize_single_inputs"))
    assert "if self.rid is None:" in single
    # plugins are loaded in the scheduler process, where the model runs
    assert "load_plugins()" in codes(srt / "managers/scheduler.py", ast.Call)
    # aux capture must be on before CUDA graphs are captured: the scheduler initialises the attention
    # backends (the plugin's BEFORE hook) before it captures the graphs
    body = code(method(srt / "managers/scheduler.py", "Scheduler", "init_model_worker"))
    assert body.index("self.init_all_attention_backends()") < body.index("self.init_all_cuda_graphs()")
    # a prefix match is capped by logprob_start_len (the `logprob` bypass)
    assert "max_prefix_len = min(max_prefix_len, self.logprob_start_len)" in codes(
        srt / "managers/schedule_batch.py", ast.Assign
    )
    # /server_info carries the schedulers' internal states (where the plugin reports itself)
    assert any("'internal_states': internal_states" in c for c in codes(srt / "entrypoints/http_server.py", ast.Dict))
    # a request flagged skip_radix_cache_insert is released without a radix-cache insert (the plugin's release
    # hook flags eyas requests): before 0.5.22 as cache_finished_req's is_insert, from it as the checkpoint
    release_kv = next(
        n for n in parse(srt / "mem_cache/common.py").body if getattr(n, "name", "") == "release_kv_cache"
    )
    honoured = (
        "is_insert=is_insert and (not getattr(req, 'skip_radix_cache_insert', False))",  # 0.5.15-0.5.20
        "is_insert = is_insert and (not req.skip_radix_cache_insert)",  # 0.5.21
        "checkpoint = checkpoint and (not req.skip_radix_cache_insert)",  # 0.5.22-
    )
    assert sum(h in code(release_kv) for h in honoured) == 1, code(release_kv)
    # and the flag is an attribute every request has (set False unless SGLang's disaggregation warm-up sets it)
    assert any("self.skip_radix_cache_insert" in c for c in codes(srt / "managers/schedule_batch.py", ast.Assign))
    if release(sglang_src) >= (0, 5, 22):
        # the `salt` bypass (the client uses it from 0.5.22): the radix tree is keyed by cache_salt
        assert "self.cache_salt != other.cache_salt" in codes(srt / "mem_cache/radix_cache.py", ast.Compare)


# ----------------------------------------------------------------------------- server args


# ServerArgs fields the plugin or the client read that older releases lack: (first release that has it, why
# reading it with a default is harmless before). The test checks each entry is exact, for every release.
NEWER_FIELDS = {
    "attn_dp_size": ("0.5.22", "before, DP attention is only --enable-dp-attention, which is read too"),
    "enable_return_aux_hidden_states": ("0.5.23", "before, there is no such flag to refuse"),
}
# keys of /server_info that are not ServerArgs fields: SGLang's handler adds them, or the plugin does
PLUGIN_INFO_KEYS = {"eyas_capture"}  # the plugin's status (plugin._on_internal_state, in internal_states[i])
# attributes of a ServerArgs object that are not fields: SGLang's resolution bookkeeping (0.5.19+), which
# plugin.server_arg reads; test_the_plugin_reads_server_args_as_sglang_resolves_them checks them
RESOLUTION_BOOKKEEPING = {"_raw_input", "_resolved_overrides"}


def names_read(
    fn: ast.FunctionDef, var: str, module: dict[str, ast.FunctionDef], _seen=None, _bound: dict[str, list] | None = None
) -> dict[str, bool]:
    """Names read off `var` in `fn`, each with whether every read has a default: getattr(var, "x"[, d]),
    var.x, var.get("x"[, d]) (always a default: None), var["x"]; a name looped over string constants
    (for flag in ("a", "b"): getattr(var, flag)) stands for each; same-module helpers called with `var`
    are followed, a parameter of theirs standing for the string constants (or the loop's) passed to it
    (server_arg(args, "x") reads x)."""
    _seen = {fn.name} if _seen is None else _seen | {fn.name}
    loops = {
        n.target.id: [e.value for e in n.iter.elts if isinstance(e, ast.Constant)]
        for n in ast.walk(fn)
        if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and isinstance(n.iter, (ast.Tuple, ast.List))
    }
    loops = {**(_bound or {}), **loops}
    parents = _parents(fn)
    out: dict[str, bool] = {}

    def add(key, defaulted: bool) -> None:
        keys = (
            [key]
            if isinstance(key, str)
            else [key.value]
            if isinstance(key, ast.Constant)
            else loops.get(getattr(key, "id", None), [])
        )
        assert keys, f"{fn.name}: cannot tell which name `{code(key)}` reads off {var}"
        for k in keys:
            out[k] = out.get(k, True) and defaulted

    def is_var(node) -> bool:
        return isinstance(node, ast.Name) and node.id == var

    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and n.args and is_var(n.args[0]):
            add(n.args[1], len(n.args) > 2)
        elif isinstance(n, ast.Attribute) and is_var(n.value):
            if isinstance(parents.get(n), ast.Call) and parents[n].func is n:  # a method: only dict.get is expected
                assert n.attr == "get", f"{fn.name}: {code(parents[n])}"
                add(parents[n].args[0], True)
            else:
                add(n.attr, False)
        elif isinstance(n, ast.Subscript) and is_var(n.value):
            add(n.slice, False)
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) in module and n.func.id not in _seen:
            callee = module[n.func.id]
            params = [a.arg for a in callee.args.posonlyargs + callee.args.args]
            passed = list(zip(params, n.args)) + [(k.arg, k.value) for k in n.keywords]
            bound = {
                p: [a.value] if isinstance(a, ast.Constant) else loops[a.id]
                for p, a in passed
                if (isinstance(a, ast.Constant) and isinstance(a.value, str)) or getattr(a, "id", None) in loops
            }
            for i, a in enumerate(n.args):
                if is_var(a):
                    for k, d in names_read(callee, params[i], module, _seen, bound).items():
                        add(k, d)
    return out


def module_functions(mod) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in parse(Path(mod.__file__)).body if isinstance(n, ast.FunctionDef)}


def server_args_fields(srt: Path) -> set[str]:
    """ServerArgs's fields, read from the wheel: a dataclass in server_args.py up to 0.5.19; from 0.5.20 a
    msgspec struct assembled from the namespaces `_INPUT_NAMESPACES` lists (classes in arg_groups/fields/)."""
    tree = parse(srt / "server_args.py")
    imports = {
        a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module for a in n.names
    }

    def annotated(cls: ast.ClassDef) -> set[str]:
        return {
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and "ClassVar" not in code(n.annotation)
        }

    fields = annotated(class_def(srt / "server_args.py", "ServerArgs"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets):
            for e in node.value.elts:
                path = srt.parent.parent.joinpath(*imports[e.id].split(".")).with_suffix(".py")
                fields |= annotated(class_def(path, e.id))
    return fields


def test_the_server_args_the_plugin_and_the_client_read_exist(sglang_src):
    from eyas.sglang import server

    srt = sglang_src / "sglang/srt"
    version = release(sglang_src)
    fields = server_args_fields(srt)
    assert {"tp_size", "pp_size", "disable_radix_cache"} <= fields, "ServerArgs not found where it was"
    # the plugin's start-up check, on the ServerArgs object
    plugin_fns = module_functions(plugin)
    plugin_reads = names_read(plugin_fns["check_server_args"], "args", plugin_fns)
    assert {k for k in plugin_reads if k.startswith("_")} == RESOLUTION_BOOKKEEPING
    plugin_reads = {k: d for k, d in plugin_reads.items() if k not in RESOLUTION_BOOKKEEPING}
    # the client's preflight, on /server_info: ServerArgs's fields plus what the handler adds itself
    server_fns = module_functions(server)
    client_reads = names_read(server_fns["preflight"], "info", server_fns)
    handler = next(
        n
        for n in parse(srt / "entrypoints/http_server.py").body
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "server_info"
    )
    dicts = [n for n in ast.walk(handler) if isinstance(n, ast.Dict)]
    assert any(
        any(
            s in code(d)
            for s in ("dataclasses.asdict(server_args)", "server_args.resolved_dict()", "build_server_info(server_args")
        )
        for d in dicts
    ), code(handler)
    handler_keys = {k.value for d in dicts for k in d.keys if isinstance(k, ast.Constant)}
    assert {"internal_states", "version"} <= handler_keys
    client_fields = {k: d for k, d in client_reads.items() if k not in handler_keys | PLUGIN_INFO_KEYS}
    assert {"speculative_algorithm", "enable_dp_attention", "enable_prefill_cp", "cuda_graph_config"} <= set(
        plugin_reads
    ) & set(client_fields)
    for who, reads in (("plugin.check_server_args", plugin_reads), ("server.preflight", client_fields)):
        for name, defaulted in sorted(reads.items()):
            if name in NEWER_FIELDS:
                since = NEWER_FIELDS[name][0]
                assert (name in fields) == (version >= _vkey(since)), f"NEWER_FIELDS[{name!r}]: since {since}?"
                assert defaulted, f"{who} reads {name} without a default, but releases before {since} lack it"
            else:
                assert name in fields, f"{who} reads ServerArgs.{name}, which this release does not have"
    # the prefill-graph backend the plugin refuses, read through cuda_graph_config.prefill.backend
    refused = [
        c.comparators[0].value
        for c in ast.walk(plugin_fns["check_server_args"])
        if isinstance(c, ast.Compare) and code(c.left) == "_prefill_graph_backend(args)"
    ]
    cgc = sglang_src / "sglang/srt/model_executor/cuda_graph_config.py"
    backends = {
        n.targets[0].id: n.value.value
        for n in class_def(cgc, "Backend").body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
    }
    assert refused == ["tc_piecewise"] and backends["TC_PIECEWISE"] == "tc_piecewise"
    assert {"prefill", "decode"} <= {
        n.target.id for n in class_def(cgc, "CudaGraphConfig").body if isinstance(n, ast.AnnAssign)
    }
    assert "backend" in {n.target.id for n in class_def(cgc, "PhaseConfig").body if isinstance(n, ast.AnnAssign)}


def top_function(path: Path, name: str) -> ast.FunctionDef:
    for node in parse(path).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not in {path}")


def test_the_plugin_reads_server_args_as_sglang_resolves_them(sglang_src):
    """plugin.server_arg: up to 0.5.18 ServerArgs's resolution ends by applying its declarations to the
    fields (materialize_declarations), so the fields are the result; from 0.5.19 the resolution pipeline keeps
    the raw input (`_raw_input`) and the declarations apply only where SGLang reads through
    resolution_result, which the plugin must agree with (run here from the release's own source)."""
    srt = sglang_src / "sglang/srt"
    overrides = srt / "arg_groups/overrides.py"
    if release(sglang_src) < (0, 5, 19):
        assert "materialize_declarations(self)" in codes(srt / "server_args.py", ast.Call)
        assert not any("_raw_input" in c for c in codes(srt / "server_args.py", ast.Assign))
        # a record of these releases carries its declarations too, already applied: the fields decide
        rec = types.SimpleNamespace(enable_prefill_cp=True, _resolved_overrides=[("x", {"enable_prefill_cp": False})])
        assert plugin.server_arg(rec, "enable_prefill_cp") is True
        return
    pipeline = code(top_function(srt / "arg_groups/pipeline.py", "run_resolution_pipeline"))
    assert "server_args._raw_input = {" in pipeline and "server_args._resolved_overrides = list(" in pipeline
    ns = {"Any": object, "with_fallback": lambda cls, name, value: value}  # declared fallbacks: None only
    exec(compile(ast.Module([top_function(overrides, "resolution_result")], []), str(overrides), "exec"), ns)
    resolution_result = ns["resolution_result"]
    rec = types.SimpleNamespace(
        enable_prefill_cp=False,
        attn_cp_size=1,
        cuda_graph_config=None,
        pp_size=1,
        _raw_input={"enable_prefill_cp": False, "attn_cp_size": 1, "cuda_graph_config": None, "pp_size": 1},
        _resolved_overrides=[
            ("_handle_legacy_cp_arguments", {"enable_prefill_cp": True}),
            ("a", {"attn_cp_size": 2}),
            ("b", {"attn_cp_size": 4}),
            ("_parse_cuda_graph_config", {"cuda_graph_config": "resolved"}),
        ],
    )
    for name in ("enable_prefill_cp", "attn_cp_size", "cuda_graph_config", "pp_size", "tp_size"):
        assert plugin.server_arg(rec, name, 8) == resolution_result(rec, name, 8), name
    # what the fields alone would have let through
    with pytest.raises(plugin.PluginConfigError, match="--enable-prefill-cp"):
        plugin.check_server_args(rec)


def test_prefill_cp_and_its_older_spellings_end_in_enable_prefill_cp(sglang_src):
    # --enable-prefill-context-parallel / --enable-nsa-prefill-context-parallel (up to 0.5.19) turn
    # enable_prefill_cp on, as a field (<= 0.5.18) or a declaration (0.5.19): reading it covers them
    srt = sglang_src / "sglang/srt"
    fields = server_args_fields(srt)
    assert "enable_prefill_cp" in fields
    if "enable_prefill_context_parallel" not in fields:
        assert release(sglang_src) >= (0, 5, 20)
        return
    if release(sglang_src) < (0, 5, 19):
        handler = code(method(srt / "server_args.py", "ServerArgs", "_handle_legacy_cp_arguments"))
        assert "self.enable_prefill_cp = True" in handler, handler
    else:
        handler = code(top_function(srt / "arg_groups/parallel_hook.py", "handle_legacy_cp_arguments"))
        assert "enable_prefill_cp=True" in handler, handler
    assert "enable_prefill_context_parallel or" in handler


def load_cuda_graph_config(sglang_src: Path, monkeypatch, *, cuda: bool) -> types.ModuleType:
    """The release's cuda_graph_config module, on a platform that is CUDA or not (its is_cuda patched)."""
    name = "sglang.srt.model_executor.cuda_graph_config"
    fakes = {
        n: types.ModuleType(n)
        for n in ("sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.utils", "sglang.srt.runtime_context")
    }
    fakes["sglang.srt.utils"].is_cuda = lambda: cuda
    fakes["sglang.srt.runtime_context"].get_exec = lambda: None
    for n, m in fakes.items():
        monkeypatch.setitem(sys.modules, n, m)
    spec = importlib.util.spec_from_file_location(name, sglang_src / "sglang/srt/model_executor/cuda_graph_config.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    fakes["sglang.srt.model_executor"].cuda_graph_config = mod
    return mod


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "not-cuda"])
def test_the_prefill_graph_default_is_read_per_platform(sglang_src, monkeypatch, cuda):
    """Off CUDA, 0.5.15-0.5.21 default the prefill graph to tc_piecewise (0.5.22+: disabled; CUDA:
    breakable). The plugin refuses exactly when the resolved backend is tc_piecewise: from the field
    (<= 0.5.18), from the declaration (0.5.19+, where the raw field stays None), and, for args with
    no config at all, from SGLang's own default_prefill_backend."""
    srt = sglang_src / "sglang/srt"
    version = release(sglang_src)
    mod = load_cuda_graph_config(sglang_src, monkeypatch, cuda=cuda)
    cfg = mod.default_cuda_graph_config()
    want = "breakable" if cuda else "tc_piecewise" if version < (0, 5, 22) else "disabled"
    assert cfg.prefill.backend == want
    # how the release keeps the resolved config on the ServerArgs the plugin is handed
    if version < (0, 5, 19):
        parse_fn = code(method(srt / "server_args.py", "ServerArgs", "_parse_cuda_graph_config"))
        assert "self.cuda_graph_config = config" in parse_fn
        rec = types.SimpleNamespace(cuda_graph_config=cfg, cuda_graph_backend_prefill=None)
    else:
        parse_fn = code(top_function(srt / "arg_groups/cuda_graph_hook.py", "parse_cuda_graph_config"))
        assert "cuda_graph_config=config" in parse_fn and "declare_resolution(" in parse_fn
        rec = types.SimpleNamespace(
            cuda_graph_config=None,
            cuda_graph_backend_prefill=None,
            _raw_input={"cuda_graph_config": None, "cuda_graph_backend_prefill": None},
            _resolved_overrides=[("_parse_cuda_graph_config", {"cuda_graph_config": cfg})],
        )
    bare = types.SimpleNamespace()  # no config, no flag: the plugin asks SGLang's default_prefill_backend
    for args in (rec, bare):
        assert plugin._prefill_graph_backend(args) == want
        if want == "tc_piecewise":
            with pytest.raises(plugin.PluginConfigError, match="tc_piecewise.*--disable-prefill-cuda-graph"):
                plugin.check_server_args(args)
        else:
            plugin.check_server_args(args)
    if version < (0, 5, 22):
        # the compatibility cascade (an explicit backend skips it) turns the default off on HIP/NPU/CPU/
        # MPS/XPU: a server there runs without the prefill graph unless tc_piecewise is asked for
        hook = srt / ("server_args.py" if version < (0, 5, 19) else "arg_groups/cuda_graph_hook.py")
        assert "non-CUDA hardware (HIP/NPU/CPU/MPS/XPU)" in {
            c.value for c in ast.walk(parse(hook)) if isinstance(c, ast.Constant)
        }
        # SGLang's runner builds tc_piecewise for any backend but breakable and full
        assert mod.Backend.TC_PIECEWISE in mod.Backend.ALL


def test_names_read_follows_the_code():
    # the walk that feeds the test above, on a function shaped like the plugin's and the client's
    src = """
def check(args, info):
    if getattr(args, "a", None) or args.b:
        print(args.h)
    for flag in ("c", "d"):
        getattr(args, flag, False)
    helper(args)
    info.get("e")
    info["f"]
    read(args, "i")
    for key in ("j", "k"):
        read(args, key, False)

def helper(x):
    return getattr(x, "g")

def read(x, name, default=None):
    return getattr(x, "_book", None) or getattr(x, name, default)
"""
    fns = {n.name: n for n in ast.parse(src).body}
    want = {
        "a": True,
        "b": False,
        "c": True,
        "d": True,
        "g": False,
        "h": False,
        "_book": True,
        "i": True,
        "j": True,
        "k": True,
    }
    assert names_read(fns["check"], "args", fns) == want
    assert names_read(fns["check"], "info", fns) == {"e": True, "f": False}


def test_a_claimed_version_missing_from_the_index_fails_and_an_unreachable_index_skips():
    missing = (
        "ERROR: Could not find a version that satisfies the requirement sglang==0.5.99 (from versions: "
        "0.5.22, 0.5.23)\nERROR: No matching distribution found for sglang==0.5.99"
    )
    offline = (
        "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after "
        "connection broken by 'NewConnectionError('<HTTPConnection object>: Failed to establish a new "
        "connection: [Errno 111] Connection refused')': /simple/sglang/\nERROR: Could not find a version that "
        "satisfies the requirement sglang==0.5.23 (from versions: none)\nERROR: No matching distribution "
        "found for sglang==0.5.23"
    )
    skip, why = download_failure("0.5.99", missing)
    assert not skip and "claimed in plugin.SUPPORTED_VERSIONS" in why
    assert download_failure("0.5.23", offline)[0]
    assert not download_failure("0.5.23", "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES")[0]


# ----------------------------------------------------------------------------- the real hook registry


def test_plugin_hooks_through_the_real_hook_registry(sglang_src, monkeypatch, tmp_path):
    """register_hooks on SGLang's HookRegistry, targets at the real dotted paths (fake modules
    there); then the order a server runs them in: init, forward through a graph-replay batch
    without rids, status. Breaks if a hook is missing, disabled, or blind to the request ids."""
    spec = importlib.util.spec_from_file_location(
        "eyas_test_hook_registry", sglang_src / "sglang/srt/plugins/hook_registry.py"
    )
    hr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hr)
    A, H = 3, 8
    g = torch.Generator().manual_seed(0)

    class Inner:
        layers_to_capture: list = []

    class Model:
        config = types.SimpleNamespace(num_hidden_layers=8, hidden_size=H, vocab_size=50)

        def __init__(self):
            self.model = Inner()

        def set_eagle3_layers_to_capture(self, layer_ids=None):
            self.model.layers_to_capture = [v + 1 for v in layer_ids]

    class LogitsProcessor:
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return ("logits", hidden_states.shape[0])

    class ModelRunner:
        is_draft_worker = False
        server_args = types.SimpleNamespace(speculative_algorithm=None)

        def __init__(self):
            self.model = Model()

        def init_attention_backends(self):
            return "backends"

        def forward(self, forward_batch, pp_proxy_tensors=None):
            # the prefill CUDA-graph path: the tail gets the rebuilt batch, rows padded to the bucket
            fb = replay_batch(forward_batch, bucket=8)
            T = fb.input_ids.shape[0]
            self.hidden, self.aux = torch.randn(T, H, generator=g), torch.randn(T, A * H, generator=g)
            return LogitsProcessor().forward(fb.input_ids, self.hidden, None, fb, aux_hidden_states=self.aux)

    class Controller:
        def get_internal_state(self, recv_req):
            return types.SimpleNamespace(internal_state={"tp_size": 1})

    class Req:  # SGLang's rule: at most L-1 (and at most logprob_start_len with return_logprob)
        def __init__(self, rid):
            self.rid = rid
            self.skip_radix_cache_insert = False

        def _compute_max_prefix_len(self, input_len: int) -> int:
            return max(input_len - 1, 0)

    inserted = []

    def release_kv_cache(req, tree_cache, is_insert=True):  # SGLang's: no insert for a request flagged to skip it
        inserted.append((req.rid, is_insert and not req.skip_radix_cache_insert))

    mods = {}
    for name in (
        "sglang",
        "sglang.srt",
        "sglang.srt.model_executor",
        "sglang.srt.layers",
        "sglang.srt.managers",
        "sglang.srt.managers.scheduler_components",
        "sglang.srt.mem_cache",
    ):
        mods[name] = types.ModuleType(name)
    for key, obj in (("live_batch", ModelRunner), ("logits", LogitsProcessor), ("prefix_cap", Req)):
        mod = plugin.CONTRACT["hooks"][key][0]
        mods.setdefault(mod, types.ModuleType(mod))
        setattr(mods[mod], obj.__name__, obj)
    release_mod = plugin.CONTRACT["hooks"]["release"][0]
    mods[release_mod] = types.ModuleType(release_mod)
    mods[release_mod].release_kv_cache = release_kv_cache
    scheduler = types.ModuleType("sglang.srt.managers.scheduler")  # imports it by name, as SGLang's scheduler does
    scheduler.release_kv_cache = release_kv_cache
    mods["sglang.srt.managers.scheduler"] = scheduler
    status_mod, status_qual, _ = plugin.CONTRACT["status_hooks"][0]
    mods[status_mod] = types.ModuleType(status_mod)
    setattr(mods[status_mod], status_qual.split(".")[0], Controller)
    mods["sglang.srt.runtime_context"] = rc = types.ModuleType("sglang.srt.runtime_context")
    rc.get_parallel = lambda: types.SimpleNamespace(attn_tp_rank=0, pp_rank=0, pp_size=1)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name, mod in mods.items():  # parents expose their children, as real packages do
        parent, _, child = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, mod)

    st = plugin._State(plugin.PluginConfig(layer_ids=[2, 4, 5], dump_dir=str(tmp_path)))
    st.logits_sig = plugin.inspect.signature(LogitsProcessor.forward)
    monkeypatch.setattr(plugin, "_STATE", st)
    hr.HookRegistry.reset()
    try:
        targets = plugin.register_hooks(hr.HookRegistry, hr.HookType, status_target=(status_mod, status_qual))
        hr.HookRegistry.apply_hooks()
        assert set(targets) <= hr.HookRegistry._patched and len(targets) == 6
        # the radix-cache match of an eyas request is capped at 0; any other request keeps SGLang's cap
        assert Req(make_rid(9, "cap"))._compute_max_prefix_len(9) == 0 and Req("x")._compute_max_prefix_len(9) == 8
        assert st.counts["prefix_caps"] == 1  # what the client's probe reads to know the cap is in effect
        # a finished eyas request is released without a radix-cache insert, through the scheduler's own binding
        # too; any other request is inserted as SGLang does
        scheduler.release_kv_cache(Req(make_rid(9, "rel")), None)
        mods[release_mod].release_kv_cache(Req("x"), None)
        assert inserted == [(make_rid(9, "rel"), False), ("x", True)] and st.counts["insert_skips"] == 1
        runner = ModelRunner()
        assert runner.init_attention_backends() == "backends"  # BEFORE hook ran, original still runs
        assert st.enabled and runner.model.model.layers_to_capture == [2, 4, 5]
        rid = make_rid(5, "hr")
        live = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=2,
            input_ids=torch.arange(100, 108),
            positions=torch.cat([torch.arange(5), torch.arange(3)]),
            rids=[rid, "other"],
            extend_prefix_lens_cpu=[0, 0],
            extend_seq_lens_cpu=[5, 3],
        )
        assert runner.forward(live) == ("logits", 8)  # BEFORE hooks leave the arguments alone
        st.writer.flush()
        d = read_dump(tmp_path / rid)
        assert d.status == "complete" and d.input_ids_L.tolist() == [100, 101, 102, 103, 104]
        torch.testing.assert_close(d.aux_LAD.float(), runner.aux[:5].view(5, A, H), rtol=0, atol=0)
        torch.testing.assert_close(d.final_LD.float(), runner.hidden[:5], rtol=0, atol=0)
        state = Controller().get_internal_state(None).internal_state
        assert state["tp_size"] == 1 and state["eyas_capture"]["layer_ids"] == [2, 4, 5]
        assert state["eyas_capture"]["stats"]["rids_from_live_batch"] == 1
    finally:
        hr.HookRegistry.reset()


# ----------------------------------------------------------------------------- newer releases


def test_the_newest_release_on_the_index_passes_the_contract():
    """A release newer than SUPPORTED_VERSIONS is checked too: a failure names what it lacks; a pass
    says to add it to the list (after reading its graph-replay path)."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True, text=True, timeout=120
    )
    if res.returncode != 0:
        if any(e in res.stderr + res.stdout for e in NETWORK_ERRORS):
            pytest.skip(f"package index unreachable: {res.stderr.strip()[-200:]}")
        pytest.skip(f"`pip index versions` is not available: {res.stderr.strip()[-200:]}")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("Available versions:")), "")
    versions = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()]
    newest = max(
        (v for v in versions if v.startswith("0.5.") and v.replace(".post", ".").replace(".", "").isdigit()),
        key=_vkey,
        default=None,
    )
    assert newest is not None, f"no 0.5.x release in `pip index versions sglang`: {res.stdout[:300]}"
    if newest in plugin.SUPPORTED_VERSIONS:
        return
    problems = plugin.check_contract_in_source(sglang_source(newest))
    assert problems == [], f"sglang {newest} breaks the plugin's contract: {problems}"
    pytest.fail(
        f"sglang {newest} passes the contract check but is not in plugin.SUPPORTED_VERSIONS: read its "
        "prefill CUDA-graph path, then add it"
    )


def test_the_wheels_are_cached_under_the_eyas_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("EYAS_SGLANG_WHEEL_DIR", raising=False)
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" / "sglang-wheels" and cache_dir().is_dir()
