"""Training-time test: shifts, the causal+diagonal mask, fast vs reference, teacher masking."""

from __future__ import annotations

import pytest
import torch

from eyas.drafter.model import DrafterCache, DrafterConfig, Eagle3Drafter
from eyas.drafter.ttt import (
    Teacher,
    TTTConfig,
    check_fast_attention,
    fast_attention,
    reference_attention,
    step_mask,
    teacher_from_final,
    ttt_loss,
    ttt_unroll,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_drafter(seed=0, **kw) -> Eagle3Drafter:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=60,
        draft_vocab_size=60,
        target_hidden_size=32,
        aux_layer_ids=[1, 2, 3],
        target_num_layers=6,
    )
    base.update(kw)
    m = Eagle3Drafter(DrafterConfig(**base))
    m.reset_parameters(seed=seed)
    with torch.no_grad():  # larger weights than the 0.02 init so attention patterns matter
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(10)
    return m


@pytest.mark.parametrize("kv_heads", [6, 2])  # 6: one key head per query head; 2: each shared by 3
@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
def test_fast_attention_matches_dense_reference(kernel, kv_heads):
    """Out and gradients of the fast attention equal the dense reference's (grouped keys repeated to the query
    heads)."""
    g = torch.Generator().manual_seed(1)
    B, H, T, d, steps = 2, 6, 37, 16, 4
    dt = torch.float64 if kernel == "math" else torch.float32

    def mk(h):
        return torch.randn(B, h, T, d, generator=g, dtype=dt).requires_grad_()

    q, ks, vs = mk(H), [mk(kv_heads) for _ in range(steps)], [mk(kv_heads) for _ in range(steps)]
    dout = torch.randn(B, H, T, d, generator=g, dtype=q.dtype)
    for n in (1, steps):  # step 0 alone, and with diagonals
        ref = reference_attention(q, ks[:n], vs[:n])
        fast = fast_attention(q, ks[:n], vs[:n], kernel=kernel)
        torch.testing.assert_close(fast, ref, atol=2e-5, rtol=2e-5)
        g_ref = torch.autograd.grad(ref, [q, *ks[:n], *vs[:n]], dout)
        g_fast = torch.autograd.grad(fast, [q, *ks[:n], *vs[:n]], dout)
        for a, b in zip(g_fast, g_ref):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_check_fast_attention_cpu():
    assert check_fast_attention("cpu", torch.float32) < 1e-4


def _inputs(seed=0, B=2, T=11, V=60):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3, 32, generator=g)
    return ids, aux


def test_unroll_equals_chain_drafting_with_a_cache():
    """Step k at position t == drafting k tokens after position t at inference time (cache + one
    token per step, positions t+1..t+k, fed the draft's own previous hidden state)."""
    torch.manual_seed(0)
    m = tiny_drafter().eval()
    ids, aux = _inputs()
    K = 4
    with torch.no_grad():
        hs = [h for _, h in ttt_unroll(m, ids, aux, steps=K, attention="reference")]
        feat0 = m.project_aux(aux)
        for t in (0, 3, 6):
            cache = DrafterCache()
            pos = torch.arange(t + 1)[None].expand(2, t + 1)
            h, _ = m.forward_step(ids[:, 1 : t + 2], feat0[:, : t + 1], pos, cache=cache)
            torch.testing.assert_close(hs[0][:, t], h[:, t], atol=1e-5, rtol=1e-5)
            prev = h[:, t : t + 1]
            for k in range(1, K):
                h, _ = m.forward_step(ids[:, t + 1 + k : t + 2 + k], prev, torch.full((2, 1), t + k), cache=cache)
                torch.testing.assert_close(hs[k][:, t], h[:, 0], atol=1e-5, rtol=1e-5)
                prev = h


