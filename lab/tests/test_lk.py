"""lab/variants/lk.py: the LK loss -log(sum_v min(p_v, q_v)) patched into eyas's training for one run, and
lab/variants/run.py stacking it with EAGLE-3.1.

The chunk's closed-form loss and gradient against the plain formula under autograd; eyas's training module
(`PackedTTTModule`, the packed head loss `eyas train` runs) against the padded reference fed the plain formula; the
product's own packed-vs-reference tests under the patch; the patch undone (cross-entropy again); eagle31 + lk
patched together and undone; a CPU pipeline through the entry point.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from lab.tests.conftest import smoke_sets, variant_pipeline
from lab.variants import eagle31, lk, run
from lab.variants.lk import Variant, patched

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def plain_lk(logits, probs):
    """-log(sum_v min(p_v, softmax(logits)_v)) per row, in float64, no floor."""
    q = torch.softmax(logits.double(), -1)
    return -torch.log(torch.minimum(probs.double(), q).sum(-1))


def plain_ce(logits, probs):
    return -(probs.double() * torch.log_softmax(logits.double(), -1)).sum(-1)


def plain_mix(W):
    """W * CE + (1 - W) * LK per row in float64 (`as_float`: cast to fp32, as eyas's own per-row losses are)."""

    def rows(logits, probs, as_float=False):
        out = W * plain_ce(logits, probs) + (1 - W) * plain_lk(logits, probs)
        return out.float() if as_float else out

    return rows


def _chunk_inputs(c=7, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, t = 2 * torch.randn(c, V, generator=g), 2 * torch.randn(c, V, generator=g)
    w = torch.rand(c, generator=g)
    w[1] = 0.0
    top = t.argmax(-1)
    top[::2] = s[::2].argmax(-1)  # some hits
    return s, t, w, top


# ----------------------------------------------------------------------------- the chunk


@pytest.mark.parametrize("W", [0.0, 0.3])
def test_chunk_loss_and_gradient_are_the_plain_formulas(W):
    """sum_n w_n L_n and w_n dL_n/ds equal the plain formula and its autograd gradient (float64) on random logits
    away from ties; hits are the argmax's; a zero weight gives a zero row."""
    s, t, w, top = _chunk_inputs()
    p = torch.softmax(t.double(), -1)
    assert (torch.softmax(s.double(), -1) - p).abs().min() > 1e-8  # no ties
    loss, hits, g = lk.lk_chunk(s, t, w, top, kl_weight=W)
    s64 = s.double().requires_grad_()
    want = (plain_mix(W)(s64, p) * w.double()).sum()
    want.backward()
    assert loss.dtype == torch.float32 and g.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(g.double(), s64.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(hits, s.argmax(-1) == top) and hits.any() and not hits.all()
    assert torch.equal(g[1], torch.zeros_like(g[1])) and g[0].abs().sum() > 0


def test_weights_scale_the_loss_and_the_gradient_and_bf16_comes_back_bf16():
    s, t, w, top = _chunk_inputs(seed=1)
    loss, _, g = lk.lk_chunk(s, t, w, top)
    loss3, _, g3 = lk.lk_chunk(s, t, 3 * w, top)
    torch.testing.assert_close(loss3, 3 * loss)
    torch.testing.assert_close(g3, 3 * g)
    ones = lk.lk_chunk(s, t, torch.ones_like(w), top)[0]
    torch.testing.assert_close(ones.double(), plain_lk(s, torch.softmax(t, -1)).sum(), atol=1e-5, rtol=1e-6)
    _, _, gb = lk.lk_chunk(s.bfloat16(), t.bfloat16(), w, top)
    assert gb.dtype == torch.bfloat16 and torch.allclose(gb.float(), g, atol=2e-2)


def test_a_peaked_teacher_gives_the_cross_entropy_and_a_broad_one_does_not():
    """At a (nearly) point-mass teacher alpha = q_y and the gradient is q - e_y: the CE's; the random teacher of the
    other tests is far from that (so the closeness says something)."""
    from eyas.drafter.ttt.head_loss import _chunk_ce

    s, t, w, top = _chunk_inputs(seed=2)
    peaked = 40 * torch.nn.functional.one_hot(t.argmax(-1), t.shape[1]).float() + 0.1 * t
    lk_loss, _, lk_g = lk.lk_chunk(s, peaked, w, top)
    ce_loss, _, ce_g = _chunk_ce(s, peaked, w, top)
    torch.testing.assert_close(lk_loss, ce_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lk_g, ce_g, atol=1e-5, rtol=1e-4)
    broad_lk, _, broad_g = lk.lk_chunk(s, t, w, top)
    broad_ce, _, broad_ce_g = _chunk_ce(s, t, w, top)
    assert broad_lk < 0.8 * broad_ce and (broad_g - broad_ce_g).abs().max() > 0.05


def test_below_the_floor_the_loss_is_clamped_and_the_gradient_keeps_pulling():
    """alpha ~ e^-100 (student and teacher sure of different tokens): the loss is -log(EPS), the gradient finite,
    non-zero and raising the teacher's token (autograd of the clamp would give zero)."""
    V = 10
    s = torch.full((1, V), -50.0)
    s[0, 0] = 50.0
    t = torch.full((1, V), -50.0)
    t[0, 1] = 50.0
    loss, _, g = lk.lk_chunk(s, t, torch.ones(1), torch.tensor([1]))
    assert loss.item() == pytest.approx(-math.log(lk.EPS), rel=1e-5)
    assert torch.isfinite(g).all() and g[0, 1] < 0 and g.abs().sum() <= 2.0


# ----------------------------------------------------------------------------- eyas's training under the patch


def _batch(K: int):
    """Three samples as `eyas train` packs them (ids, seg, rows, live, aux, final, denominators) and the same samples
    right-padded with their materialised teacher, plus the target head and the draft vocab."""
    from eyas.drafter.ttt import Teacher
    from tests import test_train_packed as tp

    lengths = [9, 3, 14]
    ids, seg, rows, live, aux, final, den, head, used, t2d = tp._packed_on(torch.device("cpu"), lengths, K=K, seed=0)
    samples = tp._samples(lengths, seed=0)
    padded = [tp._pad([s[i] for s in samples]) for i in range(4)]  # ids, mask, aux, final
    logits = padded[3] @ head.T
    restricted = logits[..., used]
    teacher = Teacher(torch.softmax(restricted, -1), restricted.argmax(-1), t2d[logits.argmax(-1)])
    return (ids, seg, rows, aux, final, den, live), (padded[0], padded[1], padded[2], teacher), head, used


def _drafter(used):
    from tests.test_drafter_ttt import tiny_drafter
    from tests.test_train_packed import V

    m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=V)
    m.set_vocab(used)
    return m


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _reference(padded, used, K, *, soft_ce=None):
    """The padded reference `ttt_loss` (attention "reference"), with `soft_ce` as its per-position loss if given."""
    from eyas.drafter.ttt import TTTConfig, step_denominators, ttt_loss

    ids, mask, aux, teacher = padded
    m = _drafter(used)
    if soft_ce is not None:
        m._soft_ce = soft_ce
    out = ttt_loss(
        m,
        input_ids_BT=ids,
        loss_mask_BT=mask,
        aux_BTAD=aux,
        teacher=teacher,
        cfg=TTTConfig(steps=K, attention="reference"),
        denominators=step_denominators(mask, K),
    )
    out.loss.backward()
    return out, _grads(m)


def _training(packed, head, used, K):
    """One forward and backward of `eyas train`'s module (PackedTTTModule: the teacher from the final states,
    the packed unroll, the chunked head loss): (loss, per-step loss sums, gradients)."""
    from eyas.drafter.ttt import TTTConfig
    from eyas.train.modules import PackedTTTModule

    m = _drafter(used)
    module = PackedTTTModule(m, TTTConfig(steps=K), head_VtD=head, chunk_rows=5)
    loss, stats = module(*packed)
    loss.backward()
    return loss, stats[:K], _grads(m)


def _targets():
    """Every attribute either variant patches, by identity."""
    import eyas.pipeline as pipeline
    from eyas.drafter import reader, writer
    from eyas.drafter.model import Eagle3Drafter, MidLayer
    from eyas.drafter.ttt import head_loss, reference, unroll
    from eyas.specdec.functional import FunctionalDrafter

    names = {
        head_loss: ("chunk_ce_for", "soft_ce"),
        reference: ("soft_ce",),
        unroll: ("soft_ce", "normed_rows"),
        writer: ("write_eyas", "sglang_config", "vllm_config"),
        reader: ("canonical_weights", "check_shapes", "_eyas_config", "_config_from_sglang", "_speculators_layer"),
        pipeline: ("fingerprint",),
        Eagle3Drafter: ("__init__", "project_aux", "compute_logits"),
        MidLayer: ("finish",),
        FunctionalDrafter: ("fuse", "finish", "logits"),
    }
    return {(o.__name__, n): o.__dict__[n] for o, ns in names.items() for n in ns}


@pytest.mark.parametrize("W", [0.0, 0.4])
def test_training_optimises_lk_and_the_patch_is_undone(W):
    """Under the patch, eyas's training module gives the loss, per-step sums and every gradient of the padded
    reference fed the plain formula, and so does the reference as eyas has it (its soft_ce patched); the chunk
    is chosen over the fused kernel even where the kernel would run. Once undone, the module is back to the soft
    cross-entropy: the reference's own, and not the LK values."""
    from eyas import kernels
    from eyas.drafter import ce_kernel
    from eyas.drafter.ttt import head_loss

    K = 3
    packed, padded, head, used = _batch(K)
    before = _targets()
    want, want_g = _reference(padded, used, K, soft_ce=functools.partial(plain_mix(W), as_float=True))
    with patched(Variant(kl_weight=W)) as v:
        assert lk.active() == v
        loss, per_step, grads = _training(packed, head, used, K)
        ref_patched, ref_patched_g = _reference(padded, used, K)
        real_use = kernels.use
        kernels.use = lambda *a, **kw: True  # (a CUDA machine with the kernel)
        try:
            chosen = head_loss.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32)
        finally:
            kernels.use = real_use
        assert chosen is not ce_kernel.fused_chunk_ce and chosen.__wrapped__.__name__.startswith("lk_chunk")
    assert lk.active() is None and _targets() == before
    ce_loss, _, ce_grads = _training(packed, head, used, K)
    ce_ref, ce_ref_g = _reference(padded, used, K)

    assert float(want.valid[0]) > 0
    for got, got_g in ((loss, grads), (ref_patched.loss, ref_patched_g)):
        torch.testing.assert_close(got, want.loss, atol=1e-5, rtol=1e-5)
        assert set(got_g) == set(want_g) and "lm_head.weight" in got_g
        for n in want_g:
            torch.testing.assert_close(got_g[n], want_g[n], atol=1e-4, rtol=1e-4, msg=n)
    torch.testing.assert_close(per_step.double(), want.ce_sum.double(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ce_loss, ce_ref.loss, atol=1e-5, rtol=1e-5)
    for n in ce_ref_g:
        torch.testing.assert_close(ce_grads[n], ce_ref_g[n], atol=1e-4, rtol=1e-4, msg=n)
    assert ce_loss > 1.2 * loss  # LK <= KL <= CE, and here well below
    assert max((ce_grads[n] - grads[n]).abs().max() for n in grads) > 1e-2


def test_the_products_packed_vs_reference_tests_hold_under_the_patch():
    """eyas's own tests of the training path, run patched: the packed loss and gradients (closed form, chunked,
    teacher kept or recomputed, fast or reference attention) equal the padded reference's (autograd)."""
    from tests import test_drafter_ttt, test_train_packed

    with patched():
        test_drafter_ttt.test_fast_and_reference_loss_and_grads_agree()
        test_train_packed.test_packed_loss_and_grads_equal_padded_reference("fast", 0)
        test_train_packed.test_packed_loss_and_grads_equal_padded_reference("fast", 1 << 20)


# ----------------------------------------------------------------------------- stacking, options


def test_eagle31_and_lk_stack_in_either_order_and_undo(tmp_path):
    """run.stacked: both patches at once (the drafter gets eagle31's norms and trains on LK; its config.json
    carries both markers; the train fingerprint differs from each alone and from eyas's), eagle31's reader reads
    the drafter back; on exit, also after an error, every attribute is the original again."""
    import eyas.pipeline as pipeline
    from eyas.drafter.model import Eagle3Drafter
    from eyas.drafter.ttt import head_loss
    from lab.tests.test_eagle31 import make_drafter

    before = _targets()

    def fp():
        return pipeline.fingerprint("train", pipeline.ExportOptions(), "in")

    plain = fp()
    with patched():
        only_lk = fp()
    with eagle31.patched():
        only_31 = fp()
    for order in ([eagle31.Variant(), Variant()], [Variant(), eagle31.Variant()]):
        with run.stacked(order):
            assert eagle31.active() == eagle31.Variant() and lk.active() == Variant()
            assert len({plain, only_lk, only_31, fp()}) == 4
            assert pipeline.fingerprint("eval", pipeline.ExportOptions(), "x") == before[
                ("eyas.pipeline", "fingerprint")
            ]("eval", pipeline.ExportOptions(), "x")
            assert head_loss.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32).__wrapped__.__name__ == (
                "lk_chunk_w0.0"
            )
            m = make_drafter()
            assert "fc_norm.0.weight" in m.state_dict()
            out = m.save(tmp_path / type(order[0]).__module__)
            meta = json.loads((out / "config.json").read_text())
            assert meta["lab_variant"] == eagle31.Variant().marker() and meta["lab_loss"] == Variant().marker()
            Eagle3Drafter.load(out)
        assert _targets() == before and eagle31.active() is None and lk.active() is None
    with pytest.raises(ValueError, match="boom"), run.stacked([eagle31.Variant(), Variant()]):
        raise ValueError("boom")
    assert _targets() == before and fp() == plain


def test_an_lk_drafter_is_a_plain_drafter_to_eyas(tmp_path):
    """The loss does not change what a drafter computes: the unpatched eyas reads an lk drafter; patches do not nest."""
    from eyas.drafter.model import Eagle3Drafter
    from lab.tests.test_eagle31 import make_drafter

    with patched():
        out = make_drafter().save(tmp_path / "d")
        with pytest.raises(RuntimeError, match="already patched"), patched():
            pass
    assert json.loads((out / "config.json").read_text())["lab_loss"] == {"name": "lk", "kl_weight": 0.0}
    assert set(Eagle3Drafter.load(out).state_dict()) == set(make_drafter().state_dict())


def test_entry_point_options():
    assert lk.parse_args(["pipeline", "x.toml"]) == (Variant(), ["pipeline", "x.toml"])
    assert lk.parse_args(["--kl-weight", "0.25", "train"]) == (Variant(kl_weight=0.25), ["train"])
    assert lk.parse_args(["--kl-weight=0.5", "eval"])[0] == Variant(kl_weight=0.5)
    for bad in (["--kl-weight", "1", "train"], ["--kl-weight", "x", "train"], ["--kl-weight", "0.5"]):
        with pytest.raises(SystemExit):
            lk.parse_args(bad)
    with pytest.raises(ValueError):
        Variant(kl_weight=-0.1)

    got = run.parse_args(
        ["--variant", "eagle31", "--fc-norm", "concat", "--variant=lk", "--kl-weight", "0.2", "--", "pipeline", "r"]
    )
    assert got == ([eagle31.Variant(fc_norm="concat"), Variant(kl_weight=0.2)], ["pipeline", "r"])
    assert run.parse_args(["--variant", "lk", "--", "train"]) == ([Variant()], ["train"])
    for bad in (
        ["--variant", "lk", "pipeline"],  # no --
        ["--variant", "lk", "--"],  # no eyas command
        ["--", "pipeline"],  # no variant
        ["--variant", "lk", "--variant", "lk", "--", "train"],
        ["--variant", "fast", "--", "train"],
        ["--variant", "lk", "--fc-norm", "concat", "--", "train"],  # eagle31's option given to lk
        ["--kl-weight", "0.2", "--variant", "lk", "--", "train"],
    ):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


# ----------------------------------------------------------------------------- the entry point


def test_the_entry_point_trains_evaluates_and_exports_on_copied_stages(tmp_path, tiny_target_dir):
    """`python lab/variants/lk.py pipeline ...` on a workdir whose regenerate/ and prepared/ were copied from a
    plain run (which trained too, with the same seed): both stages are skipped, the variant trains, eval reports a
    tau, the exports are plain EAGLE-3 ones (the unpatched eyas reads them), the drafter carries the marker, and
    the logged loss is LK's: below the plain run's cross-entropy from the same start."""
    from eyas.drafter.reader import read_drafter

    base, workdir, stderr = variant_pipeline(
        tmp_path, "lk", until="train", sets=smoke_sets(tiny_target_dir, "train.seed=3")
    )
    assert "lab variant lk (kl_weight=0): eyas patched for this run" in stderr
    drafter = workdir / "train" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["lab_loss"] == Variant().marker()
    assert "lab_loss" not in json.loads((base / "train" / "drafter" / "config.json").read_text())
    read_drafter(workdir / "export" / "sglang")

    def first_loss(d):
        return next(
            r["loss"]
            for r in map(json.loads, (d / "train" / "metrics.jsonl").read_text().splitlines())
            if "step" in r and "loss" in r
        )

    assert 0 < first_loss(workdir) < 0.8 * first_loss(base)
