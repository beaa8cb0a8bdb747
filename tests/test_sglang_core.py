"""The plugin's pure-torch core: split, stitch, reject, write -- with real tensors.

Every test builds ground-truth per-request hidden states first, packs them the way SGLang packs an
EXTEND forward (rows of several requests back to back, padding rows at the end), feeds the core,
and compares what it wrote with the ground truth.
"""

from __future__ import annotations

import json

import pytest
import torch

from eyas.sglang import core
from eyas.sglang.core import CaptureCore, DumpWriter, ForwardInfo, make_rid, parse_rid, read_dump, write_dump

A, H = 3, 8


def truth(L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "aux": torch.randn(L, A, H, generator=g),
        "final": torch.randn(L, H, generator=g),
        "ids": torch.randint(0, 1000, (L,), generator=g),
    }


def pack(pieces, *, pad: int = 0, aux_as_list: bool = False, **ranks) -> ForwardInfo:
    """pieces: (rid, state dict, prefix, length); returns the packed forward."""
    aux, final, pos, ids = [], [], [], []
    for _, st, p, n in pieces:
        aux.append(st["aux"][p : p + n]), final.append(st["final"][p : p + n])
        pos.append(torch.arange(p, p + n)), ids.append(st["ids"][p : p + n])
    if pad:
        aux.append(torch.full((pad, A, H), float("nan"))), final.append(torch.full((pad, H), float("nan")))
        pos.append(torch.zeros(pad, dtype=torch.long)), ids.append(torch.zeros(pad, dtype=torch.long))
    aux_TAD = torch.cat(aux)
    return ForwardInfo(
        rids=[r for r, *_ in pieces],
        extend_prefix_lens=[p for _, _, p, _ in pieces],
        extend_seq_lens=[n for *_, n in pieces],
        aux=[aux_TAD[:, a] for a in range(A)] if aux_as_list else aux_TAD,
        final_TD=torch.cat(final),
        positions_T=torch.cat(pos),
        input_ids_T=torch.cat(ids),
        **ranks,
    )


def assert_matches(sample, st):
    assert sample.status == "complete", sample.reason
    torch.testing.assert_close(sample.aux_LAD, st["aux"], rtol=0, atol=0)
    torch.testing.assert_close(sample.final_LD, st["final"], rtol=0, atol=0)
    assert torch.equal(sample.input_ids_L, st["ids"])
    assert torch.equal(sample.positions_L, torch.arange(st["final"].shape[0]))


def test_rid_round_trip_and_foreign_rids():
    rid = make_rid(37, "job1-5-0")
    assert rid == "eyas.37.job1-5-0" and parse_rid(rid) == 37
    assert parse_rid("3f2a9c") is None and parse_rid(None) is None and parse_rid("eyas.x.tag") is None
    with pytest.raises(ValueError):
        make_rid(5, "bad/tag")
    assert core.sglang_layer_ids([2, 15, 27]) == [1, 14, 26]
    assert core.eyas_layer_ids([1, 14, 26]) == [2, 15, 27]


@pytest.mark.parametrize("aux_as_list", [False, True])
def test_several_requests_in_one_forward_with_padding(aux_as_list):
    a, b, c = truth(5, 1), truth(3, 2), truth(4, 3)
    ra, rb = make_rid(5, "a"), make_rid(3, "b")
    info = pack([(ra, a, 0, 5), ("not-ours", c, 0, 4), (rb, b, 0, 3)], pad=4, aux_as_list=aux_as_list)
    out = CaptureCore().observe(info)
    assert [s.rid for s in out] == [ra, rb]
    assert_matches(out[0], a)
    assert_matches(out[1], b)
    assert out[0].pieces == 1 and out[0].positions_covered == [[0, 5]]