def _teacher(B, T, V=60, seed=3, in_vocab=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    inv = torch.ones(B, T, dtype=torch.bool) if in_vocab is None else in_vocab
    return Teacher(torch.softmax(logits, -1), logits.argmax(-1), inv)


def test_fast_and_reference_loss_and_grads_agree():
    ids, aux = _inputs(T=23)
    mask = torch.rand(2, 23, generator=torch.Generator().manual_seed(5)) > 0.3
    teacher = _teacher(2, 23)
    res = {}
    for attn in ("reference", "fast"):
        m = tiny_drafter(seed=1)
        out = ttt_loss(
            m,
            input_ids_BT=ids,
            loss_mask_BT=mask,
            aux_BTAD=aux,
            teacher=teacher,
            cfg=TTTConfig(steps=5, attention=attn),
        )
        out.loss.backward()
        res[attn] = (out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (o1, g1), (o2, g2) = res["reference"], res["fast"]
    torch.testing.assert_close(o2.loss, o1.loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(o1.valid, o2.valid)
    assert set(g1) == set(g2) and "fc.weight" in g1 and "embed_tokens.weight" not in g1
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=1e-4, rtol=1e-4, msg=n)


def test_first_assistant_position_is_supervised():
    """Answer = the single token at index s: step k supervises exactly position t = s-2-k, against
    teacher p_{s-1} (the target's distribution for x_s)."""
    T, s, K = 10, 5, 7
    ids, aux = _inputs(B=1, T=T)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, s] = True
    teacher = _teacher(1, T)
    m = tiny_drafter()
    out = ttt_loss(
        m,
        input_ids_BT=ids,
        loss_mask_BT=mask,
        aux_BTAD=aux,
        teacher=teacher,
        cfg=TTTConfig(steps=K, attention="reference"),
    )
    assert out.valid.tolist() == [1, 1, 1, 1, 0, 0, 0]  # t = 3, 2, 1, 0, then none
    assert step_mask(mask, 0)[0].nonzero().flatten().tolist() == [s - 2]
    with torch.no_grad():
        h0 = next(iter(ttt_unroll(m, ids, aux, steps=1, attention="reference")))[1]
        logp = torch.log_softmax(m.compute_logits(h0)[0, s - 2].float(), -1)
        expected = -(teacher.probs_BTV[0, s - 1] * logp).sum()
    torch.testing.assert_close(out.ce_sum[0].float(), expected, atol=1e-5, rtol=1e-5)
    assert float(out.ce_sum[0]) > 0


def test_out_of_vocab_teacher_positions_are_masked_and_stats():
    T = 9
    ids, aux = _inputs(B=1, T=T)
    mask = torch.ones(1, T, dtype=torch.bool)
    inv = torch.ones(1, T, dtype=torch.bool)
    inv[0, 4] = False  # teacher p_4 (predicting x_5) has its argmax outside the draft vocab
    m = tiny_drafter()
    cfg = TTTConfig(steps=3, attention="reference")
    full = ttt_loss(m, input_ids_BT=ids, loss_mask_BT=mask, aux_BTAD=aux, teacher=_teacher(1, T), cfg=cfg)
    cut = ttt_loss(m, input_ids_BT=ids, loss_mask_BT=mask, aux_BTAD=aux, teacher=_teacher(1, T, in_vocab=inv), cfg=cfg)
    # step k reads teacher p_{t+1+k}: index 4 is position 3-k, valid at every step until then
    assert full.valid.tolist() == [7, 6, 5]
    assert cut.valid.tolist() == [6, 5, 4]
    assert (cut.ce_sum < full.ce_sum).all()
    # the chain statistic: accepted <= rounds * steps, and tau >= 1
    assert 0 <= float(full.accepted) <= float(full.rounds) * 3


def test_teacher_from_final_restricts_and_flags():
    g = torch.Generator().manual_seed(0)
    final = torch.randn(2, 5, 8, generator=g)
    W = torch.randn(20, 8, generator=g)
    used = torch.tensor([0, 3, 4, 9, 15])
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[used] = True
    t = teacher_from_final(final, W, used, t2d, chunk_rows=3)
    logits = final @ W.T
    torch.testing.assert_close(t.probs_BTV, torch.softmax(logits[..., used], -1))
    assert torch.equal(t.in_vocab_BT, t2d[logits.argmax(-1)])
    assert torch.equal(t.top_BT, logits[..., used].argmax(-1))
