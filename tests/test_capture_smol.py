"""Integration on the real SmolLM2-135M: capture a handful of chats, verify with default tolerances,
and check those tolerances still catch a shifted row and a neighbouring layer on real activations."""

from __future__ import annotations

import pytest
import torch

from eyas.capture.run import CaptureSettings, run_capture
from eyas.data.prepared import write_prepared
from eyas.errors import CheckFailed
from eyas.store import StoreReader, StoreSpec, StoreWriter
from eyas.store.verify import verify_store
from eyas.target import load_target, reference_hidden_states, tokenizer_hash

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHATS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a prime number.", "Seven is a prime number."),
    ("Say hello in Spanish.", "Hola!"),
    ("What colour is the sky?", "The sky is usually blue."),
]


@pytest.fixture(scope="module")
def smol_prepared(tmp_path_factory, smol_dir, smol_tokenizer):
    rows = []
    for i, (q, a) in enumerate(CHATS):
        ids = smol_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=True, return_dict=False
        )
        rows.append((f"chat{i}", ids, [True] * len(ids)))
    out = tmp_path_factory.mktemp("smol") / "prepared"
    return write_prepared(out, {"train": rows}, {"tokenizer_hash": tokenizer_hash(smol_tokenizer)})


@pytest.mark.parametrize("dtype,model_dtype", [("bf16", "fp32"), ("fp8", "fp32"), ("bf16", "bf16")])
def test_smol_capture_verifies(tmp_path, smol_prepared, dtype, model_dtype):
    s = run_capture(
        CaptureSettings(
            target="default",
            data=smol_prepared,
            out=tmp_path / "s",
            store_dtype=dtype,
            model_dtype=model_dtype,
            token_budget=128,
        )
    )
    assert s["samples"] == 4 and s["aux_layer_ids"] == [2, 15, 27] and s["hidden_size"] == 576
    v = verify_store(tmp_path / "s", numbers=4)
    assert v["ok"] and v["numbers"]["worst_rel_err"] < v["numbers"]["tolerance"] / 2


def test_smol_default_tolerance_catches_shift_and_neighbour_layer(tmp_path, smol_prepared):
    run_capture(
        CaptureSettings(
            target="default", data=smol_prepared, out=tmp_path / "good", store_dtype="fp8", token_budget=128
        )
    )
    r = StoreReader(tmp_path / "good")
    m = r.manifest
    spec = StoreSpec(
        **{
            k: m[k]
            for k in (
                "aux_layer_ids",
                "hidden_size",
                "dtype",
                "convention",
                "target",
                "tokenizer_hash",
                "prepared",
                "model_dtype",
                "producer",
            )
        }
    )
    model = load_target("default")
    from eyas.data.prepared import PreparedDataset

    split = PreparedDataset(smol_prepared).split("train")
    with StoreWriter(tmp_path / "bad", spec) as w:
        for i, sid in enumerate(r.sample_ids):
            h = r.get_hidden(sid, torch.float32)
            if i == 0:  # rows shifted by one position
                h = torch.cat([h[1:], h[-1:]])
            elif i == 1:  # the mid aux slot from layer 16 instead of 15
                aux, _ = reference_hidden_states(model, split[split.index_of(sid)].input_ids, layer_ids=[16])
                h[:, 1] = aux[:, 0]
            w.add(sid, h[:, :-1], h[:, -1])
        w.close(complete=True)
    with pytest.raises(CheckFailed) as info:  # fp8 store: the loosest default tolerance for an fp32 target
        verify_store(tmp_path / "bad", numbers=4)
    assert sorted(info.value.summary["numbers"]["failing_samples"]) == sorted(r.sample_ids[:2])
