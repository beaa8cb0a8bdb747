"""drafter/layouts.py and reader.py: reading foreign layouts (layer-id conventions, defaults, .bin weights, RoPE scaling, bad
files), the one layer-id conversion and its inverse, the one default and range check."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.drafter.reader import read_drafter as load_draft_checkpoint
from eyas.errors import EyasError
from eyas.specdec.functional import FunctionalDrafter

H, V, VD = 32, 100, 10


def _weights(with_embed=True):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    w = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": r(4 * 8, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(2 * 8, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(2 * 8, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, 4 * 8),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": r(64, H),
        "midlayer.mlp.up_proj.weight": r(64, H),
        "midlayer.mlp.down_proj.weight": r(H, 64),
        "norm.weight": torch.ones(H),
        "lm_head.weight": r(VD, H),
        "d2t": torch.arange(VD) * 3,
        "t2d": torch.zeros(V, dtype=torch.bool),
    }
    w["t2d"][torch.arange(VD) * 4] = True
    if with_embed:
        w["embed_tokens.weight"] = r(V, H)
    return w


def _sglang_config(**extra):
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        **extra,
    }


def _write(d, config, weights, *, bin=False):
    from safetensors.torch import save_file

    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if bin:
        torch.save(weights, d / "pytorch_model.bin")
    else:
        save_file(weights, str(d / "model.safetensors"))
    return d


def test_sglang_ids_are_shifted_and_bin_weights_read(tmp_path):
    d = _write(
        tmp_path / "s",
        _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}),
        _weights(),
        bin=True,
    )
    ck = load_draft_checkpoint(d)
    assert ck.config.aux_layer_ids == [2, 15, 27] and ck.provenance.layer_ids == [1, 14, 26]
    assert ck.provenance.format == "sglang" and ck.config.norm_before_residual is False


def test_missing_ids_take_the_engine_default_and_need_the_target(tmp_path):
    d = _write(tmp_path / "s", _sglang_config(), _weights(with_embed=False))
    assert load_draft_checkpoint(d, target_layers=32).config.aux_layer_ids == [2, 16, 29]  # SGLang [1, 15, 28] + 1
    with pytest.raises(EyasError, match="no aux layer ids"):
        load_draft_checkpoint(d)


def test_inconsistent_vocab_maps_and_shapes_are_refused(tmp_path):
    w = _weights()
    w["t2d"] = torch.ones(V, dtype=torch.bool)
    with pytest.raises(EyasError, match="t2d disagrees with d2t"):
        load_draft_checkpoint(
            _write(tmp_path / "a", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w)
        )
    w = _weights()
    w["midlayer.mlp.up_proj.weight"] = torch.zeros(65, H)
    with pytest.raises(EyasError, match="up_proj.weight has shape"):
        load_draft_checkpoint(
            _write(tmp_path / "b", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w)
        )
    del w["norm.weight"]
    with pytest.raises(EyasError, match="missing weights"):
        load_draft_checkpoint(
            _write(tmp_path / "c", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w)
        )


def test_speculators_layout_and_norm_before_residual_default(tmp_path):
    layer = {k: v for k, v in _sglang_config().items() if k not in ("architectures", "draft_vocab_size")}
    w = {k.replace("midlayer.", "layers.0."): v for k, v in _weights().items()}
    base = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": VD,
        "eagle_aux_hidden_state_layer_ids": [2, 5, 9],
    }
    ck = load_draft_checkpoint(_write(tmp_path / "a", base, w))
    assert ck.config.aux_layer_ids == [2, 5, 9] and ck.config.norm_before_residual is True  # vLLM's default when absent
    ck2 = load_draft_checkpoint(_write(tmp_path / "b", {**base, "norm_before_residual": False}, w))
    assert ck2.config.norm_before_residual is False
    # the flag changes the computation: the residual is the normalised feature
    a, b = FunctionalDrafter(ck.config, ck.weights), FunctionalDrafter(ck2.config, ck2.weights)
    ids, feat = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, H) * 5
    pos = torch.arange(3)[None]
    assert not torch.allclose(a.causal_forward(ids, feat, pos)[0], b.causal_forward(ids, feat, pos)[0])


def test_llama3_rope_old_and_new_keys_read_the_same():
    """SGLang-era configs write rope_theta + rope_scaling {"type": ...}; newer ones rope_parameters."""
    from eyas.drafter.model import DrafterConfig, rope_inv_freq
    from eyas.drafter.reader import rope_parameters_of

    rp = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = rope_parameters_of({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **rp}})
    new = rope_parameters_of({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **rp}})
    assert old == new == {"rope_type": "llama3", "rope_theta": 5e5, **rp}
    dims = dict(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=VD,
        target_hidden_size=H,
        aux_layer_ids=[1, 2, 3],
    )
    cfg = DrafterConfig(**dims, rope_parameters=old)
    legacy = DrafterConfig(**dims, rope_theta=5e5, rope_parameters={"rope_type": "llama3", **rp})  # pre-merge form
    assert cfg == legacy
    d = FunctionalDrafter(cfg, {"d2t": torch.zeros(VD, dtype=torch.long), "embed_tokens.weight": torch.zeros(V, H)})
    torch.testing.assert_close(d._inv_freq, rope_inv_freq(legacy), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(d._inv_freq, 1.0 / (5e5 ** (torch.arange(0, 16, 2) / 16)))  # scaling applied


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "deepseek_v3", None])
@pytest.mark.parametrize("ours", [[2, 15, 27], [3, 15, 27], [1, 2, 3]])
def test_layer_id_conversion_round_trips_for_every_engine(ours, model_type):
    from eyas.drafter.layouts import engine_layer_ids, eyas_layer_ids

    assert engine_layer_ids(ours, "vllm") == ours == eyas_layer_ids(ours, "vllm")
    if model_type == "deepseek_v3" and ours[0] == 1:
        with pytest.raises(EyasError, match="layer 1 first"):
            engine_layer_ids(ours, "sglang", model_type=model_type)
        return
    written = engine_layer_ids(ours, "sglang", model_type=model_type)
    assert eyas_layer_ids(written, "sglang", model_type=model_type) == ours
    if model_type != "deepseek_v3":
        assert written == [i - 1 for i in ours]
    with pytest.raises(EyasError, match="embeddings"):
        engine_layer_ids([0, *ours[1:]], "sglang", model_type=model_type)


def test_default_aux_layers_and_the_one_range_check():
    from eyas.drafter.layouts import check_layer_ids, default_aux_layer_ids

    assert default_aux_layer_ids(32) == [2, 16, 29] and default_aux_layer_ids(4) == [2, 2, 1]
    with pytest.raises(EyasError, match="at least 4"):
        default_aux_layer_ids(3)
    assert check_layer_ids(["1", 5], 6) == [1, 5]
    for bad in ([0, 2, 3], [1, 2, 6], []):
        with pytest.raises(EyasError, match="1..5"):
            check_layer_ids(bad, 6, what="--layers")


def test_an_eyas_drafter_config_is_read_once(tmp_path, monkeypatch):
    """check_drafter_dir and read_drafter read an eyas drafter's config.json once, for its layout and its config."""
    from pathlib import Path

    from eyas.drafter.reader import check_drafter_dir
    from eyas.drafter.writer import write_eyas

    ck = load_draft_checkpoint(
        _write(
            tmp_path / "s", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}), _weights()
        )
    )
    d = write_eyas(tmp_path / "e", ck.config, ck.weights)
    reads, read_text = [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or read_text(self, *a, **k))
    assert check_drafter_dir(d) == "eyas" and reads.count("config.json") == 1
    reads.clear()
    assert load_draft_checkpoint(d).config == ck.config and reads.count("config.json") == 1


