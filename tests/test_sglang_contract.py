"""Contract test: the pinned SGLang wheel still has every hook point and field the plugin uses.

Downloads sglang==PINNED_SGLANG with `pip download --no-deps` (cp311 manylinux wheel, fetched for
that platform whatever Python runs the test), reads its source without importing SGLang (CI has no
GPU nor SGLang's dependencies), and checks plugin.CONTRACT against it. The hook registry module is
standard-library only, so the real one is loaded and the plugin's hooks are run through it.
Set EYAS_SGLANG_WHEEL=/path/to/sglang-*.whl to use a wheel already on disk. Skips only when the
download fails for network reasons.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from eyas.sglang import plugin

NETWORK_ERRORS = ("NewConnectionError", "ConnectionError", "Temporary failure in name resolution", "Max retries",
                  "timed out", "Network is unreachable", "ProxyError", "Connection refused")


@pytest.fixture(scope="module")
def sglang_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sglang_wheel")
    wheel = os.environ.get("EYAS_SGLANG_WHEEL")
    if not wheel:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
               "--platform", "manylinux_2_34_x86_64", f"sglang=={plugin.PINNED_SGLANG}", "-d", str(root), "-q"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            if any(e in res.stderr + res.stdout for e in NETWORK_ERRORS):
                pytest.skip(f"cannot download sglang=={plugin.PINNED_SGLANG} (network): {res.stderr.strip()[-300:]}")
            pytest.fail(f"pip download sglang=={plugin.PINNED_SGLANG} failed:\n{res.stderr[-2000:]}")
        wheel = next(root.glob("sglang-*.whl"))
    src = root / "src"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(src, [n for n in z.namelist() if n.startswith("sglang/srt/") and n.endswith(".py")])
    assert (src / "sglang/srt/plugins/hook_registry.py").is_file(), f"{wheel} has no sglang/srt/plugins"
    return src


def test_every_hook_point_and_field_exists(sglang_src):
    assert plugin.check_contract_in_source(sglang_src) == []


def test_contract_check_would_catch_a_missing_field(sglang_src, tmp_path):
    # The check can fail: drop `rids` from a copy of ForwardBatch and rename the logits hook's parameter.
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(sglang_src, copy)
    fbi = copy / "sglang/srt/model_executor/forward_batch_info.py"
    fbi.write_text(fbi.read_text().replace("    rids: Optional[List[str]] = None", "    request_ids: Optional[List[str]] = None"))
    lp = copy / "sglang/srt/layers/logits_processor.py"
    lp.write_text(lp.read_text().replace("aux_hidden_states: Optional[AuxHiddenStates] = None,\n        hidden_states_before_norm",
                                         "aux_states: Optional[AuxHiddenStates] = None,\n        hidden_states_before_norm"))
    problems = plugin.check_contract_in_source(copy)
    assert any("ForwardBatch.rids" in p for p in problems)
    assert any("LogitsProcessor.forward" in p and "aux_hidden_states" in p for p in problems)


def test_semantics_the_plugin_relies_on(sglang_src):
    srt = sglang_src / "sglang/srt"
    llama = (srt / "models/llama.py").read_text()
    # SGLang's EAGLE-3 ids are outputs of layer k: it captures before layer k + 1 (eyas id = k + 1)
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in llama
    # the final norm runs before the logits processor, which gets every row and the aux states
    assert "residual_batch.final_norm(" in llama and "aux_hidden_states,\n                )" in llama
    # a single /generate request keeps the rid the client chose (the plugin reads the length from it)
    io = (srt / "managers/io_struct.py").read_text()
    single = io[io.index("def _normalize_single_inputs"):][:1500]
    assert "if self.rid is None:" in single and "cache_salt: Optional[Union[List[str], str]] = None" in io
    # rids are the requests' ids, one per request, in batch order
    assert "rids=[req.rid for req in batch.reqs]" in (srt / "model_executor/forward_batch_info.py").read_text()
    # plugins are loaded in the scheduler process, where the model runs
    assert "load_plugins()" in (srt / "managers/scheduler.py").read_text()
    # aux capture must be on before CUDA graphs are captured: init_attention_backends runs first
    assert "Must be called BEFORE init_decode_cuda_graph()" in (srt / "model_executor/model_runner.py").read_text()
    # a prefix match is capped by logprob_start_len (the `logprob` bypass) and keyed by cache_salt (`salt`)
    sb = (srt / "managers/schedule_batch.py").read_text()
    assert "max_prefix_len = min(max_prefix_len, self.logprob_start_len)" in sb
    assert "self.cache_salt != other.cache_salt" in (srt / "mem_cache/radix_cache.py").read_text()
    # /server_info carries the schedulers' internal states (where the plugin reports itself)
    assert '"internal_states": internal_states' in (srt / "entrypoints/http_server.py").read_text()


def test_plugin_hooks_through_the_real_hook_registry(sglang_src, monkeypatch):
    spec = importlib.util.spec_from_file_location("eyas_test_hook_registry", sglang_src / "sglang/srt/plugins/hook_registry.py")
    hr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hr)

    class LogitsProcessor:
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return ("logits", input_ids, aux_hidden_states)

    class Controller:
        def get_internal_state(self, recv_req):
            return types.SimpleNamespace(internal_state={"tp_size": 1})

    mod = types.ModuleType("eyas_test_fake_sglang")
    mod.LogitsProcessor, mod.Controller = LogitsProcessor, Controller
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    st = plugin._State(plugin.PluginConfig(layer_ids=[2, 3, 4], dump_dir="/nonexistent"))
    st.layer_ids = [2, 3, 4]
    monkeypatch.setattr(plugin, "_STATE", st)
    hr.HookRegistry.reset()
    try:
        hr.HookRegistry.register(f"{mod.__name__}.LogitsProcessor.forward", plugin._on_logits, hr.HookType.BEFORE)
        hr.HookRegistry.register(f"{mod.__name__}.Controller.get_internal_state", plugin._on_internal_state, hr.HookType.AFTER)
        hr.HookRegistry.apply_hooks()
        # BEFORE: called with the processor first; returning None leaves the forward's arguments alone
        assert LogitsProcessor().forward("ids", "h", None, "fb", aux_hidden_states="aux") == ("logits", "ids", "aux")
        # AFTER: the status lands in internal_states
        state = Controller().get_internal_state(None).internal_state
        assert state["tp_size"] == 1 and state["eyas_capture"]["layer_ids"] == [2, 3, 4]
        assert state["eyas_capture"]["sglang_layer_ids"] == [1, 2, 3]
    finally:
        hr.HookRegistry.reset()