def test_chunked_prefill_interleaved_across_forwards():
    a, b, c = truth(10, 4), truth(3, 5), truth(6, 6)
    ra, rb, rc = make_rid(10, "a"), make_rid(3, "b"), make_rid(6, "c")
    cc = CaptureCore()
    f1 = cc.observe(pack([(ra, a, 0, 4), (rc, c, 0, 2)], pad=2))
    f2 = cc.observe(pack([(rb, b, 0, 3), (ra, a, 4, 4), ("other", truth(8, 9), 7, 1)], pad=0))
    assert f1 == [] and [s.rid for s in f2] == [rb]
    assert sorted(cc.pending_rids()) == sorted([ra, rc])
    f3 = cc.observe(pack([(rc, c, 2, 4), (ra, a, 8, 2)], pad=6))
    got = {s.rid: s for s in f3}
    assert_matches(got[ra], a)
    assert_matches(got[rc], c)
    assert got[ra].pieces == 3 and got[ra].positions_covered == [[0, 4], [4, 8], [8, 10]]
    assert cc.pending_rids() == []


def test_prefix_cache_hit_is_rejected_and_never_completed():
    a = truth(8, 7)
    ra = make_rid(8, "hit")
    cc = CaptureCore()
    out = cc.observe(pack([(ra, a, 5, 3)]))  # 5 tokens came from the radix cache
    assert len(out) == 1 and out[0].status == "rejected"
    assert "prefix 5" in out[0].reason and "prefix cache" in out[0].reason
    assert out[0].aux_LAD is None
    # a later piece of the same prompt must not resurrect it
    assert cc.observe(pack([(ra, a, 6, 2)])) == []
    assert cc.stats["rejected"] == 1 and cc.stats["complete"] == 0
    # the same rid sent again and prefilled from 0 (a client's rerun) is captured whole
    assert_matches(cc.observe(pack([(ra, a, 0, 8)]))[0], a)


def test_non_writer_ranks_write_nothing_and_touch_no_tensor():
    a = truth(4, 8)
    ra = make_rid(4, "tp")

    class Poison(list):
        def __getitem__(self, k):
            raise AssertionError("a non-writer rank read the tensors")

    for ranks in ({"attn_tp_rank": 1}, {"attn_tp_rank": 3}, {"pp_rank": 0, "pp_size": 2}):
        info = pack([(ra, a, 0, 4)], **ranks)
        info.aux = Poison([info.aux])
        assert CaptureCore().observe(info) == []
    out = CaptureCore().observe(pack([(ra, a, 0, 4)], attn_tp_rank=0, pp_rank=1, pp_size=2))
    assert_matches(out[0], a)


def test_inconsistent_forwards_are_rejected():
    a = truth(6, 10)
    ra = make_rid(6, "x")
    # rows hold other positions than the forward claims: found once the copies have landed, before writing
    info = pack([(ra, a, 0, 6)])
    info.positions_T = torch.arange(6) + 1
    s = CaptureCore().observe(info)[0].settle()
    assert s.status == "rejected" and "positions [1, 2, 3, 4]" in s.reason and s.aux_pieces == []
    cc = CaptureCore()  # in the second piece of a chunked prompt
    cc.observe(pack([(ra, a, 0, 3)]))
    info = pack([(ra, a, 3, 3)])
    info.positions_T = torch.tensor([3, 5, 4])
    s = cc.observe(info)[0].settle()
    assert s.status == "rejected" and "prefix 3, length 3" in s.reason
    # fewer rows than tokens (rows scattered over ranks)
    info = pack([(ra, a, 0, 6)])
    info.final_TD = info.final_TD[:3]
    assert "rows" in CaptureCore().observe(info)[0].reason
    # a gap between pieces
    cc = CaptureCore()
    cc.observe(pack([(ra, a, 0, 2)]))
    assert "does not continue" in cc.observe(pack([(ra, a, 3, 3)]))[0].reason
    # more positions than the rid says
    rb = make_rid(4, "y")
    assert "4 prompt tokens" in CaptureCore().observe(pack([(rb, a, 0, 6)]))[0].reason


