"""Batched, padded capture equals the unbatched reference on tiny Llama, Qwen2, Qwen3, DeepSeek-V3."""

from __future__ import annotations

import pytest
import torch

from eyas.capture.batching import make_batch
from eyas.capture.hooks import forward_capture_packed
from eyas.store.format import dequantize
from eyas.target import forward_capture, load_target, reference_hidden_states
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["llama", "qwen2", "qwen3", "deepseek_v3"]
LAYERS = [1, 3, 4]  # of 6
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}  # worst per-token relative error


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smol_tokenizer):
    return {f: make_tiny_target(tmp_path_factory.mktemp(f), smol_tokenizer, family=f) for f in FAMILIES}


def rel_err(a, b):
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_capture_matches_unbatched_reference(family_dirs, family, model_dtype):
    model = load_target(family_dirs[family], dtype=model_dtype)
    g = torch.Generator().manual_seed(1)
    lengths = [23, 7, 16, 1]
    seqs = [torch.randint(0, model.config.vocab_size, (t,), generator=g) for t in lengths]
    batch = make_batch([str(i) for i in range(4)], seqs, pad_token_id=0)
    store_dtype = "fp32" if model_dtype == torch.float32 else "bf16"
    hidden, scale = forward_capture_packed(
        model, batch.input_ids_BT, None, batch.rows_index, layer_ids=LAYERS, dtype=store_dtype
    )
    assert hidden.shape == (sum(lengths), len(LAYERS) + 1, model.config.hidden_size) and scale is None
    # Right padding without a mask: pad rows follow the real ones, which causal attention never lets
    # them see. The simple hook path (stack, then keep the real rows) agrees exactly with the packed one.
    aux_BTAD, final_BTD = forward_capture(model, batch.input_ids_BT, None, layer_ids=LAYERS)
    simple = torch.cat([aux_BTAD, final_BTD.unsqueeze(2)], dim=2).reshape(-1, len(LAYERS) + 1, hidden.shape[-1])[
        batch.rows_index
    ]
    assert torch.equal(simple.to(hidden.dtype), hidden)
    start = 0
    for seq in seqs:
        aux, final = reference_hidden_states(model, seq, layer_ids=LAYERS)
        ref = torch.cat([aux, final.unsqueeze(1)], dim=1)
        assert rel_err(hidden[start : start + len(seq)], ref) < TOL[model_dtype], family
        start += len(seq)


def test_fp8_packed_capture_within_quantisation_error(family_dirs):
    model = load_target(family_dirs["deepseek_v3"], dtype=torch.float32)
    seqs = [torch.arange(5, 30), torch.arange(100, 112)]
    batch = make_batch(["a", "b"], seqs)
    hidden, scale = forward_capture_packed(
        model, batch.input_ids_BT, None, batch.rows_index, layer_ids=LAYERS, dtype="fp8"
    )
    assert hidden.dtype == torch.float8_e4m3fn and scale.shape == (37, 4)
    aux, final = reference_hidden_states(model, seqs[1], layer_ids=LAYERS)
    err = rel_err(dequantize(hidden[25:], scale[25:], torch.float32), torch.cat([aux, final.unsqueeze(1)], 1))
    assert 1e-3 < err < 0.08  # quantised (not bit-exact), within e4m3's error


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_and_verify_end_to_end_bf16(tmp_path, family_dirs, family):
    """The whole path per family with the target in bf16: batches, pipeline, store, verify."""
    from eyas.capture.run import CaptureSettings, run_capture
    from eyas.store.verify import verify_store
    from eyas.target import load_tokenizer, tokenizer_hash
    from tests.test_capture_run import make_prepared

    data = make_prepared(tmp_path / "p", tokenizer_hash(load_tokenizer(family_dirs[family])), n=6, max_len=30)
    s = run_capture(
        CaptureSettings(
            target=str(family_dirs[family]),
            data=data,
            out=tmp_path / "s",
            aux_layers=LAYERS,
            model_dtype="bf16",
            token_budget=48,
            shard_bytes=4000,
        )
    )
    assert s["samples"] == 6 and s["model_dtype"] == "bf16" and s["batches"] > 1
    v = verify_store(tmp_path / "s", numbers=6)
    assert v["ok"] and v["numbers"]["checked"] == 6
