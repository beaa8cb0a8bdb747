"""Contract tests: every SGLang release the plugin claims still has what the plugin relies on.

For each version in plugin.SUPPORTED_VERSIONS (and the newest 0.5.x on the package index), the
cp311 manylinux wheel is fetched with `pip download --no-deps` (whatever Python runs the test),
and the few source files the plugin depends on are unpacked and read WITHOUT importing SGLang (CI
has no GPU nor SGLang's dependencies). Checks look at code, not comments: names and signatures by
AST, and the rules the plugin depends on by running SGLang's own functions, pulled out of its
source (the layer-id rules of Llama, DeepSeek-V2/V3 and the Kimi-K2.5 wrapper), or by reading
`ast.unparse` output, which has no comments. The hook registry module is standard-library only,
so the real one is loaded and the plugin's real hook functions are registered and run through it.

Wheels and unpacked files are cached in $EYAS_SGLANG_WHEEL_DIR (default ~/.cache/eyas/sglang-wheels):
the first run downloads about 250 MB, later runs read the cache (a few seconds in all). A version
whose download fails for network reasons is skipped with the reason; any other failure fails.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from eyas.sglang import plugin
from eyas.sglang.core import make_rid, read_dump
from eyas.sglang.standin import ForwardBatch, ForwardMode, replay_batch

NETWORK_ERRORS = ("NewConnectionError", "ConnectionError", "Temporary failure in name resolution", "Max retries",
                  "timed out", "Network is unreachable", "ProxyError", "Connection refused", "No matching distribution")
# the files read below, relative to the wheel root (prefixes: a package's whole folder)
NEEDED = ("sglang/srt/plugins/", "sglang/srt/model_executor/model_runner.py", "sglang/srt/layers/logits_processor.py",
          "sglang/srt/managers/scheduler_components/internal_state", "sglang/srt/managers/scheduler.py",
          "sglang/srt/model_executor/forward_batch_info.py", "sglang/srt/runtime_context",
          "sglang/srt/models/llama.py", "sglang/srt/models/deepseek_v2.py", "sglang/srt/models/kimi_k25.py",
          "sglang/srt/managers/io_struct.py", "sglang/srt/managers/schedule_batch.py",
          "sglang/srt/mem_cache/radix_cache.py", "sglang/srt/entrypoints/http_server.py",
          "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py")


def cache_dir() -> Path:
    d = Path(os.environ.get("EYAS_SGLANG_WHEEL_DIR") or Path.home() / ".cache/eyas/sglang-wheels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _vkey(v: str) -> tuple:
    base, _, post = v.partition(".post")
    return tuple(int(x) for x in base.split(".")) + (int(post or 0),)


def sglang_source(version: str) -> Path:
    """The unpacked files of sglang==version (downloaded once, then cached)."""
    cache = cache_dir()
    src = cache / f"src-{version}"
    if (src / ".done").is_file():
        return src
    wheels = [w for w in cache.glob(f"sglang-{version}-*.whl")]
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
               "--platform", "manylinux_2_34_x86_64", f"sglang=={version}", "-d", str(cache), "-q"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            if any(e in res.stderr + res.stdout for e in NETWORK_ERRORS):
                pytest.skip(f"cannot download sglang=={version} (package index unreachable): {res.stderr.strip()[-300:]}")
            pytest.fail(f"pip download sglang=={version} failed:\n{res.stderr[-2000:]}")
        wheels = list(cache.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(src, [n for n in z.namelist() if n.endswith(".py") and n.startswith(NEEDED)])
    assert (src / "sglang/srt/plugins/hook_registry.py").is_file(), f"{wheels[0]} has no sglang/srt/plugins"
    (src / ".done").write_text(version)
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
    ns = {"Optional": Optional, "List": List}
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
    fn = next(n for n in class_def(lp, "LogitsProcessor").body if isinstance(n, ast.FunctionDef) and n.name == "forward")
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
    live = ForwardBatch(forward_mode=ForwardMode.MIXED, batch_size=1, input_ids=torch.arange(3), positions=torch.arange(3),
                        extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[3], rids=["r"])
    rb = replay_batch(live, bucket=8)
    assert rb.extend_seq_lens_cpu is live.extend_seq_lens_cpu and rb.forward_mode == ForwardMode.EXTEND
    assert (rb.rids is None) == ("rids" not in kw)
    # and ModelRunner.forward, which the plugin hooks for the live batch, receives the scheduler's batch
    mr = method(sglang_src / "sglang/srt/model_executor/model_runner.py", "ModelRunner", "forward")
    assert [a.arg for a in mr.args.args[:2]] == ["self", "forward_batch"]


def test_layer_id_rules_run_from_sglangs_own_code(sglang_src):
    models = sglang_src / "sglang/srt/models"
    cfg = types.SimpleNamespace(num_hidden_layers=12)

    def build(path, cls):
        fns = load_methods(path, cls, ["set_eagle3_layers_to_capture"])
        return type(cls, (), {"__init__": lambda self: self.__dict__.update(
            pp_group=types.SimpleNamespace(is_last_rank=True), config=cfg,
            model=types.SimpleNamespace(layers_to_capture=[])), **fns})

    Llama = build(models / "llama.py", "LlamaForCausalLM")
    Deepseek = build(models / "deepseek_v2.py", "DeepseekV2ForCausalLM")
    kimi_fns = load_methods(models / "kimi_k25.py", "KimiK25ForConditionalGeneration", ["model", "set_eagle3_layers_to_capture"])
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
    assert "max_prefix_len = min(max_prefix_len, self.logprob_start_len)" in codes(srt / "managers/schedule_batch.py", ast.Assign)
    # /server_info carries the schedulers' internal states (where the plugin reports itself)
    assert any("'internal_states': internal_states" in c for c in codes(srt / "entrypoints/http_server.py", ast.Dict))
    if _vkey(sglang_src.name.removeprefix("src-")) >= (0, 5, 22):
        # the `salt` bypass (the client uses it from 0.5.22): the radix tree is keyed by cache_salt
        assert "self.cache_salt != other.cache_salt" in codes(srt / "mem_cache/radix_cache.py", ast.Compare)


# ----------------------------------------------------------------------------- the real hook registry


def test_plugin_hooks_through_the_real_hook_registry(sglang_src, monkeypatch, tmp_path):
    """register_hooks on SGLang's HookRegistry, targets at the real dotted paths (fake modules
    there); then the order a server runs them in: init, forward through a graph-replay batch
    without rids, status. Breaks if a hook is missing, disabled, or blind to the request ids."""
    spec = importlib.util.spec_from_file_location("eyas_test_hook_registry", sglang_src / "sglang/srt/plugins/hook_registry.py")
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

    mods = {}
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.layers", "sglang.srt.managers",
                 "sglang.srt.managers.scheduler_components"):
        mods[name] = types.ModuleType(name)
    for key, obj in (("live_batch", ModelRunner), ("logits", LogitsProcessor)):
        mod = plugin.CONTRACT["hooks"][key][0]
        mods.setdefault(mod, types.ModuleType(mod))
        setattr(mods[mod], obj.__name__, obj)
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
        assert set(targets) <= hr.HookRegistry._patched and len(targets) == 4
        runner = ModelRunner()
        assert runner.init_attention_backends() == "backends"  # BEFORE hook ran, original still runs
        assert st.enabled and runner.model.model.layers_to_capture == [2, 4, 5]
        rid = make_rid(5, "hr")
        live = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.arange(100, 108),
                            positions=torch.cat([torch.arange(5), torch.arange(3)]), rids=[rid, "other"],
                            extend_prefix_lens_cpu=[0, 0], extend_seq_lens_cpu=[5, 3])
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
    res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0:
        if any(e in res.stderr + res.stdout for e in NETWORK_ERRORS):
            pytest.skip(f"package index unreachable: {res.stderr.strip()[-200:]}")
        pytest.skip(f"`pip index versions` is not available: {res.stderr.strip()[-200:]}")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("Available versions:")), "")
    versions = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()]
    newest = max((v for v in versions if v.startswith("0.5.") and v.replace(".post", ".").replace(".", "").isdigit()),
                 key=_vkey, default=None)
    assert newest is not None, f"no 0.5.x release in `pip index versions sglang`: {res.stdout[:300]}"
    if newest in plugin.SUPPORTED_VERSIONS:
        return
    problems = plugin.check_contract_in_source(sglang_source(newest))
    assert problems == [], f"sglang {newest} breaks the plugin's contract: {problems}"
    pytest.fail(f"sglang {newest} passes the contract check but is not in plugin.SUPPORTED_VERSIONS: read its "
                "prefill CUDA-graph path, then add it")
