"""Reading foreign drafter layouts: layer-id conventions, defaults, .bin weights, RoPE scaling, bad files."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.specdec.checkpoint import DraftSpec, load_draft_checkpoint
from eyas.specdec.functional import FunctionalDrafter

H, V, VD = 32, 100, 10


def _weights(with_embed=True):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    w = {
        "fc.weight": r(H, 3 * H), "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": r(4 * 8, 2 * H), "midlayer.self_attn.k_proj.weight": r(2 * 8, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(2 * 8, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, 4 * 8),
        "midlayer.post_attention_layernorm.weight": torch.ones(H), "midlayer.mlp.gate_proj.weight": r(64, H),
        "midlayer.mlp.up_proj.weight": r(64, H), "midlayer.mlp.down_proj.weight": r(H, 64), "norm.weight": torch.ones(H),
        "lm_head.weight": r(VD, H), "d2t": torch.arange(VD) * 3, "t2d": torch.zeros(V, dtype=torch.bool),
    }
    w["t2d"][torch.arange(VD) * 4] = True
    if with_embed:
        w["embed_tokens.weight"] = r(V, H)
    return w


def _sglang_config(**extra):
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": V,
            "draft_vocab_size": VD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **extra}


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
    d = _write(tmp_path / "s", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}), _weights(), bin=True)
    ck = load_draft_checkpoint(d)
    assert ck.spec.aux_layer_ids == [2, 15, 27] and ck.spec.source_layer_ids == [1, 14, 26]
    assert ck.spec.source_format == "sglang" and ck.spec.norm_before_residual is False


def test_missing_ids_take_the_engine_default_and_need_the_target(tmp_path):
    d = _write(tmp_path / "s", _sglang_config(), _weights(with_embed=False))
    assert load_draft_checkpoint(d, target_layers=32).spec.aux_layer_ids == [2, 16, 29]  # SGLang [1, 15, 28] + 1
    with pytest.raises(EyasError, match="no aux layer ids"):
        load_draft_checkpoint(d)


def test_inconsistent_vocab_maps_and_shapes_are_refused(tmp_path):
    w = _weights()
    w["t2d"] = torch.ones(V, dtype=torch.bool)
    with pytest.raises(EyasError, match="t2d disagrees with d2t"):
        load_draft_checkpoint(_write(tmp_path / "a", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w))
    w = _weights()
    w["midlayer.mlp.up_proj.weight"] = torch.zeros(65, H)
    with pytest.raises(EyasError, match="up_proj.weight has shape"):
        load_draft_checkpoint(_write(tmp_path / "b", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w))
    del w["norm.weight"]
    with pytest.raises(EyasError, match="missing weights"):
        load_draft_checkpoint(_write(tmp_path / "c", _sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), w))


def test_speculators_layout_and_norm_before_residual_default(tmp_path):
    layer = {k: v for k, v in _sglang_config().items() if k not in ("architectures", "draft_vocab_size")}
    w = {k.replace("midlayer.", "layers.0."): v for k, v in _weights().items()}
    base = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
            "draft_vocab_size": VD, "eagle_aux_hidden_state_layer_ids": [2, 5, 9]}
    ck = load_draft_checkpoint(_write(tmp_path / "a", base, w))
    assert ck.spec.aux_layer_ids == [2, 5, 9] and ck.spec.norm_before_residual is True  # vLLM's default when absent
    ck2 = load_draft_checkpoint(_write(tmp_path / "b", {**base, "norm_before_residual": False}, w))
    assert ck2.spec.norm_before_residual is False
    # the flag changes the computation: the residual is the normalised feature
    a, b = FunctionalDrafter(ck.spec, ck.weights), FunctionalDrafter(ck2.spec, ck2.weights)
    ids, feat = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, H) * 5
    pos = torch.arange(3)[None]
    assert not torch.allclose(a.causal_forward(ids, feat, pos)[0], b.causal_forward(ids, feat, pos)[0])


def test_llama3_rope_matches_the_training_model():
    from eyas.drafter.model import DrafterConfig, rope_inv_freq

    rp = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    spec = DraftSpec(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                     rms_norm_eps=1e-5, rope_parameters={**rp, "rope_theta": 5e5}, max_position_embeddings=131072,
                     vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layer_ids=[1, 2, 3])
    d = FunctionalDrafter(spec, {"d2t": torch.zeros(VD, dtype=torch.long), "embed_tokens.weight": torch.zeros(V, H)})
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                        rope_theta=5e5, rope_parameters=rp, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H,
                        aux_layer_ids=[1, 2, 3], target_num_layers=6)
    torch.testing.assert_close(d._inv_freq, rope_inv_freq(cfg), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(d._inv_freq, 1.0 / (5e5 ** (torch.arange(0, 16, 2) / 16)))  # scaling applied
