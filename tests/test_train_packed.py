"""The fast training path (packed rows, supervised rows only, fused chunked head loss) against the
plain reference (`ttt_loss` on right-padded rows with materialised teacher probabilities)."""

from __future__ import annotations

import pytest
import torch

from eyas import kernels
from eyas.drafter.ttt import (
    Teacher,
    TTTConfig,
    fast_attention,
    head_soft_ce,
    head_soft_ce_ranges,
    live_positions,
    packed_teacher,
    reference_attention,
    reference_head_soft_ce,
    step_denominators,
    supervised_rows,
    ttt_loss,
    ttt_loss_packed,
)
from eyas.packing import Segments, pad_lengths
from tests.test_drafter_ttt import tiny_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, V = 32, 60


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, V, (n,), generator=g)
        mask = torch.rand(n, generator=g) > 0.3
        aux = torch.randn(n, 3, D, generator=g)
        final = torch.randn(n, D, generator=g)
        out.append((ids, mask, aux, final))
    return out


def _pad(xs):
    T = max(x.shape[0] for x in xs)
    out = xs[0].new_zeros((len(xs), T, *xs[0].shape[1:]))
    for i, x in enumerate(xs):
        out[i, : x.shape[0]] = x
    return out


def _head(seed=7, Vt=80):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(Vt, D, generator=g) * 0.7


def _packed_on(dev, lengths, *, K, seed):
    """Samples packed in one row on `dev` as the data loader hands them over: (ids, seg, rows, live, aux, final,
    denominators), plus the target head, a draft vocab missing some target ids and its t2d mask."""
    from eyas.train.batches import pack_tokens
    from eyas.train.data import Item

    samples = _samples(lengths, seed=seed)
    items = [Item(str(i), s[0], s[1]) for i, s in enumerate(samples)]
    ids, _, seg, rows = pack_tokens(items, steps=K, pad_to=None)
    live = live_positions(rows, seg.total)
    assert live.numel() < seg.total
    aux = torch.cat([s[2] for s in samples]).to(dev)
    final = torch.cat([s[3] for s in samples]).to(dev)
    ids, seg, rows, live = ids.to(dev), seg.to(dev), [r.to(dev) for r in rows], live.to(dev)
    den = torch.tensor([float(len(r)) for r in rows], dtype=torch.float64, device=dev)
    used = torch.arange(V, device=dev) + 5
    t2d = torch.zeros(80, dtype=torch.bool, device=dev)
    t2d[used] = True
    return ids, seg, rows, live, aux, final, den, _head().to(dev), used, t2d


@pytest.mark.parametrize("kernel", ["math", "segments", "cpu-flash"])
def test_varlen_attention_matches_block_diagonal_reference(kernel):
    g = torch.Generator().manual_seed(0)
    seg = Segments.from_lengths([5, 1, 9, 4])
    mk = lambda h: torch.randn(1, h, 19, 8, generator=g).requires_grad_()  # noqa: E731
    q, ks, vs = mk(4), [mk(2) for _ in range(3)], [mk(2) for _ in range(3)]  # 2 key/value heads for 4 query heads
    dout = torch.randn(1, 4, 19, 8, generator=g)
    ref = reference_attention(q, ks, vs, seg=seg)
    fast = fast_attention(q, ks, vs, seg=seg, kernel=kernel)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    gr = torch.autograd.grad(ref, [q, *ks, *vs], dout)
    gf = torch.autograd.grad(fast, [q, *ks, *vs], dout)
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and a query never sees another sample: changing sample 0's keys leaves sample 2's output alone
    ks2 = [k.detach().clone() for k in ks]
    ks2[0][:, :, :5] += 10
    out2 = fast_attention(q.detach(), ks2, [v.detach() for v in vs], seg=seg, kernel=kernel)
    torch.testing.assert_close(out2[:, :, 6:], fast.detach()[:, :, 6:])
    assert not torch.allclose(out2[:, :, :5], fast.detach()[:, :, :5])