def test_check_drafter_dir_refuses_what_read_drafter_would_naming_the_path(tmp_path):
    """Read from config.json alone (eval calls it before the target loads); every message names the folder."""
    from eyas.drafter.reader import check_drafter_dir

    sgl = _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]})
    assert check_drafter_dir(_write(tmp_path / "ok", sgl, _weights())) == "sglang"
    assert check_drafter_dir(_write(tmp_path / "okbin", sgl, _weights(), bin=True)) == "sglang"
    with pytest.raises(EyasError, match=r"--drafter .*nope: not a directory"):
        check_drafter_dir(tmp_path / "nope")
    (tmp_path / "store").mkdir()
    with pytest.raises(EyasError, match=r"--drafter .*store: no config\.json"):
        check_drafter_dir(tmp_path / "store")
    with pytest.raises(EyasError, match=r"--drafter .*empty/config\.json: cannot tell the drafter layout"):
        check_drafter_dir(_write(tmp_path / "empty", {}, _weights()))
    with pytest.raises(EyasError, match=r"--drafter .*list/config\.json: expected a JSON object, got list"):
        check_drafter_dir(_write(tmp_path / "list", [1], _weights()))
    no_hidden = {k: v for k, v in sgl.items() if k != "hidden_size"}
    with pytest.raises(EyasError, match=r"--drafter .*nohidden/config\.json: config lacks 'hidden_size'"):
        check_drafter_dir(_write(tmp_path / "nohidden", no_hidden, _weights()))
    with pytest.raises(EyasError, match=r"eyas/config\.json: schema 'eyas\.drafter/0', expected"):
        check_drafter_dir(_write(tmp_path / "eyas", {"schema": "eyas.drafter/0", "drafter": {}}, _weights()))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(sgl))
    with pytest.raises(EyasError, match=r"--drafter .*noweights: no \*\.safetensors or pytorch_model\*\.bin weights"):
        check_drafter_dir(tmp_path / "noweights")
    layer = {k: v for k, v in sgl.items() if k not in ("architectures", "intermediate_size")}
    with pytest.raises(EyasError, match=r"--drafter .*spec/config\.json: config lacks 'intermediate_size'"):
        check_drafter_dir(
            _write(
                tmp_path / "spec", {"speculators_model_type": "eagle3", "transformer_layer_config": layer}, _weights()
            )
        )
