"""The plugin's SGLang glue, run against minimal fakes of the SGLang objects it touches.

The fakes copy the shapes the glue reads (ForwardBatch fields, ForwardMode predicates,
LogitsProcessor.forward's signature, set_eagle3_layers_to_capture's rules for Llama, DeepSeek and
the Kimi-K2.5 wrapper, the graph-replay batch without rids); test_sglang_contract.py checks those
in every supported wheel.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types

import pytest
import torch

from eyas.sglang import plugin, standin
from eyas.sglang.core import DumpWriter, make_rid, read_dump
from eyas.sglang.standin import ForwardMode, replay_batch

A, H = 3, 8


ForwardBatch = standin.ForwardBatch  # SGLang's field names; the stand-in server uses the same class


class LogitsProcessor:
    def forward(
        self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, hidden_states_before_norm=None
    ):
        return "logits"


@pytest.fixture
def fake_sglang(monkeypatch):
    fbi = types.ModuleType("sglang.srt.model_executor.forward_batch_info")
    fbi.ForwardBatch, fbi.ForwardMode = ForwardBatch, ForwardMode
    rc = types.ModuleType("sglang.srt.runtime_context")
    ranks = types.SimpleNamespace(attn_tp_rank=0, pp_rank=0, pp_size=1)
    rc.get_parallel = lambda: ranks
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fbi.__name__, fbi)
    monkeypatch.setitem(sys.modules, rc.__name__, rc)
    return ranks


@pytest.fixture
def state(tmp_path, monkeypatch, fake_sglang):
    st = plugin._State(plugin.PluginConfig(layer_ids=[2, 3, 4], dump_dir=str(tmp_path)))
    st.writer = DumpWriter(tmp_path, layer_ids=[2, 3, 4])
    st.enabled = True
    st.layer_ids = [2, 3, 4]
    st.logits_sig = inspect.signature(LogitsProcessor.forward)
    monkeypatch.setattr(plugin, "_STATE", st)
    return st


def batch(mode, pieces, pad=0):
    """pieces: (rid, L, prefix, n). Returns (fb, hidden [T, H], packed aux [T, A*H], per-rid truth)."""
    g = torch.Generator().manual_seed(0)
    T = sum(n for *_, n in pieces) + pad
    hidden, aux = torch.randn(T, H, generator=g), torch.randn(T, A * H, generator=g)
    pos, ids = [], []
    for _, _, p, n in pieces:
        pos.append(torch.arange(p, p + n)), ids.append(torch.arange(100 + p, 100 + p + n))
    pos.append(torch.zeros(pad, dtype=torch.long)), ids.append(torch.zeros(pad, dtype=torch.long))
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(pieces),
        input_ids=torch.cat(ids)[: T - pad],
        rids=[r for r, *_ in pieces],
        positions=torch.cat(pos)[: T - pad],
        extend_prefix_lens_cpu=[p for *_, p, _ in pieces],
        extend_seq_lens_cpu=[n for *_, n in pieces],
    )
    return fb, hidden, aux


def test_logits_hook_writes_packed_aux_per_request(state, tmp_path):
    ra, rb = make_rid(4, "a"), make_rid(2, "b")
    fb, hidden, aux = batch(ForwardMode.EXTEND, [(ra, 4, 0, 4), ("user-req", 9, 0, 3), (rb, 2, 0, 2)], pad=3)
    assert plugin._on_logits(LogitsProcessor(), fb.input_ids, hidden, None, fb, aux) is None  # args untouched
    d = read_dump(tmp_path / ra)
    torch.testing.assert_close(d.aux_LAD, aux[:4].view(4, A, H), rtol=0, atol=0)
    torch.testing.assert_close(d.final_LD, hidden[:4], rtol=0, atol=0)
    d = read_dump(tmp_path / rb)
    torch.testing.assert_close(d.aux_LAD, aux[7:9].view(2, A, H), rtol=0, atol=0)
    assert d.meta["writer"] == {} or "attn_tp_rank" in d.meta["writer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ra, rb])


def test_logits_hook_keyword_call_list_aux_and_mixed_mode(state, tmp_path):
    ra = make_rid(3, "kw")
    fb, hidden, aux = batch(ForwardMode.MIXED, [(ra, 3, 0, 3), ("decoding", 50, 49, 1)])
    aux_list = [aux[:, a * H : (a + 1) * H] for a in range(A)]
    plugin._on_logits(
        LogitsProcessor(),
        input_ids=fb.input_ids,
        hidden_states=hidden,
        lm_head=None,
        logits_metadata=fb,
        aux_hidden_states=aux_list,
    )
    torch.testing.assert_close(read_dump(tmp_path / ra).aux_LAD, aux[:3].view(3, A, H), rtol=0, atol=0)


def test_logits_hook_skips_decode_verify_and_foreign(state, tmp_path):
    ra = make_rid(3, "d")
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        fb, hidden, aux = batch(mode, [(ra, 3, 0, 3)])
        plugin._on_logits(LogitsProcessor(), fb.input_ids, hidden, None, fb, aux)
    fb, hidden, aux = batch(ForwardMode.EXTEND, [("someone-else", 3, 0, 3)])
    plugin._on_logits(LogitsProcessor(), fb.input_ids, hidden, None, fb, aux)
    assert list(tmp_path.iterdir()) == [] and state.errors == 0


def test_logits_hook_without_aux_rejects_and_errors_never_raise(state, tmp_path):
    ra = make_rid(3, "noaux")
    fb, hidden, _ = batch(ForwardMode.EXTEND, [(ra, 3, 0, 3)])
    plugin._on_logits(LogitsProcessor(), fb.input_ids, hidden, None, fb, None)
    d = read_dump(tmp_path / ra)
    assert d.status == "rejected" and "no aux hidden states" in d.meta["reason"]
    fb.extend_seq_lens_cpu = [3, 1]  # inconsistent batch: the hook must not break the forward
    assert plugin._on_logits(LogitsProcessor(), fb.input_ids, hidden, None, fb, torch.zeros(3, A * H)) is None
    assert state.errors == 1 and "ValueError" in state.last_error


class _Config:
    num_hidden_layers, hidden_size, vocab_size, max_position_embeddings = 12, 8, 100, 4096


class LlamaLike:  # sglang/srt/models/llama.py: layers_to_capture = [val + 1 for val in layer_ids]
    def __init__(self):
        self.config, self.model = _Config(), types.SimpleNamespace(layers_to_capture=[])

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class DeepseekLike(LlamaLike):  # deepseek_v2.py: the +1 only when the first id is 1
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids] if layer_ids[0] == 1 else list(layer_ids)


class KimiLike:  # kimi_k25.py: `.model` is a property returning the DeepSeek-V3 language model
    def __init__(self):
        self.language_model, self.config = DeepseekLike(), _Config()

    @property
    def model(self):
        return self.language_model

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)


def _inner(model):
    return model.language_model.model if isinstance(model, KimiLike) else model.model


@pytest.mark.parametrize("cls", [LlamaLike, DeepseekLike, KimiLike])
@pytest.mark.parametrize("layers", [[2, 6, 9], [3, 6, 9], None])
def test_enable_sets_layers_in_eyas_convention(tmp_path, monkeypatch, fake_sglang, cls, layers):
    st = plugin._State(plugin.PluginConfig(layer_ids=layers, dump_dir=str(tmp_path)))
    monkeypatch.setattr(plugin, "_STATE", st)
    fake_sglang.attn_tp_rank = 1
    runner = types.SimpleNamespace(
        model=cls(), is_draft_worker=False, server_args=types.SimpleNamespace(speculative_algorithm=None)
    )
    plugin._on_init_attention_backends(runner)
    want = layers or [2, 6, 9]  # default for 12 layers: 2, N//2, N-3
    # read back from the module the decoder loop uses (for Kimi: under the wrapper's language model)
    assert _inner(runner.model).layers_to_capture == want and st.layer_ids == want
    assert st.model["layers_to_capture"] == want
    # each model's own +1 rule: DeepSeek/Kimi keep ids whose first entry is not 1 as they are
    deepseek_rule = cls is not LlamaLike and want[0] != 2
    assert st.model["ids_passed"] == (want if deepseek_rule else [i - 1 for i in want])
    assert st.ranks["attn_tp_rank"] == 1 and st.enabled
    assert st.writer is None  # rank 1 never writes: no writer threads, nothing submitted
    status = st.status()
    assert status["layer_ids"] == want and status["writer"] is False


def test_the_writer_rank_creates_the_dump_dir_before_any_dump(tmp_path, monkeypatch, fake_sglang):
    """The client's preflight looks for the dump directory before the first request: a server that only
    made it on its first dump failed every preflight (found by the first live run, 2026-12-01)."""
    ddir = tmp_path / "not" / "yet" / "dumps"
    st = plugin._State(plugin.PluginConfig(layer_ids=None, dump_dir=str(ddir)))
    monkeypatch.setattr(plugin, "_STATE", st)
    runner = types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False, server_args=None)
    plugin._on_init_attention_backends(runner)
    assert st.is_writer() and ddir.is_dir() and not any(ddir.iterdir())
    status = st.status()
    assert status["write_errors"] == 0
    # the model's own context limit, which verify-server sizes its probes by when --context-length was not given
    assert status["model"]["max_position_embeddings"] == 4096
    # a rank that never writes makes nothing; a directory that cannot be made is reported, never raised
    fake_sglang.attn_tp_rank = 1
    other = tmp_path / "rank1"
    st = plugin._State(plugin.PluginConfig(layer_ids=None, dump_dir=str(other)))
    monkeypatch.setattr(plugin, "_STATE", st)
    plugin._on_init_attention_backends(
        types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False, server_args=None)
    )
    assert not other.exists()
    fake_sglang.attn_tp_rank = 0
    (tmp_path / "a-file").write_text("x")
    st = plugin._State(plugin.PluginConfig(layer_ids=None, dump_dir=str(tmp_path / "a-file" / "dumps")))
    monkeypatch.setattr(plugin, "_STATE", st)
    plugin._on_init_attention_backends(
        types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False, server_args=None)
    )
    assert st.enabled and st.status()["write_errors"] == 1 and "a-file" in st.writer.errors[0]


@pytest.mark.parametrize("cls", [DeepseekLike, KimiLike])
def test_deepseek_rule_refuses_a_first_id_of_one(tmp_path, monkeypatch, fake_sglang, cls):
    st = plugin._State(plugin.PluginConfig(layer_ids=[1, 6, 9], dump_dir=str(tmp_path)))
    monkeypatch.setattr(plugin, "_STATE", st)
    runner = types.SimpleNamespace(model=cls(), is_draft_worker=False, server_args=None)
    with pytest.raises(plugin.PluginConfigError, match="first id >= 2"):
        plugin._on_init_attention_backends(runner)
    assert not st.enabled
    # Llama's rule can express it
    st = plugin._State(plugin.PluginConfig(layer_ids=[1, 6, 9], dump_dir=str(tmp_path)))
    monkeypatch.setattr(plugin, "_STATE", st)
    runner = types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False, server_args=None)
    plugin._on_init_attention_backends(runner)
    assert runner.model.model.layers_to_capture == [1, 6, 9]


def test_a_model_without_readable_layers_is_refused(tmp_path, monkeypatch, fake_sglang):
    model = LlamaLike()
    model.model = types.SimpleNamespace()  # no layers_to_capture anywhere under .model
    monkeypatch.setattr(plugin, "_STATE", plugin._State(plugin.PluginConfig(layer_ids=None, dump_dir=str(tmp_path))))
    with pytest.raises(plugin.PluginConfigError, match="cannot be read back"):
        plugin._on_init_attention_backends(types.SimpleNamespace(model=model, is_draft_worker=False, server_args=None))


def test_enable_refuses_bad_setups(tmp_path, monkeypatch, fake_sglang):
    def run(layers, **args):
        monkeypatch.setattr(
            plugin, "_STATE", plugin._State(plugin.PluginConfig(layer_ids=layers, dump_dir=str(tmp_path)))
        )
        runner = types.SimpleNamespace(
            model=LlamaLike(), is_draft_worker=False, server_args=types.SimpleNamespace(**args)
        )
        plugin._on_init_attention_backends(runner)

    with pytest.raises(plugin.PluginConfigError, match="EAGLE3"):
        run([2, 3, 4], speculative_algorithm="EAGLE3")
    with pytest.raises(plugin.PluginConfigError, match="enable-return-aux-hidden-states"):
        run([2, 3, 4], enable_return_aux_hidden_states=True)
    with pytest.raises(plugin.PluginConfigError, match="pp-size"):
        run([2, 3, 4], pp_size=2)
    with pytest.raises(plugin.PluginConfigError, match="12 layers"):
        run([2, 3, 12])
    with pytest.raises(plugin.PluginConfigError, match="DP attention"):
        run([2, 3, 4], enable_dp_attention=True)
    with pytest.raises(plugin.PluginConfigError, match="DP attention"):
        run([2, 3, 4], attn_dp_size=2)  # 0.5.23 resolves enable_dp_attention from attn_dp_size
    with pytest.raises(plugin.PluginConfigError, match="enable-two-batch-overlap"):
        run([2, 3, 4], enable_two_batch_overlap=True)
    with pytest.raises(plugin.PluginConfigError, match="enable-single-batch-overlap"):
        run([2, 3, 4], enable_single_batch_overlap=True)
    with pytest.raises(plugin.PluginConfigError, match="tc_piecewise"):
        run([2, 3, 4], cuda_graph_backend_prefill="tc_piecewise")
    with pytest.raises(plugin.PluginConfigError, match="tc_piecewise"):
        run([2, 3, 4], cuda_graph_config={"prefill": {"backend": "tc_piecewise"}})
    run([2, 3, 4], cuda_graph_backend_prefill="breakable", enable_two_batch_overlap=False)  # the default is fine
    assert plugin._STATE.enabled


def resolved_record(raw: dict, *declarations: dict) -> types.SimpleNamespace:
    """ServerArgs as SGLang 0.5.19+ hands it to the model runner: the fields keep the raw input, every
    decision of its resolution is a declaration (test_sglang_contract.py checks the shape per release)."""
    return types.SimpleNamespace(
        **raw, _raw_input=dict(raw), _resolved_overrides=[(f"handler{i}", d) for i, d in enumerate(declarations)]
    )


def start(tmp_path, monkeypatch, server_args):
    cfg = plugin.PluginConfig(layer_ids=[2, 3, 4], dump_dir=str(tmp_path))
    monkeypatch.setattr(plugin, "_STATE", plugin._State(cfg))
    plugin._on_init_attention_backends(
        types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False, server_args=server_args)
    )
    return plugin._STATE.enabled


def test_prefill_context_parallelism_is_refused(tmp_path, monkeypatch, fake_sglang):
    # a prefill's tokens split over the CP ranks: the writing rank's logits step sees part of each sequence
    with pytest.raises(plugin.PluginConfigError, match=r"^eyas capture plugin: --enable-prefill-cp is set: [^\n]*$"):
        start(tmp_path, monkeypatch, types.SimpleNamespace(enable_prefill_cp=True))
    # 0.5.19: the older --enable-prefill-context-parallel leaves the field False and declares it True
    with pytest.raises(plugin.PluginConfigError, match="--enable-prefill-cp"):
        start(
            tmp_path,
            monkeypatch,
            resolved_record(
                {"enable_prefill_cp": False, "enable_prefill_context_parallel": True}, {"enable_prefill_cp": True}
            ),
        )
    assert start(tmp_path, monkeypatch, types.SimpleNamespace(enable_prefill_cp=False))
    assert start(tmp_path, monkeypatch, types.SimpleNamespace())  # a release without the field


def test_a_resolved_setting_wins_over_the_raw_field(tmp_path, monkeypatch, fake_sglang):
    # 0.5.19+: DeepSeek's DSA prefill CP declares enable_dp_attention and attn_cp_size; the fields keep the input
    with pytest.raises(plugin.PluginConfigError, match="DP attention"):
        start(tmp_path, monkeypatch, resolved_record({"enable_dp_attention": False}, {"enable_dp_attention": True}))
    with pytest.raises(plugin.PluginConfigError, match="--attn-cp-size"):
        start(tmp_path, monkeypatch, resolved_record({"attn_cp_size": 1}, {"attn_cp_size": 4}, {"attn_cp_size": 8}))
    # a later declaration undoes an earlier one; without `_raw_input` (<= 0.5.18) the fields are the result
    assert start(tmp_path, monkeypatch, resolved_record({"attn_cp_size": 1}, {"attn_cp_size": 4}, {"attn_cp_size": 1}))
    older = types.SimpleNamespace(attn_cp_size=1, _resolved_overrides=[("x", {"attn_cp_size": 4})])
    assert start(tmp_path, monkeypatch, older)


def graph_config(backend: str) -> types.SimpleNamespace:
    """A resolved CudaGraphConfig (the plugin reads .prefill.backend)."""
    return types.SimpleNamespace(
        prefill=types.SimpleNamespace(backend=backend), decode=types.SimpleNamespace(backend="full")
    )


def test_the_prefill_graph_backend_is_the_resolved_one_not_the_cuda_default(tmp_path, monkeypatch, fake_sglang):
    # Off CUDA, SGLang 0.5.15-0.5.21 default the prefill graph to tc_piecewise (0.5.19+: as a declaration,
    # the raw cuda_graph_config staying None); the flag is unset, so nothing but the resolved value says it
    piecewise = resolved_record(
        {"cuda_graph_config": None, "cuda_graph_backend_prefill": None},
        {"cuda_graph_config": graph_config("tc_piecewise")},
    )
    with pytest.raises(plugin.PluginConfigError, match=r"tc_piecewise[^\n]*--disable-prefill-cuda-graph[^\n]*$"):
        start(tmp_path, monkeypatch, piecewise)
    # ... which SGLang's cascade turns off on HIP/NPU/XPU/CPU unless asked for: then the server runs no prefill graph
    piecewise._resolved_overrides.append(
        ("_disable_tc_piecewise_cudagraph_if_incompatible", {"cuda_graph_config": graph_config("disabled")})
    )
    assert start(tmp_path, monkeypatch, piecewise)
    # the JSON config wins over --cuda-graph-backend-prefill in SGLang, and so in what the plugin reads
    with pytest.raises(plugin.PluginConfigError, match="tc_piecewise"):
        start(
            tmp_path,
            monkeypatch,
            types.SimpleNamespace(
                cuda_graph_backend_prefill="breakable", cuda_graph_config=graph_config("tc_piecewise")
            ),
        )
    assert start(
        tmp_path,
        monkeypatch,
        types.SimpleNamespace(cuda_graph_backend_prefill="tc_piecewise", cuda_graph_config=graph_config("breakable")),
    )


@pytest.mark.parametrize("default, refused", [("tc_piecewise", True), ("breakable", False), ("disabled", False)])
def test_args_without_a_config_take_sglangs_platform_default(tmp_path, monkeypatch, fake_sglang, default, refused):
    # no resolved config and no flag: the backend is SGLang's default_prefill_backend() on this platform
    # (tc_piecewise off CUDA up to 0.5.21), not CUDA's breakable
    cgc = types.ModuleType("sglang.srt.model_executor.cuda_graph_config")
    cgc.default_prefill_backend = lambda: default
    monkeypatch.setitem(sys.modules, cgc.__name__, cgc)
    if refused:
        with pytest.raises(plugin.PluginConfigError, match="tc_piecewise"):
            start(tmp_path, monkeypatch, types.SimpleNamespace())
    else:
        assert start(tmp_path, monkeypatch, types.SimpleNamespace())
    # the flags that turn the prefill graph off come before the default
    assert start(tmp_path, monkeypatch, types.SimpleNamespace(disable_prefill_cuda_graph=True))
    assert start(tmp_path, monkeypatch, types.SimpleNamespace(cuda_graph_backend_prefill="breakable"))


def test_config_from_env():
    assert plugin.PluginConfig.from_env({}).layer_ids is None
    cfg = plugin.PluginConfig.from_env({"EYAS_CAPTURE_LAYERS": "2, 15,27", "EYAS_DUMP_DIR": "/tmp/x"})
    assert cfg.layer_ids == [2, 15, 27] and cfg.dump_dir == "/tmp/x"
    for bad in ("2,a", "0,1,2", "3,3"):
        with pytest.raises(plugin.PluginConfigError, match="EYAS_CAPTURE_LAYERS"):
            plugin.PluginConfig.from_env({"EYAS_CAPTURE_LAYERS": bad})
    assert plugin.capture_enabled({"EYAS_CAPTURE": "1"}) and not plugin.capture_enabled({})


def test_register_is_inert_without_eyas_capture(monkeypatch):
    monkeypatch.setattr(plugin, "_STATE", None)
    monkeypatch.setitem(sys.modules, "sglang", None)  # importing sglang would raise ImportError
    registered = []
    monkeypatch.setattr(plugin, "register_hooks", lambda *a, **k: registered.append(a))
    for value in (None, "0", "no"):
        if value is None:
            monkeypatch.delenv("EYAS_CAPTURE", raising=False)
        else:
            monkeypatch.setenv("EYAS_CAPTURE", value)
        plugin.register()
        assert plugin._STATE is None and registered == []
    # and the same call with EYAS_CAPTURE=1 does act (so the assertions above can fail)
    monkeypatch.setenv("EYAS_CAPTURE", "1")
    with pytest.raises(plugin.PluginConfigError):
        plugin.register()


def test_version_range():
    assert plugin.version_supported("0.5.23") and plugin.version_supported("0.5.22.post1")
    assert all(plugin.version_supported(v) for v in plugin.SUPPORTED_VERSIONS)
    assert not plugin.version_supported("0.5.14") and not plugin.version_supported("0.6.0")
    assert not plugin.version_supported(None)


def test_entry_point_declared_for_sglang():
    import pkgutil
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"][plugin.ENTRY_POINT_GROUP]["eyas_capture"]
    assert pkgutil.resolve_name(value.replace(":", ".")) is plugin.register


def test_register_refuses_an_sglang_without_the_hooks(monkeypatch):
    monkeypatch.setenv("EYAS_CAPTURE", "1")
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.99")
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # an install whose modules cannot be imported
    with pytest.raises(plugin.PluginConfigError) as exc:
        plugin.register()
    msg = str(exc.value)
    assert "SGLang 0.5.99" in msg and "pinned 0.5.23" in msg and "LogitsProcessor.forward" in msg
    assert "ForwardBatch" in msg and "sglang==0.5.23" in msg


def test_replay_batch_takes_request_ids_from_the_scheduler_batch(state, tmp_path):
    # SGLang's prefill CUDA graph hands the logits step a rebuilt batch without rids (load_batch)
    ra, rb = make_rid(4, "ga"), make_rid(2, "gb")
    live, hidden, aux = batch(ForwardMode.EXTEND, [(ra, 4, 0, 4), ("user-req", 9, 0, 3), (rb, 2, 0, 2)], pad=7)
    replay = replay_batch(live, bucket=8)
    assert replay.rids is None and replay.input_ids.shape[0] == 16 and live.rids is not None
    # without the scheduler's batch the plugin cannot tell whose rows these are: nothing is written
    plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay, aux)
    assert list(tmp_path.iterdir()) == []
    # ModelRunner.forward(live batch) first, as SGLang calls it: every eyas request is dumped
    plugin._on_model_runner_forward(types.SimpleNamespace(is_draft_worker=False), live)
    plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay, aux)
    torch.testing.assert_close(read_dump(tmp_path / ra).aux_LAD, aux[:4].view(4, A, H), rtol=0, atol=0)
    d = read_dump(tmp_path / rb)
    torch.testing.assert_close(d.final_LD, hidden[7:9], rtol=0, atol=0)
    assert d.positions_L.tolist() == [0, 1] and d.input_ids_L.tolist() == [100, 101]
    assert state.counts["rids_from_live_batch"] == 1 and state.errors == 0
    # the live batch is used once: a later rid-less call (e.g. a warm-up) does not reuse it
    (tmp_path / ra / "meta.json").unlink()
    plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay, aux)
    assert not (tmp_path / ra / "meta.json").exists() and state.counts["rids_from_live_batch"] == 1


def test_an_unmatched_replay_batch_rejects_naming_the_flag(state, tmp_path):
    ra = make_rid(4, "um")
    live, hidden, aux = batch(ForwardMode.EXTEND, [(ra, 4, 0, 4)], pad=4)
    replay = replay_batch(live, bucket=8)
    replay.extend_seq_lens_cpu = [3]  # lengths that are not the scheduler's: never guess whose rows
    plugin._on_model_runner_forward(types.SimpleNamespace(is_draft_worker=False), live)
    plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay, aux)
    d = read_dump(tmp_path / ra)
    assert d.status == "rejected" and "--disable-prefill-cuda-graph" in d.meta["reason"]
    assert state.status()["stats"]["unmatched_forwards"] == 1


@pytest.mark.parametrize("live", ["none", "other_thread", "without_rids"])
def test_a_replay_batch_with_no_live_batch_to_take_ids_from_is_counted(state, tmp_path, live):
    # nobody can be told (no rids, so no rejected dumps): the forward is dropped, but counted for the client
    runner = types.SimpleNamespace(is_draft_worker=False)
    ra = make_rid(4, "rl")
    fb, hidden, aux = batch(ForwardMode.EXTEND, [(ra, 4, 0, 4)], pad=4)
    replay = replay_batch(fb, bucket=8)
    if live == "other_thread":  # ModelRunner.forward ran on another thread than this logits step
        t = threading.Thread(target=plugin._on_model_runner_forward, args=(runner, fb))
        t.start(), t.join()
    elif live == "without_rids":
        plugin._on_model_runner_forward(runner, replay)
    plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay, aux)
    assert list(tmp_path.iterdir()) == [] and state.errors == 0
    assert state.status()["stats"]["rid_less_forwards"] == 1 and state.counts["rids_from_live_batch"] == 0
    # a batch carrying its own rids, a matched replay batch, and a live batch of other traffic are not counted
    rb = make_rid(4, "own")
    own, _, _ = batch(ForwardMode.EXTEND, [(rb, 4, 0, 4)], pad=4)
    plugin._on_logits(LogitsProcessor(), own.input_ids, hidden, None, own, aux)
    other, _, _ = batch(ForwardMode.EXTEND, [("user-req", 4, 0, 4)], pad=4)
    for b in (fb, other):
        plugin._on_model_runner_forward(runner, b)
        plugin._on_logits(LogitsProcessor(), replay.input_ids, hidden, None, replay_batch(b, bucket=8), aux)
    assert read_dump(tmp_path / ra).status == read_dump(tmp_path / rb).status == "complete"
    assert state.counts["rid_less_forwards"] == 1 and state.counts["rids_from_live_batch"] == 1
    assert state.counts["unmatched_forwards"] == 0 and state.errors == 0


def test_the_source_contract_reads_code_not_comments_or_docstrings(tmp_path):
    # the parallel ranks named only in prose must not pass for declared; the same names in code do
    rc = tmp_path / "sglang/srt/runtime_context.py"
    rc.parent.mkdir(parents=True)

    def rank_problems(source: str) -> list[str]:
        rc.write_text(source)
        return [p for p in plugin.check_contract_in_source(tmp_path) if "parallel rank" in p]

    prose = (
        "def get_parallel():\n"
        '    """Answers "attn_tp_rank", "pp_rank" and f"pp_size"."""\n'
        '    # ranks: "attn_tp_rank", "pp_rank", "pp_size"\n'
        '    "pp_size"\n'
        '    return f"{None}pp_size"\n'
    )
    assert rank_problems(prose) == [
        f"sglang.srt.runtime_context: parallel rank {n!r} not declared" for n in ("attn_tp_rank", "pp_rank", "pp_size")
    ]
    code = (
        "class ParallelContext:\n"
        "    @property\n"
        "    def attn_tp_rank(self):\n"
        '        return self._read("pp_rank")\n'
        '_WIDTHS = ("pp_size",)\n'
        "def get_parallel():\n"
        "    return ParallelContext()\n"
    )
    assert rank_problems(code) == []


@pytest.mark.parametrize(
    "ranks", [dict(attn_tp_rank=1, pp_rank=0, pp_size=1), dict(attn_tp_rank=0, pp_rank=0, pp_size=2)]
)
def test_only_the_writer_rank_submits_anything(state, tmp_path, ranks):
    state.ranks = ranks
    ra = make_rid(3, "tp")
    live, hidden, aux = batch(ForwardMode.EXTEND, [(ra, 3, 0, 3)])
    plugin._on_model_runner_forward(types.SimpleNamespace(is_draft_worker=False), live)
    plugin._on_logits(LogitsProcessor(), live.input_ids, hidden, None, live, None)  # would be a rejected dump
    plugin._on_logits(LogitsProcessor(), live.input_ids, hidden, None, live, aux)  # would be a complete dump
    assert list(tmp_path.iterdir()) == [] and state.errors == 0
    assert state.core.stats["forwards"] == 0 and state.counts["live_batches"] == 0
    state.ranks = {"attn_tp_rank": 0, "pp_rank": 0, "pp_size": 1}  # the writer does write (the test can fail)
    plugin._on_logits(LogitsProcessor(), live.input_ids, hidden, None, live, aux)
    assert read_dump(tmp_path / ra).status == "complete"


def test_standin_builds_the_replay_batch_without_rids(tiny_target_dir, tmp_path):
    # the stand-in's forwards go through the replay batch by default, so CI exercises the path above
    seen = []
    with standin.StandinServer(
        standin.StandinConfig(target=tiny_target_dir, dump_dir=tmp_path, layer_ids=[2, 3, 4])
    ) as srv:
        orig = srv.logits.forward
        srv.logits.forward = lambda *a, **k: (seen.append(a[3]), orig(*a, **k))[1]
        code, out = srv.generate(
            {"input_ids": list(range(100, 113)), "rid": make_rid(13, "sb"), "sampling_params": {"max_new_tokens": 1}}
        )
    assert code == 200 and len(seen) == 1 and seen[0].rids is None and seen[0].input_ids.shape[0] == 16
    d = read_dump(tmp_path / make_rid(13, "sb"))
    assert d.status == "complete" and d.input_ids_L.tolist() == list(range(100, 113))
    assert srv.states[0].counts["rids_from_live_batch"] == 1
