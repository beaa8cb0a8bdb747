"""The drafter module: SGLang key layout, RoPE parity with transformers, cache/mask semantics, files."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.drafter.model import (
    DrafterCache,
    DrafterConfig,
    Eagle3Drafter,
    rope_inv_freq,
)
from eyas.errors import EyasError

SGLANG_KEYS = {
    "embed_tokens.weight",
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def tiny_cfg(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=100,
        draft_vocab_size=40,
        target_hidden_size=32,
        aux_layer_ids=[1, 3, 4],
        target_num_layers=6,
        rope_theta=10000.0,
    )
    base.update(kw)
    return DrafterConfig(**base)


def test_state_dict_is_sglang_layout():
    cfg = tiny_cfg()
    sd = Eagle3Drafter(cfg).state_dict()
    assert set(sd) == SGLANG_KEYS
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["fc.weight"].shape == (32, 3 * 32)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 32)  # attention input is 2H wide
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * 32)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (32, 4 * 8)
    assert sd["lm_head.weight"].shape == (40, 32)
    assert not Eagle3Drafter(cfg).embed_tokens.weight.requires_grad


def test_from_target_config(tiny_target_dir):
    from transformers import AutoConfig

    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_target_dir))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.intermediate_size == 128 and cfg.target_num_layers == 6
    assert cfg.aux_layer_ids == [2, 6 // 2, 6 - 3]
    assert cfg.draft_vocab_size == 32000 and cfg.vocab_size == 49152
    with pytest.raises(EyasError):
        DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_target_dir), aux_layer_ids=[1, 9])


def test_llama3_rope_matches_transformers():
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    cfg = tiny_cfg(
        hidden_size=128,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=128,
        target_hidden_size=128,
        rope_theta=500000.0,
        rope_parameters=params,
        max_position_embeddings=131072,
    )
    hf_cfg = SimpleNamespace(
        rope_parameters=params,
        head_dim=128,
        hidden_size=128,
        num_attention_heads=1,
        max_position_embeddings=131072,
        partial_rotary_factor=1.0,
    )
    hf_cfg.standardize_rope_params = lambda: None
    ref, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(cfg), ref.float(), rtol=1e-5, atol=0)
    plain = rope_inv_freq(
        tiny_cfg(
            hidden_size=128,
            head_dim=128,
            num_attention_heads=1,
            num_key_value_heads=1,
            target_hidden_size=128,
            rope_theta=500000.0,
        )
    )
    assert not torch.allclose(plain, ref.float())  # the scaling changes the low frequencies


def test_rope_table_rows_equal_rope_at_every_position_and_grow_past_it():
    """`rope_at` (the TTT unroll's cos/sin, rows of a table kept on the drafter) gives exactly `rope`'s values,
    at an offset, in the dtype asked, and past the table's end (it is made again, larger)."""
    m = Eagle3Drafter(tiny_cfg())
    pos = torch.tensor([0, 5, 1, 0, 1023, 7])
    for offset, dtype, size in (
        (0, torch.float32, 1024),
        (3, torch.float32, 1027),
        (2, torch.bfloat16, 1026),
        (0, torch.float32, 3000),
    ):
        p = pos if size < 3000 else pos + 1900
        cos, sin = m.rope_at(p, offset, dtype, size)
        ref_cos, ref_sin = m.rope((p + offset)[None], dtype)
        assert cos.dtype == dtype and cos.shape == ref_cos.shape == (1, 1, 6, 8)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        assert m._rope_table[0].shape[0] >= size


def test_cache_and_masks_match_full_pass():
    torch.manual_seed(0)
    m = Eagle3Drafter(tiny_cfg()).eval()
    ids = torch.randint(0, 100, (2, 7))
    feat = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None].expand(2, 7)
    h_full, _ = m.forward_step(ids, feat, pos)
    cache = DrafterCache()
    h1, _ = m.forward_step(ids[:, :4], feat[:, :4], pos[:, :4], cache=cache)
    h2, _ = m.forward_step(ids[:, 4:], feat[:, 4:], pos[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat([h1, h2], 1), h_full, atol=1e-5, rtol=1e-5)
    assert cache.length == 7
    # crop = rollback: re-running the last 3 after cropping to 4 gives the same again
    cache.crop(4)
    h3, _ = m.forward_step(ids[:, 4:], feat[:, 4:], pos[:, 4:], cache=cache)
    torch.testing.assert_close(h3, h2)
    # a tree-style mask where token 6 sees only 0..4 and itself (not 5) differs from causal
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    mask[6, 5] = False
    h_tree, _ = m.forward_step(ids, feat, pos, attention_mask=mask)
    torch.testing.assert_close(h_tree[:, :6], h_full[:, :6])
    assert (h_tree[:, 6] - h_full[:, 6]).abs().max() > 1e-4


def test_vocab_mapping_and_save_load(tmp_path):
    torch.manual_seed(0)
    m = Eagle3Drafter(tiny_cfg())
    used = torch.sort(torch.randperm(100)[:40]).values
    m.set_vocab(used)
    assert torch.equal(m.draft_to_target(torch.arange(40)), used)
    assert int(m.t2d.sum()) == 40 and bool(m.t2d[used].all())
    with pytest.raises(ValueError):
        m.set_vocab(torch.arange(40).flip(0))
    m.save(tmp_path / "d", target={"path": "x"})
    back = Eagle3Drafter.load(tmp_path / "d")
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    from eyas.drafter.reader import read_eyas_config

    cfg, meta = read_eyas_config(tmp_path / "d")
    assert cfg == m.config and meta["target"] == {"path": "x"}
    bf = Eagle3Drafter.load(tmp_path / "d", dtype=torch.bfloat16)
    assert bf.fc.weight.dtype == torch.bfloat16 and bf.d2t.dtype == torch.int64 and bf.t2d.dtype == torch.bool
    # a weights file from another config is refused with the keys named
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    del sd["midlayer.hidden_norm.weight"]
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(EyasError, match="hidden_norm"):
        Eagle3Drafter.load(tmp_path / "d")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_cfg(draft_vocab_size=101)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_cfg(num_key_value_heads=3)
    mrope = tiny_cfg(rope_parameters={"rope_type": "mrope"})  # a foreign drafter's config may say so (evaluated
    with pytest.raises(EyasError, match="rope_type"):  # through transformers), the training model may not
        Eagle3Drafter(mrope)
    d = tiny_cfg().to_dict()
    assert DrafterConfig.from_dict(json.loads(json.dumps(d))) == tiny_cfg()
