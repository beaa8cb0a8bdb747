"""The plugin's SGLang glue, run against minimal fakes of the SGLang objects it touches.

The fakes copy the 0.5.23 shapes the glue reads (ForwardBatch fields, ForwardMode predicates,
LogitsProcessor.forward's signature, set_eagle3_layers_to_capture's conventions for Llama and
DeepSeek); test_sglang_contract.py checks those names in the real wheel.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import types

import pytest
import torch

from eyas.sglang import plugin
from eyas.sglang.core import DumpWriter, make_rid, read_dump

A, H = 3, 8


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    TARGET_VERIFY = 5

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    rids: list | None = None
    positions: torch.Tensor | None = None
    extend_prefix_lens_cpu: list | None = None
    extend_seq_lens_cpu: list | None = None


class LogitsProcessor:
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None):
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
    pos, ids, row = [], [], 0
    for _, _, p, n in pieces:
        pos.append(torch.arange(p, p + n)), ids.append(torch.arange(100 + p, 100 + p + n))
    pos.append(torch.zeros(pad, dtype=torch.long)), ids.append(torch.zeros(pad, dtype=torch.long))
    fb = ForwardBatch(forward_mode=mode, batch_size=len(pieces), input_ids=torch.cat(ids), rids=[r for r, *_ in pieces],
                      positions=torch.cat(pos), extend_prefix_lens_cpu=[p for *_, p, _ in pieces],
                      extend_seq_lens_cpu=[n for *_, n in pieces])
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
    aux_list = [aux[:, a * H:(a + 1) * H] for a in range(A)]
    plugin._on_logits(LogitsProcessor(), input_ids=fb.input_ids, hidden_states=hidden, lm_head=None,
                      logits_metadata=fb, aux_hidden_states=aux_list)
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
    num_hidden_layers, hidden_size, vocab_size = 12, 8, 100


class LlamaLike:  # sglang/srt/models/llama.py: layers_to_capture = [val + 1 for val in layer_ids]
    def __init__(self):
        self.config, self.model = _Config(), types.SimpleNamespace(layers_to_capture=[])

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class DeepseekLike(LlamaLike):  # deepseek_v2.py: the +1 only when the first id is 1
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids] if layer_ids[0] == 1 else list(layer_ids)


@pytest.mark.parametrize("cls", [LlamaLike, DeepseekLike])
@pytest.mark.parametrize("layers", [[2, 6, 9], [3, 6, 9], None])
def test_enable_sets_layers_in_eyas_convention(tmp_path, monkeypatch, fake_sglang, cls, layers):
    st = plugin._State(plugin.PluginConfig(layer_ids=layers, dump_dir=str(tmp_path)))
    monkeypatch.setattr(plugin, "_STATE", st)
    fake_sglang.attn_tp_rank = 1
    runner = types.SimpleNamespace(model=cls(), is_draft_worker=False,
                                   server_args=types.SimpleNamespace(speculative_algorithm=None))
    plugin._on_init_attention_backends(runner)
    want = layers or [2, 6, 9]  # default for 12 layers: 2, N//2, N-3
    assert runner.model.model.layers_to_capture == want and st.layer_ids == want
    assert st.ranks["attn_tp_rank"] == 1 and st.enabled
    # DeepSeek's rule leaves [2, 5, 8] as is when the first id is not 1: the plugin corrects it
    assert st.model["layers_to_capture_adjusted"] == (cls is DeepseekLike and layers == [3, 6, 9])
    status = st.status()
    assert status["layer_ids"] == want and status["sglang_layer_ids"] == [i - 1 for i in want]


def test_enable_refuses_bad_setups(tmp_path, monkeypatch, fake_sglang):
    def run(layers, **args):
        monkeypatch.setattr(plugin, "_STATE", plugin._State(plugin.PluginConfig(layer_ids=layers, dump_dir=str(tmp_path))))
        runner = types.SimpleNamespace(model=LlamaLike(), is_draft_worker=False,
                                       server_args=types.SimpleNamespace(**args))
        plugin._on_init_attention_backends(runner)

    with pytest.raises(plugin.PluginConfigError, match="EAGLE3"):
        run([2, 3, 4], speculative_algorithm="EAGLE3")
    with pytest.raises(plugin.PluginConfigError, match="enable-return-aux-hidden-states"):
        run([2, 3, 4], enable_return_aux_hidden_states=True)
    with pytest.raises(plugin.PluginConfigError, match="pp-size"):
        run([2, 3, 4], pp_size=2)
    with pytest.raises(plugin.PluginConfigError, match="12 layers"):
        run([2, 3, 12])


def test_config_from_env():
    assert plugin.PluginConfig.from_env({}).layer_ids is None
    cfg = plugin.PluginConfig.from_env({"EYAS_CAPTURE_LAYERS": "2, 15,27", "EYAS_DUMP_DIR": "/tmp/x"})
    assert cfg.layer_ids == [2, 15, 27] and cfg.dump_dir == "/tmp/x"
    for bad in ("2,a", "0,1,2", "3,3"):
        with pytest.raises(plugin.PluginConfigError, match="EYAS_CAPTURE_LAYERS"):
            plugin.PluginConfig.from_env({"EYAS_CAPTURE_LAYERS": bad})
    assert plugin.capture_enabled({"EYAS_CAPTURE": "1"}) and not plugin.capture_enabled({})


def test_register_is_inert_without_eyas_capture(monkeypatch):
    monkeypatch.delenv("EYAS_CAPTURE", raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # importing sglang would fail loudly
    plugin.register()


def test_version_range():
    assert plugin.version_supported("0.5.23") and plugin.version_supported("0.5.22.post1")
    assert not plugin.version_supported("0.5.15") and not plugin.version_supported("0.6.0")
    assert not plugin.version_supported(None)


def test_entry_point_declared_for_sglang():
    import tomllib
    from pathlib import Path

    import pkgutil

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