@pytest.mark.parametrize("kernel", ["math", "segments", "cpu-flash", "reference"])
def test_attention_on_some_query_rows_equals_the_full_attention_there(kernel):
    """`rows=`: queries and diagonal keys/values at 9 of 19 positions, step-0 keys at all: the output and every
    gradient equal the full attention's at those rows (whatever the other rows' queries and diagonals hold), with
    the output gradient zero elsewhere."""
    g = torch.Generator().manual_seed(5)
    seg = Segments.from_lengths([5, 1, 9, 4])
    rows = torch.tensor([0, 2, 3, 5, 7, 8, 12, 16, 18])
    mk = lambda h, n: torch.randn(1, h, n, 8, generator=g).requires_grad_()  # noqa: E731
    q, k0, v0 = mk(4, 9), mk(2, 19), mk(2, 19)
    kd, vd = [mk(2, 9) for _ in range(2)], [mk(2, 9) for _ in range(2)]
    dout = torch.randn(1, 4, 9, 8, generator=g)

    def full(x):  # x at `rows`, noise elsewhere
        base = torch.randn(1, x.shape[1], 19, 8, generator=g)
        return base.index_copy(2, rows, x)

    ref = reference_attention(
        full(q), [k0] + [full(k) for k in kd], [v0] + [full(v) for v in vd], seg=seg
    ).index_select(2, rows)
    if kernel == "reference":
        out = reference_attention(q, [k0, *kd], [v0, *vd], seg=seg, rows=rows)
    else:
        out = fast_attention(q, [k0, *kd], [v0, *vd], seg=seg, kernel=kernel, rows=rows)
    assert out.shape == (1, 4, 9, 8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    leaves = [q, k0, v0, *kd, *vd]
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_live_positions_are_the_rows_of_any_step_and_travel_with_the_batch():
    """The union of the steps' rows, sorted; a packed batch made on the host carries it, and `_packed_to` too."""
    from eyas.train.batches import PackedBatch, _packed_to, pack_tokens
    from eyas.train.data import Item

    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    seg = Segments.from_lengths([4, 3, 4])
    rows = supervised_rows(mask, seg.ends_N, 3)
    assert live_positions(rows, 11).tolist() == [0, 1, 4, 7, 8]
    items = [
        Item("a", torch.arange(4), mask[:4]),
        Item("b", torch.arange(3), mask[4:7]),
        Item("c", torch.arange(4), mask[7:]),
    ]
    ids, m, seg2, rows2 = pack_tokens(items, steps=3, pad_to=None)
    b = PackedBatch(ids, seg2, rows2, torch.zeros(11, 3, D), torch.zeros(11, D), 11, 11, int(m.sum()))
    assert b.live.tolist() == [0, 1, 4, 7, 8]
    assert _packed_to(b, "cpu").live.tolist() == [0, 1, 4, 7, 8]


def test_chunked_head_loss_and_grads_equal_plain_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    f, wt = torch.randn(37, D, generator=g), torch.randn(V, D, generator=g)
    weight = torch.rand(37, generator=g) > 0.2
    top = (f @ wt.T).argmax(-1)
    ref = reference_head_soft_ce(x, w, f, wt, weight)
    gx, gw = torch.autograd.grad(ref * 0.37, [x, w])
    tot, hits = head_soft_ce(x, w, f, wt, weight, top, chunk_rows=8)
    fx, fw = torch.autograd.grad(tot * 0.37, [x, w])
    torch.testing.assert_close(tot, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fx, gx, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fw, gw, atol=1e-5, rtol=1e-4)
    assert torch.equal(hits, (x @ w.T).argmax(-1) == top)


def test_head_weight_gradient_sums_into_fp32_without_losing_the_fallback(monkeypatch):
    """addmm_fp32_: fp32 inputs sum in place; 16-bit inputs sum inside the matmul only where the backend's
    out_dtype addmm passes its check (not on the CPU: no such kernel), else through the product's fp32 copy;
    a backend whose out_dtype addmm sums wrongly is caught by the check."""
    import eyas.drafter.ttt as ttt

    g = torch.Generator().manual_seed(3)
    acc = torch.randn(6, 5, generator=g)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)
    want = acc + a.T @ b
    ttt.addmm_fp32_(acc, a.T, b)
    torch.testing.assert_close(acc, want)
    acc16 = torch.randn(6, 5, generator=g)
    want16 = acc16 + (a.bfloat16().T @ b.bfloat16()).float()
    ttt.addmm_fp32_(acc16, a.bfloat16().T, b.bfloat16())
    assert acc16.dtype == torch.float32 and torch.equal(acc16, want16)
    assert kernels.checked()[("addmm_fp32", "cpu", torch.bfloat16)] is not None

    def wrong(acc, a, b, *, out_dtype, out):  # a kernel that overwrites instead of summing
        return out.copy_(a.float() @ b.float())

    monkeypatch.setattr(torch, "addmm", wrong)
    assert "sums differently" in ttt.check_addmm_fp32(torch.device("cpu"), torch.bfloat16)


