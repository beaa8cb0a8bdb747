"""train/optim.py: the Newton-Schulz orthogonalization, MuonAdamW's two kinds of groups against their definitions
(the AdamW groups against torch's AdamW), and which drafter parameters each kind gets."""

from __future__ import annotations

import pytest
import torch

from eyas.train.optim import MuonAdamW, make_optimizer, muon_scale, newton_schulz


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_keeps_the_singular_vectors_and_flattens_the_values(shape):
    g = torch.Generator().manual_seed(0)
    n = min(shape)
    U = torch.linalg.qr(torch.randn(shape[0], n, generator=g))[0]
    V = torch.linalg.qr(torch.randn(shape[1], n, generator=g))[0]
    G = U @ torch.diag(torch.logspace(0, 2, n)) @ V.T  # singular values 1 .. 100
    O = newton_schulz(G)  # noqa: E741 (the orthogonalised G)
    assert O.shape == G.shape and O.dtype == G.dtype
    s = torch.linalg.svdvals(O)
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, s  # every direction moved about the same
    polar = U @ V.T  # the exact orthogonal factor
    cos = (O * polar).sum() / (O.norm() * polar.norm())
    assert float(cos) > 0.95
    assert torch.allclose(newton_schulz(3.0 * G), O, atol=1e-5)  # scale-free


def test_adamw_groups_match_torchs_adamw():
    torch.manual_seed(0)
    a = [torch.randn(6, 5, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [p.detach().clone().requires_grad_(True) for p in a]
    ours = MuonAdamW([{"params": a}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


def test_muon_group_step_is_the_orthogonalized_nesterov_momentum():
    torch.manual_seed(1)
    p = torch.randn(8, 12, requires_grad=True)
    p0 = p.detach().clone()
    opt = MuonAdamW([{"params": [p], "muon": True}], lr=0.01, weight_decay=0.1, momentum=0.9)
    g1, g2 = torch.randn(8, 12), torch.randn(8, 12)
    p.grad = g1.clone()
    opt.step()
    want = p0 * (1 - 0.01 * 0.1) - 0.01 * muon_scale(p.shape) * newton_schulz(g1 + 0.9 * g1)
    torch.testing.assert_close(p.detach(), want)
    p.grad = g2.clone()
    opt.step()
    buf = 0.9 * g1 + g2
    want = want * (1 - 0.01 * 0.1) - 0.01 * muon_scale(p.shape) * newton_schulz(g2 + 0.9 * buf)
    torch.testing.assert_close(p.detach(), want)
    with pytest.raises(ValueError, match="matrices"):
        MuonAdamW([{"params": [torch.zeros(3, requires_grad=True)], "muon": True}], lr=0.1)


def test_muon_takes_the_hidden_matrices_and_adamw_the_head_and_norms():
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        draft_vocab_size=50,
        target_hidden_size=32,
        aux_layer_ids=[0, 1, 2],
    )
    d = Eagle3Drafter(cfg)
    opt = make_optimizer(d, "muon", lr=1e-3, weight_decay=0.0, fused=False)
    muon, rest = (list(g["params"]) for g in opt.param_groups)
    names = {id(p): n for n, p in d.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(
        ["fc.weight"]
        + [f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    )
    assert "lm_head.weight" in {names[id(p)] for p in rest}
    assert all(p.requires_grad for p in muon + rest)  # the frozen embedding in neither
    assert not any(names[id(p)] == "embed_tokens.weight" for p in muon + rest)
    assert isinstance(make_optimizer(d, "adamw", lr=1e-3, weight_decay=0.0, fused=False), torch.optim.AdamW)
