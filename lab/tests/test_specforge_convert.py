"""lab/scripts/specforge_convert.py: an eyas store written in SpecForge 0.2.0's offline EAGLE-3 format.

The files are read back the way SpecForge's offline trainer reads them (sorted `*.ckpt` names,
`torch.load`, keys and shapes of process_offline_eagle3_sample); when the `specforge` package is
importable, with its own loader too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from eyas.capture.run import CaptureSettings, run_capture
from eyas.target import load_tokenizer, tokenizer_hash
from eyas.train.data import open_store, store_order
from lab.tests.conftest import load_script
from tests.test_capture_run import make_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _module():
    return load_script("specforge_convert")


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("sfstore")
    prepared = make_prepared(root / "prepared", tokenizer_hash(load_tokenizer(tiny_target_dir)), n=5)
    run_capture(
        CaptureSettings(
            target=str(tiny_target_dir),
            data=prepared,
            out=root / "store",
            token_budget=64,
            shard_bytes=20_000,
            store_dtype="bf16",
        )
    )
    return root / "store"


def test_store_converts_to_specforge_offline_files(tmp_path, tiny_store, tiny_target_dir):
    mod = _module()
    out = tmp_path / "sf"
    man = mod.convert(tiny_store, out, max_length=30)
    reader, split, store_man = open_store(tiny_store)
    order = store_order(reader, split)
    files = sorted(out.glob("*.ckpt"))
    assert len(files) == len(order) == man["samples"] == 5
    H = int(store_man["hidden_size"])
    total = 0
    for path, idx in zip(files, order):  # SpecForge's order (sorted names) is the store's order
        s = split[idx]
        rec = torch.load(path, weights_only=False, mmap=True)
        assert set(rec) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        T = min(len(s.input_ids), 30)
        total += T
        assert rec["input_ids"].dtype == torch.long and rec["input_ids"].shape == (T,)
        assert rec["loss_mask"].dtype == torch.long and rec["loss_mask"].shape == (T,)
        assert rec["aux_hidden_state"].dtype == torch.bfloat16 and rec["aux_hidden_state"].shape == (1, T, 3 * H)
        assert rec["hidden_state"].dtype == torch.bfloat16 and rec["hidden_state"].shape == (1, T, H)
        assert rec["input_ids"].tolist() == torch.as_tensor(s.input_ids[:T]).tolist()
        assert rec["loss_mask"].tolist() == [int(bool(m)) for m in torch.as_tensor(s.loss_mask[:T]).tolist()]
        aux, final = reader.get(s.id, dtype=torch.bfloat16)
        # low | mid | high concatenated along the width, in the store's aux order
        for a in range(3):
            torch.testing.assert_close(rec["aux_hidden_state"][0, :, a * H : (a + 1) * H], aux[:T, a], rtol=0, atol=0)
        torch.testing.assert_close(rec["hidden_state"][0], final[:T], rtol=0, atol=0)
    assert man["tokens"] == total
    assert json.loads((out / "eyas_convert.json").read_text())["sample_ids"] == [split[i].id for i in order]

    if importlib.util.find_spec("specforge") is not None:  # SpecForge's own reader, when installed
        from specforge.data.preprocessing import process_offline_eagle3_sample
        from specforge.runtime.data_plane.feature_store import load_feature_file
        from specforge.runtime.data_plane.offline_reader import list_feature_files

        listed = list_feature_files(str(out))
        assert [Path(p).name for p in listed] == [p.name for p in files]
        sample = process_offline_eagle3_sample(load_feature_file(listed[0]), max_len=2048)
        assert sample["hidden_state"].shape[-1] == 3 * H and sample["target"].shape[-1] == H

    # a rerun keeps what is there; a different conversion in the same directory is refused
    before = files[0].stat().st_mtime_ns
    mod.convert(tiny_store, out, max_length=30)
    assert files[0].stat().st_mtime_ns == before
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="holds a conversion"):
        mod.convert(tiny_store, out, max_length=10)


def test_vocab_mapping_matches_the_drafter(tmp_path, tiny_target_dir):
    from transformers import AutoConfig

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_target_dir), draft_vocab_size=16)
    drafter = Eagle3Drafter(cfg)
    drafter.reset_parameters(seed=0)
    used = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181])
    drafter.set_vocab(used)
    drafter.save(tmp_path / "drafter")
    path = _module().write_vocab_mapping(tmp_path / "drafter", tmp_path / "vocab_mapping.pt")
    vm = torch.load(path)
    assert vm["d2t"].dtype == torch.long and vm["t2d"].dtype == torch.bool
    assert (torch.arange(16) + vm["d2t"]).tolist() == used.tolist()  # target = draft + d2t[draft]
    assert vm["t2d"].nonzero().flatten().tolist() == used.tolist() and vm["t2d"].numel() == cfg.vocab_size