def test_head_loss_over_ranges_equals_one_call_per_range():
    """Several row ranges (the TTT steps) in one call: the same total, per-range sums and gradients
    as one call per range, chunks never crossing a range (chunk 8 does not divide the ranges)."""
    g = torch.Generator().manual_seed(3)
    lengths = [13, 0, 7, 11]
    n = sum(lengths)
    x = torch.randn(n, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    f, wt = torch.randn(n, D, generator=g), torch.randn(V, D, generator=g)
    weight = (torch.rand(n, generator=g) > 0.2).float() * torch.rand(n, generator=g)
    top = (f @ wt.T).argmax(-1)
    total, per_range, hits = head_soft_ce_ranges(x, w, f, wt, weight, top, lengths, chunk_rows=8)
    gx, gw = torch.autograd.grad(total * 0.5, [x, w])
    sums, all_hits, a = [], [], 0
    for m in lengths:
        t, h = head_soft_ce(x[a : a + m], w, f[a : a + m], wt, weight[a : a + m], top[a : a + m], chunk_rows=8)
        sums.append(t)
        all_hits.append(h)
        a += m
    ref = torch.stack(sums)
    rx, rw = torch.autograd.grad(ref.sum() * 0.5, [x, w])
    torch.testing.assert_close(per_range, ref.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(total, ref.sum(), atol=1e-5, rtol=1e-6)
    assert not per_range.requires_grad and per_range[1] == 0
    assert torch.equal(hits, torch.cat(all_hits))
    torch.testing.assert_close(gx, rx, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="lengths sum to 30"):
        head_soft_ce_ranges(x, w, f, wt, weight, top, [30], chunk_rows=8)


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_teacher_computed_once_per_row_group_gives_the_per_step_result(chunk, monkeypatch):
    """The recomputed teacher's logits made once per group of teacher rows for every step that reads them give the
    same total, per-step sums, hits and gradients as the plain reference, step by step; the groups cover every row
    once, each slice inside its step's range with its teacher rows inside the group."""
    import eyas.drafter.ttt as ttt

    g = torch.Generator().manual_seed(5)
    N, K = 40, 4
    rows = [torch.sort(torch.randperm(N - 1 - k, generator=g)[: 25 - 3 * k]).values for k in range(K)]
    rows[2] = rows[2][:0]  # an empty step
    lengths = [int(r.numel()) for r in rows]
    tr = torch.cat([r + 1 + k for k, r in enumerate(rows)])
    n = sum(lengths)
    x = torch.randn(n, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    f, wt = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    weight = (torch.rand(n, generator=g) > 0.2).float() * torch.rand(n, generator=g)
    top = (f @ wt.T).argmax(-1)[tr]

    groups = ttt.teacher_groups(tr, lengths, N, chunk)
    starts = [sum(lengths[:i]) for i in range(K + 1)]
    covered = []
    for t_lo, t_hi, slices in groups:
        assert 0 <= t_lo < t_hi <= N and t_hi - t_lo <= chunk
        for i, a, b in slices:
            assert starts[i] <= a < b <= starts[i + 1] and b - a <= chunk
            assert bool(((tr[a:b] >= t_lo) & (tr[a:b] < t_hi)).all())
            covered += range(a, b)
    assert sorted(covered) == list(range(n))
    # fewer teacher products than the per-step path's one per chunk of each step
    assert 0 < len(groups) <= -(-N // chunk) < sum(-(-m // chunk) for m in lengths)

    total, per, hits = head_soft_ce_ranges(x, w, f, wt, weight, top, lengths, chunk_rows=chunk, teacher_rows=tr)
    got = (total, *torch.autograd.grad(total * 0.5, [x, w]))
    ends = [sum(lengths[:i]) for i in range(K + 1)]
    ref_per = torch.stack(
        [reference_head_soft_ce(x[a:b], w, f[tr[a:b]], wt, weight[a:b]) for a, b in zip(ends[:-1], ends[1:])]
    )
    ref_total = ref_per.sum()
    want = (ref_total, *torch.autograd.grad(ref_total * 0.5, [x, w]))
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(per, ref_per.detach(), atol=1e-4, rtol=1e-5)
    assert torch.equal(hits, (x @ w.T).argmax(-1) == top)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-4)
    # a step whose teacher rows are not ascending, or a row past the table: no groups (the per-step path)
    assert ttt.teacher_groups(tr.flip(0), lengths[::-1], N, chunk) is None
    assert ttt.teacher_groups(torch.cat([tr[:-1], tr.new_tensor([N + 3])]), lengths, N, chunk) is None


def test_packed_loss_runs_the_head_once_for_all_steps(monkeypatch):
    """The packed TTT loss sends every step's rows through ONE head call (one [V, D] weight-gradient
    buffer), not one call per step."""
    from eyas.drafter.ttt import head_loss

    calls = []
    real = head_loss._HeadSoftCE.apply
    monkeypatch.setattr(head_loss._HeadSoftCE, "apply", lambda *a: calls.append(len(a[-3])) or real(*a))  # bounds
    K = 4
    samples = _samples([9, 14])
    m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V)
    used = torch.arange(V) + 5
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab(used)
    seg = Segments.from_lengths([9, 14])
    ids_N, mask_N = torch.cat([s[0] for s in samples]), torch.cat([s[1] for s in samples])
    aux_N, final_N = torch.cat([s[2] for s in samples]), torch.cat([s[3] for s in samples])
    rows = supervised_rows(mask_N, seg.ends_N, K)
    head = _head()
    pt = packed_teacher(final_N, head, head[used], used, t2d)
    den = torch.tensor([float(len(r)) for r in rows])
    out = ttt_loss_packed(
        m, input_ids_N=ids_N, seg=seg, rows=rows, aux_NAD=aux_N, teacher=pt, cfg=TTTConfig(steps=K), denominators=den
    )
    out.loss.backward()
    assert calls == [K] and sum(1 for r in rows if r.numel()) >= 3  # one call, one row range per step
    assert m.lm_head.weight.grad is not None and m.lm_head.weight.grad.abs().sum() > 0


def test_normed_rows_equal_the_drafter_norm_and_compile_for_any_row_count():
    """`normed_rows` is the drafter's RMSNorm of the selected rows (bitwise, eager; cast to a given dtype as the
    packed loss's buffer casts it), and its compiled form
    (as `compile_drafter` makes it, dynamic in the rows' count) gives the same values and gradients for two
    different counts (bf16 input, fp32 weight: the autocast layout of training)."""
    import eyas.drafter.ttt as ttt
    from eyas.drafter.model import RMSNorm

    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(D, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    h = torch.randn(50, D, generator=g).bfloat16().requires_grad_()
    rows = torch.sort(torch.randperm(50, generator=g)[:30]).values
    assert torch.equal(ttt.normed_rows(h, rows, norm.weight, norm.eps), norm(h.index_select(0, rows)))
    half = ttt.normed_rows(h, rows, norm.weight, norm.eps, torch.bfloat16)  # cast to the head's compute dtype
    assert half.dtype == torch.bfloat16 and torch.equal(half, norm(h.index_select(0, rows)).bfloat16())
    compiled = torch.compile(ttt.normed_rows, dynamic=True)
    for n in (30, 17):
        r = rows[:n]
        want = ttt.normed_rows(h, r, norm.weight, norm.eps)
        got = compiled(h, r, norm.weight, norm.eps)
        assert got.shape == (n, D) and got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        gw = torch.autograd.grad(want.square().sum(), [h, norm.weight])
        gg = torch.autograd.grad(got.square().sum(), [h, norm.weight])
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=2e-2)
        assert not gg[0][torch.ones(50, dtype=torch.bool).index_fill_(0, r, False)].any()  # rows not taken: no grad


def test_diagonal_merge_compiles_as_on_cuda_and_keeps_a_graph_per_diagonal_count(monkeypatch):
    """The merge over listed diagonal keys, compiled as `_fast` compiles it on CUDA, gives eager's out, lse and
    gradients (2 key/value heads for 6 query heads: the grouped reads); `_fast` raises dynamo's recompile limit so
    that one graph per diagonal count for packed rows and for dense batches (12 at TTT 7) never falls back to
    eager, as 8 did on an H200."""
    import torch._dynamo as dynamo

    from eyas.drafter.ttt import attention, compiled

    g = torch.Generator().manual_seed(6)
    B, H, K, T, d, J = 1, 6, 2, 20, 8, 2
    mk = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, out_c, lse_c, dout, dq_c = mk(B, H, T, d), mk(B, H, T, d), mk(B, H, T), mk(B, H, T, d), mk(B, H, T, d)
    kds, vds = [mk(B, K, T, d) for _ in range(J)], [mk(B, K, T, d) for _ in range(J)]
    out, lse = attention._merge_fwd(q, kds, vds, out_c, lse_c, 0.3)
    dq, dks, dvs = attention._merge_bwd(q, kds, vds, out, lse, dout, dq_c, 0.3)
    assert len(dks) == len(dvs) == J and dks[0].shape == kds[0].shape
    close = lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)  # noqa: E731
    o, o_lse = torch.compile(attention._merge_fwd, dynamic=True)(q, kds, vds, out_c, lse_c, 0.3)
    assert close(o, out) and close(o_lse, lse)
    gq, gks, gvs = torch.compile(attention._merge_bwd, dynamic=True)(q, kds, vds, out, lse, dout, dq_c, 0.3)
    assert close(gq, dq) and all(close(a, b) for a, b in zip(gks + gvs, dks + dvs))

    monkeypatch.setattr(compiled, "_COMPILED", {})
    with dynamo.config.patch(recompile_limit=8):  # dynamo's default
        compiled._fast(attention._merge_fwd, torch.device("cuda"))  # compiles lazily: no GPU needed to build it
        assert dynamo.config.recompile_limit >= 12
        dynamo.reset()
        dynamo.utils.counters.clear()
        merge = torch.compile(attention._merge_fwd, backend="eager", dynamic=True)
        for batch in (1, 2):
            for j in range(1, 7):
                ks = [torch.randn(batch, K, T, d) for _ in range(j)]
                merge(torch.randn(batch, H, T, d), ks, ks, torch.randn(batch, H, T, d), torch.randn(batch, H, T), 0.3)
        assert dynamo.utils.counters["stats"]["unique_graphs"] == 12, dict(dynamo.utils.counters["stats"])
        dynamo.reset()


def test_top_rank_test_compiles_as_on_cuda_and_counts_ties_for_the_token():
    """`top_rank_below` (the reachability test of align_topk), compiled as `_fast` compiles it on CUDA, equals eager
    and a sort-based rank for two chunk sizes; a logit tied with the token's does not push it out of the top K."""
    import eyas.drafter.ttt as ttt

    g = torch.Generator().manual_seed(8)
    fast = torch.compile(ttt.top_rank_below, dynamic=True)
    for c in (7, 19):
        s = torch.randn(c, 50, generator=g).bfloat16()
        top = torch.randint(0, 50, (c,), generator=g)
        s[0, 3] = s[0, top[0]]  # a tie
        rank = (s > s.gather(1, top[:, None])).sum(1)  # logits strictly above the token's
        for k in (1, 4, 10):
            want = rank < k
            assert torch.equal(ttt.top_rank_below(s, top, k), want) and torch.equal(fast(s, top, k), want)
        assert 0 < int((rank < 10).sum()) < c
    s = torch.zeros(2, 5)
    assert ttt.top_rank_below(s, torch.tensor([1, 4]), 1).tolist() == [True, True]  # all tied: rank 0


def test_supervised_rows_stay_inside_samples():
    # two samples [a b c d] [e f g]; mask on c, d (sample 0) and f, g (sample 1)
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    seg = Segments.from_lengths([4, 3])
    rows = supervised_rows(mask, seg.ends_N, 3)
    assert rows[0].tolist() == [0, 1, 4]  # t predicts x_{t+2}: c, d from 0, 1; g from 4 (f from 3 crosses)
    assert rows[1].tolist() == [0]  # t+3 in-sample: d from 0; g would need t = 3 (other sample)
    assert rows[2].tolist() == []


def test_supervised_rows_follow_their_definition_on_random_rows():
    """Row t carries a loss at step k exactly when t + 2 + k is inside t's sample and on its loss mask (each
    position checked by hand, 200 random packings, 1 to 8 steps, samples shorter than the steps' reach too)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 12, (int(torch.randint(1, 8, (), generator=g)),), generator=g).tolist()
        mask = torch.rand(sum(lengths), generator=g) < 0.6
        K = int(torch.randint(1, 9, (), generator=g))
        seg = Segments.from_lengths(lengths)
        ends = seg.ends_N.tolist()
        want = [[t for t in range(len(mask)) if t + 2 + k < ends[t] and mask[t + 2 + k]] for k in range(K)]
        got = supervised_rows(mask, seg.ends_N, K)
        assert [r.tolist() for r in got] == want and all(r.dtype == torch.int64 for r in got), (lengths, K)


@pytest.mark.parametrize("attention,cache_bytes", [("reference", 0), ("fast", 0), ("fast", 1 << 20)])
def test_packed_loss_and_grads_equal_padded_reference(attention, cache_bytes):
    """Three samples packed in one row (plus a padding tail) give the same loss, per-step stats and
    gradients as the same samples right-padded in a batch through the reference `ttt_loss`, on the production path:
    the drafter's 2 key/value heads each serve 2 query heads; the teacher kept as a table or recomputed once per
    row group for all steps; the loss-free positions only up to step 0's keys (`live`)."""
    K = 4
    samples = _samples([9, 3, 14])
    head = _head()
    ref_m, fast_m = (tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V) for _ in range(2))
    used = torch.arange(V) + 5  # a draft vocab that misses some target ids (Vt = 80)
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    for m in (ref_m, fast_m):
        m.set_vocab(used)
    # reference: padded batch, materialised teacher
    ids, mask = _pad([s[0] for s in samples]), _pad([s[1] for s in samples])
    aux, final = _pad([s[2] for s in samples]), _pad([s[3] for s in samples])
    logits = final @ head.T
    restricted = logits[..., used]
    teacher = Teacher(torch.softmax(restricted, -1), restricted.argmax(-1), t2d[logits.argmax(-1)])
    den = step_denominators(mask, K)
    ref = ttt_loss(
        ref_m,
        input_ids_BT=ids,
        loss_mask_BT=mask,
        aux_BTAD=aux,
        teacher=teacher,
        cfg=TTTConfig(steps=K, attention="reference"),
        denominators=den,
    )
    ref.loss.backward()
    # fast: one packed row with a padding tail
    lengths = pad_lengths([s[0].shape[0] for s in samples], 30)
    seg = Segments.from_lengths(lengths)
    pad = lengths[-1]
    ids_N = torch.cat([s[0] for s in samples] + [torch.zeros(pad, dtype=torch.long)])
    mask_N = torch.cat([s[1] for s in samples] + [torch.zeros(pad, dtype=torch.bool)])
    aux_N = torch.cat([s[2] for s in samples] + [torch.zeros(pad, 3, D)])
    final_N = torch.cat([s[3] for s in samples] + [torch.zeros(pad, D)])
    rows = supervised_rows(mask_N, seg.ends_N, K)
    assert [len(r) for r in rows] == den.long().tolist()
    pt = packed_teacher(final_N, head, head[used], used, t2d, chunk_rows=7, cache_bytes=cache_bytes)
    assert (pt.logits_NV is not None) == (cache_bytes > 0)
    live = live_positions(rows, seg.total)
    # the prompts' positions, the samples' last ones and the padding tail drop out
    assert 0 < live.numel() < seg.total - pad and live.tolist() == sorted(set(torch.cat(rows).tolist()))
    out = ttt_loss_packed(
        fast_m,
        input_ids_N=ids_N,
        seg=seg,
        rows=rows,
        aux_NAD=aux_N,
        teacher=pt,
        cfg=TTTConfig(steps=K, attention=attention),
        denominators=den,
        chunk_rows=5,
        live=live,
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    for name in ("ce_sum", "correct", "valid", "accepted", "rounds"):
        torch.testing.assert_close(
            getattr(out, name).double(), getattr(ref, name).double(), atol=1e-4, rtol=1e-5, msg=name
        )
    assert float(ref.valid[0]) > 0
    grads_r = {n: p.grad for n, p in ref_m.named_parameters() if p.grad is not None}
    grads_f = {n: p.grad for n, p in fast_m.named_parameters() if p.grad is not None}
    assert set(grads_r) == set(grads_f) and "lm_head.weight" in grads_f
    for n in grads_r:
        torch.testing.assert_close(grads_f[n], grads_r[n], atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_target_forward_equals_unbatched_reference(tmp_path, smol_tokenizer, family, compiled, monkeypatch):
    """The online teacher over a packed row == each sample run alone through Hugging Face (fp32), its layers
    eager or through the two compiled pieces every layer shares (as on CUDA: one graph each for all six layers and
    both row lengths, not one per layer)."""
    import eyas.packing as packing
    from eyas.packing import packed_unsupported_reason, target_forward_packed
    from eyas.target import load_target, reference_hidden_states
    from tests.conftest import make_tiny_target

    monkeypatch.setattr(packing, "_COMPILE_ON", ("cuda", "cpu") if compiled else ())  # compiled here as on a GPU
    if compiled:
        import torch._dynamo as dynamo

        dynamo.reset()
        monkeypatch.setattr(packing, "_LAYER_FNS", {})
        dynamo.utils.counters.clear()
    model = load_target(make_tiny_target(tmp_path / family, smol_tokenizer, family=family))
    assert packed_unsupported_reason(model) is None
    g = torch.Generator().manual_seed(3)
    lengths = [11, 1, 17, 6]
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
    seg = Segments.from_lengths(lengths)
    layers = [1, 3, 4]
    aux, final = target_forward_packed(model, torch.cat(seqs), seg, layer_ids=layers)
    assert aux.shape == (sum(lengths), 3, model.config.hidden_size)
    for s, (a, b) in enumerate(zip(seg.bounds[:-1], seg.bounds[1:])):
        ra, rf = reference_hidden_states(model, seqs[s], layer_ids=layers)
        torch.testing.assert_close(aux[a:b], ra, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final[a:b], rf, atol=2e-5, rtol=1e-4)
    if compiled:  # another row length: the same two graphs (dynamic in the row's length)
        target_forward_packed(model, torch.cat(seqs[:3]), Segments.from_lengths(lengths[:3]), layer_ids=layers)
        assert dynamo.utils.counters["stats"]["unique_graphs"] == 2, dict(dynamo.utils.counters["stats"])


def test_varlen_kernel_check_passes_on_cpu():
    from eyas.packing import check_varlen_kernel

    assert check_varlen_kernel("cpu", torch.float32) < 1e-4


def test_cast_once_casts_each_weight_once_and_trains_alike():
    """Under bf16 autocast, `cast_once` casts each mid-layer weight once per forward and gives the
    loss and gradients of the default within bf16 rounding (autograd sums the steps' weight gradients).
    (Eager autocast caches its casts too; the compiled pieces, the CUDA default, cast inside every call: K
    casts per weight.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    K = 4
    samples = _samples([9, 14])
    seg = Segments.from_lengths([9, 14])
    ids_N, mask_N = torch.cat([s[0] for s in samples]), torch.cat([s[1] for s in samples])
    aux_N, final_N = torch.cat([s[2] for s in samples]), torch.cat([s[3] for s in samples])
    rows = supervised_rows(mask_N, seg.ends_N, K)
    den = torch.tensor([float(len(r)) for r in rows])
    used = torch.arange(V) + 5
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    head = _head()
    pt = packed_teacher(final_N, head, head[used], used, t2d)
    shape = None

    class CountCasts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (
                func is torch.ops.aten._to_copy.default
                and tuple(args[0].shape) == shape
                and args[0].dtype == torch.float32
                and kwargs.get("dtype") == torch.bfloat16
            ):
                CountCasts.n += 1
            return func(*args, **kwargs)

    out = {}
    for once in (False, True):
        m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V)
        m.set_vocab(used)
        shape = tuple(m.midlayer.mlp.gate_proj.weight.shape)
        CountCasts.n = 0
        with torch.autocast("cpu", dtype=torch.bfloat16), CountCasts():
            o = ttt_loss_packed(
                m,
                input_ids_N=ids_N,
                seg=seg,
                rows=rows,
                aux_NAD=aux_N,
                teacher=pt,
                cfg=TTTConfig(steps=K, cast_once=once),
                denominators=den,
            )
        o.loss.backward()
        out[once] = (
            o.loss.detach(),
            CountCasts.n,
            {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
        )
    loss, casts, grads = out[True]
    same_shape = sum(
        tuple(mod.weight.shape) == shape for mod in m.midlayer.modules() if isinstance(mod, torch.nn.Linear)
    )  # gate, up (each cast once, then concatenated)
    assert casts == same_shape and out[False][1] >= same_shape, (casts, out[False][1])
    ref_loss, _, ref_grads = out[False]
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=1e-3)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:  # bf16 sums of K step gradients vs fp32 sums of bf16 ones
        err = (grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)
        assert err < 3e-2, (n, float(err))


def test_cast_once_default_follows_the_drafter_size():
    """cast_once None picks the measured-faster path by hidden size; an explicit setting wins."""
    from eyas.drafter.ttt import CAST_ONCE_MIN_HIDDEN

    assert TTTConfig().cast_once_for(4096) and not TTTConfig().cast_once_for(576)
    assert TTTConfig().cast_once_for(CAST_ONCE_MIN_HIDDEN) and not TTTConfig().cast_once_for(CAST_ONCE_MIN_HIDDEN - 1)
    assert TTTConfig(cast_once=True).cast_once_for(576) and not TTTConfig(cast_once=False).cast_once_for(4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams (runs on a GPU machine)")
def test_offline_prefetcher_uploads_the_next_batch_ahead_unchanged():
    """The offline reader on CUDA copies the batch after the one handed out on a side stream (AheadUploader): every
    batch reaches the GPU equal to what `store_packed` packs on the host, in schedule order."""
    import time

    from eyas.train.batches import store_packed
    from eyas.train.data import Item, StoreSource
    from eyas.train.prefetch import PackedPrefetcher

    lens = [5, 9, 3, 7, 4, 6, 8]

    class Reader:
        path = "memory"

        def get(self, sid, dtype):
            g = torch.Generator().manual_seed(int(sid))
            T = lens[int(sid)]
            return torch.randn(T, 3, 8, generator=g).to(dtype), torch.randn(T, 8, generator=g).to(dtype)

    src = StoreSource.__new__(StoreSource)
    src.reader, src.dtype = Reader(), torch.float32
    items = [Item(str(i), torch.arange(n) + i, torch.arange(n) % 2 == 0) for i, n in enumerate(lens)]
    schedule = [items[0:2], items[2:4], items[4:5], items[5:7]]
    prefetch = PackedPrefetcher(src, iter(schedule), "cuda", steps=2, pad_to=None)
    try:
        for i, part in enumerate(schedule):
            if i % 2:
                time.sleep(0.2)  # the reader has packed the next batch: its copy starts ahead
            got = prefetch.next_batch()
            if i % 2 and i + 1 < len(schedule):  # the next batch was packed: its copy started on the side stream
                assert prefetch._uploader.started
            want = store_packed(src, part, steps=2, pad_to=None)
            torch.cuda.synchronize()
            for a, b in (
                (got.input_ids_N, want.input_ids_N),
                (got.aux_NAD, want.aux_NAD),
                (got.final_ND, want.final_ND),
                *zip(got.rows, want.rows),
                (got.live, want.live),
            ):
                assert a.is_cuda and torch.equal(a.cpu(), b)
            assert got.tokens == want.tokens == sum(len(x.input_ids) for x in part)
    finally:
        prefetch.close()


def test_host_copies_pass_host_values_through():
    from eyas.train.prefetch import HostCopies

    t = torch.arange(4.0)
    got = HostCopies((3, t, None, 0.5)).get()
    assert got[0] == 3 and got[1] is t and got[2] is None and got[3] == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams and events")
def test_host_copies_wait_for_the_work_before_them_and_not_after():
    """A step's statistics read once the next step is queued: the copy made behind the step
    holds the step's values, and reading it returns while work queued after it still runs on the GPU (reading the
    device tensor would wait for that work too)."""
    from eyas.train.prefetch import HostCopies

    x = torch.zeros(1000, device="cuda")
    torch.cuda._sleep(50_000_000)  # the work before the copy (tens of ms), then its result
    x += 1
    copies = HostCopies((7, x.sum(), x[:3]))
    torch.cuda._sleep(2_000_000_000)  # the next step: about a second of GPU time queued after the copy
    after = torch.cuda.Event()
    after.record()
    n, total, head = copies.get()
    assert not after.query()  # the work queued after the copy still runs
    assert n == 7 and total.item() == 1000.0 and head.tolist() == [1.0, 1.0, 1.0] and not total.is_cuda
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=(
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="the CUDA head loss (the fused kernel where it runs)"
                ),
            ),
        ),
    ],
)
@pytest.mark.parametrize("path", ["table", "recomputed"])
def test_align_topk_drops_the_rows_past_a_miss_as_the_reference_does(path, device):
    """The reachability mask (TTTConfig.align_topk) in the chunked head loss equals a plain reference: step k's
    row at position t keeps its weight only if at every earlier step the teacher's top token was among the
    drafter's top K at t (and in the draft vocabulary); loss and gradients match for a kept teacher table and a
    recomputed one (once per row group for all steps), chunks smaller than a step."""
    import eyas.drafter.ttt as ttt

    g = torch.Generator().manual_seed(11)
    N, Dm, V, steps, topk = 40, 12, 30, 3, 8
    rows = [torch.randperm(N - 1 - k, generator=g)[: 24 - 4 * k].sort().values.to(device) for k in range(steps)]
    pos = torch.cat(rows)
    tr = torch.cat([r + 1 + k for k, r in enumerate(rows)])
    n = pos.numel()
    x = torch.randn(n, Dm, generator=g).to(device).requires_grad_()
    W = torch.randn(V, Dm, generator=g).to(device).requires_grad_()
    f, wt = torch.randn(N, Dm, generator=g).to(device), torch.randn(V, Dm, generator=g).to(device)
    top = (f @ wt.T).argmax(-1)[tr]
    w = torch.rand(n, generator=g).to(device) + 0.1
    w[::7] = 0  # teacher's top token outside the draft vocab: no loss, and the chain ends there
    # reference: whole logits, steps in order
    with torch.no_grad():
        S = x @ W.T
        reach = ((S > S.gather(1, top[:, None])).sum(1) < topk) & (w > 0)
        alive, w_ref, a = torch.ones(N, device=device), w.clone(), 0
        for r in rows:
            b = a + r.numel()
            w_ref[a:b] *= alive[r]
            alive[r] *= reach[a:b].float()
            a = b
    assert 0 < int((w_ref == 0).sum() - (w == 0).sum()) < int((w > 0).sum())  # the mask drops some rows, not all
    want = ttt.reference_head_soft_ce(x, W, f[tr], wt, w_ref)
    gx_want, gw_want = torch.autograd.grad(want, [x, W])
    lengths = [r.numel() for r in rows]
    if path == "table":
        kw = dict(teacher_logits=f @ wt.T, teacher_rows=tr)
        args = (None, None)
    else:
        kw = dict(teacher_rows=tr)
        args = (f, wt)
    total, per_step, hits = ttt.head_soft_ce_ranges(
        x, W, *args, w, top, lengths, chunk_rows=5, compute_dtype=torch.float32, align=(pos, N, topk), **kw
    )
    torch.testing.assert_close(total, want, atol=1e-4, rtol=1e-5)
    gx, gw = torch.autograd.grad(total, [x, W])
    torch.testing.assert_close(gx, gx_want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, gw_want, atol=1e-5, rtol=1e-4)
    assert torch.equal(hits, S.argmax(-1) == top)  # the statistics still count every row
    plain, _, _ = ttt.head_soft_ce_ranges(x, W, *args, w, top, lengths, chunk_rows=5, compute_dtype=torch.float32, **kw)
    assert float(plain.detach()) > float(total.detach()) + 1e-3


def test_feature_loss_adds_the_weighted_regression_onto_the_teacher_rows():
    """TTTConfig.feature_loss c: the packed loss grows by c x the sum over steps k and supervised rows t of
    decay^k / denominator_k x mean smooth-L1(the drafter's normed state at (t, k), the target's final state at
    t + 1 + k), computed here from a plain unroll; the statistics do not change, the gradients do."""
    import eyas.drafter.ttt as ttt

    K, c = 4, 0.7
    samples = _samples([19, 7, 33], seed=5)
    seg = Segments.from_lengths([19, 7, 33])
    ids_N, mask_N = torch.cat([s[0] for s in samples]), torch.cat([s[1] for s in samples])
    aux_N, final_N = torch.cat([s[2] for s in samples]), torch.cat([s[3] for s in samples])
    rows = supervised_rows(mask_N, seg.ends_N, K)
    head = _head()
    used = torch.arange(V) + 5
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[used] = True
    den = torch.tensor([float(len(r)) + 3 for r in rows])  # (a larger global batch's counts)
    res = {}
    for weight in (0.0, c):
        m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V)
        m.set_vocab(used)
        pt = packed_teacher(final_N, head, head[used], used, t2d)
        out = ttt_loss_packed(
            m,
            input_ids_N=ids_N,
            seg=seg,
            rows=rows,
            aux_NAD=aux_N,
            teacher=pt,
            cfg=TTTConfig(steps=K, feature_loss=weight),
            denominators=den,
            chunk_rows=6,
        )
        out.loss.backward()
        res[weight] = (out, m.midlayer.mlp.down_proj.weight.grad.clone())
    with torch.no_grad():
        unroll = ttt.PackedUnroll(m, ids_N, seg, aux_N, steps=K)
        term = 0.0
        for k in range(K):
            x = m.norm(unroll.step(k)[0])[rows[k]]
            reg = torch.nn.functional.smooth_l1_loss(x, final_N[rows[k] + 1 + k], reduction="none").mean(-1)
            term += float(reg.sum()) * 0.8**k / float(den[k])
    (a, ga), (b, gb) = res[c], res[0.0]
    assert term > 0
    assert float(a.loss.detach()) - float(b.loss.detach()) == pytest.approx(c * term, rel=1e-4)
    for name in ("ce_sum", "correct", "valid", "accepted", "rounds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.allclose(ga, gb)
    with pytest.raises(ValueError, match="feature-loss"):
        TTTConfig(feature_loss=-0.1)
    with pytest.raises(ValueError, match="packed path"):
        ttt_loss(
            None, input_ids_BT=None, loss_mask_BT=None, aux_BTAD=None, teacher=None, cfg=TTTConfig(feature_loss=0.5)
        )


def test_align_topk_is_refused_by_the_padded_reference_and_below_zero():
    from eyas.drafter.ttt import TTTConfig

    with pytest.raises(ValueError, match="align-topk"):
        TTTConfig(align_topk=-1)
    cfg = TTTConfig(align_topk=2)
    with pytest.raises(ValueError, match="packed path"):
        ttt_loss(None, input_ids_BT=None, loss_mask_BT=None, aux_BTAD=None, teacher=None, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA synchronisation")
def test_a_packed_training_step_queues_without_waiting_for_the_gpu():
    """Forward, backward, clipping, the optimizer step and the per-step denominators' upload (as `eyas train` runs
    them) never make the host wait for the GPU (torch.cuda.set_sync_debug_mode "error" raises on any such op):
    only the statistics read at the step's end does, so the host queues a step while the GPU runs the last one."""
    from eyas.packing import to_device
    from eyas.train.loop import PackedTTTModule, _clip

    dev, K = torch.device("cuda"), 4
    # (fewer live positions than tokens: the pruning, PRUNE_ROWS, runs inside the checked step)
    ids, seg, rows, live, aux, final, den, head, used, _ = _packed_on(dev, [9, 3, 14], K=K, seed=0)
    den = den.cpu()  # uploaded each step, as the loop does
    m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V)
    m.set_vocab(used.cpu())
    module = PackedTTTModule(m, TTTConfig(steps=K), head_VtD=head).to(dev)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = module(ids, seg, rows, aux, final, to_device(den, dev), live)
        loss.backward()
        norm = _clip(module, params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return stats, norm

    step()  # kernels picked and compiled, checked against their references (those read results back)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, norm = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(norm) > 0 and stats.tolist()[2 * K] > 0  # rows of step 0 counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel")
def test_pruned_positions_give_the_same_step_on_cuda():
    """The loss-free positions pruned on CUDA (bf16 autocast, the varlen flash kernel with zero queries at the pruned
    rows, the compiled merge): the loss, statistics and gradients of the packed step equal those with every position
    computed (no `live`)."""
    K = 4
    ids, seg, rows, live, aux, final, den, head, used, t2d = _packed_on("cuda", [90, 33, 140], K=K, seed=3)
    res = {}
    for prune in (False, True):
        m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V).to("cuda")
        m.set_vocab(used.cpu())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pt = packed_teacher(final, head, head[used], used, t2d)
            out = ttt_loss_packed(
                m,
                input_ids_N=ids,
                seg=seg,
                rows=rows,
                aux_NAD=aux,
                teacher=pt,
                cfg=TTTConfig(steps=K),
                denominators=den,
                live=live if prune else None,
            )
        out.loss.backward()
        res[prune] = (out, {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = res[True], res[False]
    torch.testing.assert_close(a.loss, b.loss, atol=2e-3, rtol=2e-3)
    for name in ("correct", "valid", "rounds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert set(ga) == set(gb)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=2e-3, rtol=5e-2, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel's grouped-query mode")
def test_gqa_flash_equals_repeated_keys_on_cuda(monkeypatch):
    """kernels `gqa_flash`: the varlen flash kernel reading 2 key/value heads for 8 query heads gives the output and
    the gradients of the same keys repeated to 8 heads (step 0 causal within each segment, two diagonals)."""
    from eyas import packing

    assert packing.check_varlen_kernel("cuda", torch.bfloat16) < 0.05
    seg = Segments.from_lengths([37, 1, 200, 64], "cuda")
    g = torch.Generator().manual_seed(4)
    mk = lambda h: torch.randn(1, h, seg.total, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()  # noqa: E731
    q, ks, vs = mk(8), [mk(2) for _ in range(3)], [mk(2) for _ in range(3)]
    dout = torch.randn(1, 8, seg.total, 64, generator=g).to("cuda", torch.bfloat16)
    out = {}
    for gqa in (False, True):
        monkeypatch.setenv(kernels.ENV, "gqa_flash:on" if gqa else "gqa_flash:off")
        assert packing.gqa_flash("cuda-flash", q) == gqa
        o = fast_attention(q, ks, vs, seg=seg, kernel="cuda-flash")
        out[gqa] = (o, *torch.autograd.grad(o, [q, *ks, *vs], dout))
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel's grouped-query mode")
def test_gqa_flash_target_forward_equals_repeated_keys_on_cuda(monkeypatch):
    """kernels `gqa_flash` in the online target's packed forward (bf16, compiled layers): the same states as with
    the keys and values repeated to every query head (a tiny random Llama: 4 query heads, 2 key/value heads)."""
    import transformers

    from eyas import packing

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    assert packing.check_varlen_kernel("cuda", torch.bfloat16) < 0.05
    g = torch.Generator().manual_seed(3)
    lengths = [11, 1, 17, 6]
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=g).cuda()
    seg = Segments.from_lengths(lengths, "cuda")
    out = {}
    for gqa in (False, True):
        monkeypatch.setenv(kernels.ENV, "gqa_flash:on" if gqa else "gqa_flash:off")
        out[gqa] = packing.target_forward_packed(model, ids, seg, layer_ids=[1, 3, 4])
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_teacher_head_gives_the_one_product_teacher(dtype):
    """`packed_teacher`: the draft vocab's rows and the other rows multiplied apart give the same top draft
    ids, full-vocab argmax flags and kept logits as one product over the whole head, ties included (rows built so
    that a draft id and a smaller or a larger outside id share the maximum), in fp32 and bf16; a draft vocab that
    is the whole vocab has every flag set."""
    from eyas.drafter import ttt as T

    g = torch.Generator().manual_seed(3)
    Vt, N = 80, 41
    head = _head(Vt=Vt).to(dtype)
    used = torch.cat([torch.arange(5, 30), torch.arange(50, 70)])
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[used] = True
    final = torch.randn(N, D, generator=g).to(dtype)
    head[3] = head[20]  # outside id 3 ties draft id 20 (smaller outside id: the outside one is the argmax)
    head[75] = head[60]  # outside id 75 ties draft id 60 (larger: the draft one is)
    final[0] = head[20].float().to(dtype) * 4  # rows whose maximum is those ties
    final[1] = head[60].float().to(dtype) * 4
    logits = final @ head.T  # the one product over the whole head: the reference
    restricted = logits[:, used]
    ref = T.PackedTeacher(final, head[used], restricted.argmax(-1), t2d[logits.argmax(-1)], restricted)
    got = T.packed_teacher(final, head, head[used], used, t2d, chunk_rows=16, unused=T.unused_head(head, t2d))
    assert bool(ref.in_vocab_N[0]) is False and bool(ref.in_vocab_N[1]) is True  # the ties as built
    assert torch.equal(got.top_N, ref.top_N) and torch.equal(got.in_vocab_N, ref.in_vocab_N)
    assert torch.equal(got.logits_NV, ref.logits_NV)
    assert not bool(ref.in_vocab_N.all())  # some rows' argmax lies outside the draft vocab
    full = torch.ones(Vt, dtype=torch.bool)
    whole = T.packed_teacher(final, head, head, torch.arange(Vt), full, unused=T.unused_head(head, full))
    assert bool(whole.in_vocab_N.all())