def test_restart_from_zero_and_stale_eviction():
    a = truth(6, 11)
    ra = make_rid(6, "r")
    cc = CaptureCore(stale_after_s=10)
    cc.observe(pack([(ra, a, 0, 3)]), now=0.0)
    assert cc.observe(pack([(ra, a, 0, 6)]), now=1.0)[0].status == "complete"  # re-prefilled whole
    rb = make_rid(6, "s")
    cc.observe(pack([(rb, a, 0, 2)]), now=2.0)
    out = cc.observe(pack([("other", a, 0, 1)]), now=20.0)  # rb aborted: evicted with a reason
    assert [s.rid for s in out] == [rb] and "2 of 6 positions" in out[0].reason


def test_write_and_read_dump_round_trip_bf16(tmp_path):
    a = truth(7, 12)
    a["aux"], a["final"] = a["aux"].bfloat16(), a["final"].bfloat16()
    s = CaptureCore().observe(pack([(make_rid(7, "w"), a, 0, 7)]))[0]
    path = write_dump(tmp_path, s, layer_ids=[2, 4, 5], writer={"attn_tp_rank": 0})
    d = read_dump(path)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["num_tokens"] == 7 and meta["layer_ids"] == [2, 4, 5] and meta["sglang_layer_ids"] == [1, 3, 4]
    assert meta["convention"] == "hf-input" and meta["dtype"] == "bfloat16" and meta["shapes"]["aux"] == [7, A, H]
    assert (
        d.aux_LAD.dtype == torch.bfloat16 and torch.equal(d.aux_LAD, a["aux"]) and torch.equal(d.final_LD, a["final"])
    )
    assert torch.equal(d.input_ids_L, a["ids"])
    assert [p.name for p in tmp_path.iterdir()] == [s.rid]  # no temporary left behind


def test_failed_write_leaves_no_partial_dump(tmp_path, monkeypatch):
    import os

    a = truth(4, 13)
    s = CaptureCore().observe(pack([(make_rid(4, "f"), a, 0, 4)]))[0]
    real_writev, calls = os.writev, []

    def full_disk(fd, buffers):  # the first call writes a little, the next finds the disk full
        calls.append(len(buffers))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_writev(fd, [bytes(buffers[0])[:5]])

    monkeypatch.setattr(os, "writev", full_disk)
    w = DumpWriter(tmp_path, layer_ids=[1, 2, 3])
    w.submit([s])
    assert len(calls) == 2 and w.written == 0 and "No space left" in w.errors[0]
    assert list(tmp_path.iterdir()) == []


def test_dump_is_standard_safetensors_written_piece_by_piece(tmp_path, monkeypatch):
    # the plugin writes the file itself (GIL-free writev, pieces back to back): the safetensors package
    # must read it as its own, whatever the dtype, and short writes must be continued, not lost
    import os

    from safetensors import safe_open

    real_writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real_writev(fd, [bytes(bufs[0])[:997]]))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = truth(11, 16)
        a["aux"], a["final"] = a["aux"].to(dtype), a["final"].to(dtype)
        rid = make_rid(11, f"st-{str(dtype)[6:]}")
        cc = CaptureCore()
        cc.observe(pack([(rid, a, 0, 4)]))
        cc.observe(pack([(rid, a, 4, 5)]))
        s = cc.observe(pack([(rid, a, 9, 2)]))[0]
        assert len(s.aux_pieces) == len(s.final_pieces) == 3  # never stitched on the server's thread
        path = write_dump(tmp_path, s, layer_ids=[2, 4, 5])
        with safe_open(str(path / core.TENSORS_FILE), framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has keys(), no iteration)
        assert sorted(got) == ["aux", "final", "input_ids", "positions"]
        assert got["aux"].dtype == dtype and torch.equal(got["aux"], a["aux"]) and torch.equal(got["final"], a["final"])
        assert torch.equal(got["input_ids"], a["ids"]) and torch.equal(got["positions"], torch.arange(11))
        meta = json.loads((path / "meta.json").read_text())
        assert meta["shapes"] == {"aux": [11, A, H], "final": [11, H], "input_ids": [11], "positions": [11]}
        assert meta["pieces"] == 3 and meta["positions_covered"] == [[0, 4], [4, 9], [9, 11]]
        assert meta["dtype"] == str(dtype)[6:]


def test_rejected_dump_has_reason_and_no_tensors(tmp_path):
    s = CaptureCore().observe(pack([(make_rid(8, "rej"), truth(8, 14), 5, 3)]))[0]
    w = DumpWriter(tmp_path, layer_ids=[1, 2, 3], threads=2)
    w.submit([s])
    w.flush()
    d = read_dump(tmp_path / s.rid)
    assert d.status == "rejected" and "prefix 5" in d.meta["reason"] and d.aux_LAD is None
    assert not (tmp_path / s.rid / core.TENSORS_FILE).exists()


def test_writer_close_flushes_and_ends_its_threads(tmp_path):
    import threading

    before = {th.ident for th in threading.enumerate()}
    w = DumpWriter(tmp_path, layer_ids=[1, 2, 3], threads=3)
    mine = [th for th in threading.enumerate() if th.ident not in before and th.name.startswith("eyas-dump-writer")]
    assert len(mine) == 3
    samples = [CaptureCore().observe(pack([(make_rid(8, f"c{i}"), truth(8, 14), 0, 8)]))[0] for i in range(5)]
    w.submit(samples[:4])
    w.close()
    assert w.written == 4 and not any(th.is_alive() for th in mine)
    w.submit(samples[4:])  # after close: written on the caller's thread, not lost
    w.close()
    assert w.written == 5 and sorted(p.name for p in tmp_path.iterdir()) == sorted(s.rid for s in samples)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_matches_isfinite(dtype):
    x = torch.randn(50, 7).to(dtype) * 100
    assert core.all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[13, 4] = bad
        assert not core.all_finite(y) and not bool(torch.isfinite(y).all())
    assert core.all_finite(torch.tensor([65504.0], dtype=dtype))  # largest fp16, finite everywhere
    # one bad value anywhere in a tensor as large as a sample (vectorised and threaded reductions, their tails)
    big = torch.randn(700, 4, 576).to(dtype)
    flat = big.view(-1)
    for i in (0, 1, 7, 8, 15, 16, 31, 32767, 32768, 65535, flat.numel() // 2, flat.numel() - 2, flat.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            saved = flat[i].clone()
            flat[i] = bad
            assert not core.all_finite(big) and not core.all_finite(big.transpose(0, 1)), (i, bad)  # contiguous or not
            flat[i] = saved
    assert core.all_finite(big) and core.all_finite(torch.empty(0, 4, dtype=dtype))


def test_completed_samples_never_alias_the_servers_buffers():
    a = truth(5, 15)
    info = pack([(make_rid(5, "alias"), a, 0, 5)])
    out = CaptureCore().observe(info)[0]
    info.aux.fill_(7.0), info.final_TD.fill_(7.0), info.input_ids_T.fill_(7)  # the server reuses its buffers
    assert_matches(out, a)


def test_the_writer_waits_for_host_copies_still_in_flight(tmp_path):
    # from a GPU the rows land in host memory after observe returns (a CUDA event marks it): a writer that
    # did not wait would write whatever the buffers held before
    a = truth(5, 17)
    # (positions and token ids too: they are checked only once they have landed, never in the forward)
    s = CaptureCore().observe(pack([(make_rid(5, "late"), a, 0, 5)]))[0]
    copies = s.aux_pieces + s.final_pieces + s.ids_pieces + s.pos_pieces
    landed = [t.clone() for t in copies]
    for t in copies:
        t.zero_()

    class CopyDone:  # what torch.cuda.Event offers the writer
        def synchronize(self):
            for t, src in zip(copies, landed):
                t.copy_(src)

    s.ready = [CopyDone()]
    d = read_dump(write_dump(tmp_path, s, layer_ids=[1, 2, 3]))
    assert d.status == "complete" and s.ready == []
    assert torch.equal(d.aux_LAD, a["aux"]) and torch.equal(d.final_LD, a["final"])
    assert torch.equal(d.input_ids_L, a["ids"]) and torch.equal(d.positions_L, torch.arange(5))
