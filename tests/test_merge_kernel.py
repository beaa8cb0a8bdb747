"""The Triton merge of the TTT attention's diagonal keys (eyas.drafter.merge_kernel) equals the torch merge
(`ttt._merge_fwd` / `_merge_bwd`), and the attention uses it only under ttt.TRITON_MERGE, where it applies and passed
its start-up check.

The kernels run on CPU under Triton's interpreter, switched on (TRITON_INTERPRET=1) before triton is imported: those
checks run in a child process and print a marker once they passed. Without triton they skip (CI has none); the
choice between the kernels and the torch version is tested with stand-ins."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from eyas.drafter import merge_kernel as MK
from eyas.drafter import ttt

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable here")


def _in_interpreter(call: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", f"import tests.test_merge_kernel as t; t.{call}"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _inputs(J: int, dtype: torch.dtype, *, H: int = 3, T: int = 70, d: int = 64, seed: int = 0):
    """q laid out [B, T, H, d] (as the packed unroll keeps it) seen as [B, H, T, d]; J diagonals; the causal part's
    output and fp32 log-sum-exp; an output gradient and the causal keys' share of dq."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q = mk(1, T, H, d).transpose(1, 2)
    kds, vds = [mk(1, H, T, d) for _ in range(J)], [mk(1, H, T, d) for _ in range(J)]
    lse_c = 2 * torch.randn(1, H, T, generator=g) + 3
    return q, kds, vds, mk(1, H, T, d), lse_c, mk(1, H, T, d), mk(1, H, T, d), d ** -0.5


def check_merge() -> None:
    """(child) Every J the kernels take, fp32 and bf16: forward and backward as the torch merge."""
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        for J in range(1, MK.MAX_J + 1):
            q, kds, vds, out_c, lse_c, dout, dq_c, scale = _inputs(J, dtype, seed=J)
            out, lse = MK.merge_fwd(q, kds, vds, out_c, lse_c, scale)
            r_out, r_lse = ttt._merge_fwd(q, kds, vds, out_c, lse_c, scale)
            assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
            got = MK.merge_bwd(q, kds, vds, r_out, r_lse, dout, dq_c, scale)
            ref = ttt._merge_bwd(q, kds, vds, r_out, r_lse, dout, dq_c, scale)
            pairs = [(out, r_out), (lse, r_lse), (got[0], ref[0]), *zip(got[1], ref[1]), *zip(got[2], ref[2])]
            assert len(pairs) == 3 + 2 * J
            for i, (a, b) in enumerate(pairs):
                assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
                err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                assert err <= tol, (dtype, J, i, err)
        assert ttt.check_merge_kernels(torch.device("cpu"), dtype) is None
    print("merge ok")


def check_attention() -> None:
    """(child) The attention with its gradients under TRITON_MERGE: the Triton merge chosen, the same outputs and
    gradients as the torch merge, and as the dense reference."""
    ttt._MERGE_CHOICE.clear()
    g = torch.Generator().manual_seed(3)
    mk = lambda: torch.randn(2, 4, 50, 64, generator=g).requires_grad_()  # noqa: E731
    q, ks, vs = mk(), [mk() for _ in range(4)], [mk() for _ in range(4)]
    dout = torch.randn(2, 4, 50, 64, generator=g)
    results = []
    for on in (False, True):
        ttt.TRITON_MERGE = on
        out = ttt.fast_attention(q, ks, vs)
        results.append([out, *torch.autograd.grad(out, [q, *ks, *vs], dout)])
    ttt.TRITON_MERGE = False
    assert ttt._MERGE_CHOICE == {("cpu", torch.float32, torch.float32, 64): True}, ttt._MERGE_CHOICE
    ref = ttt.reference_attention(q, ks, vs)
    ref = [ref, *torch.autograd.grad(ref, [q, *ks, *vs], dout)]
    for a, b, c in zip(results[1], results[0], ref):
        assert float((a - b).abs().max()) < 1e-4 and float((a - c).abs().max()) < 1e-3
    print("attention ok")


@needs_triton
def test_merge_kernels_equal_the_torch_merge_under_interpreter():
    assert "merge ok" in _in_interpreter("check_merge()")


@needs_triton
def test_attention_with_the_triton_merge_under_interpreter():
    assert "attention ok" in _in_interpreter("check_attention()")


def test_what_the_kernels_do_not_take():
    q, kds, vds, *_ = _inputs(2, torch.float32, T=8)
    assert MK.merge_unsupported(q, kds, vds) is None
    assert "0 diagonals" in MK.merge_unsupported(q, [], [])
    assert "8 diagonals (the kernels take 1 to 6)" in MK.merge_unsupported(q, kds * 4, vds * 4)
    grouped = [k[:, :1] for k in kds]  # one key/value head for the three query heads
    assert "grouped diagonals" in MK.merge_unsupported(q, grouped, grouped)
    assert "strides" in MK.merge_unsupported(q, kds, [vds[0], vds[1].double()])
    assert "strides" in MK.merge_unsupported(q, [kds[0], kds[1].transpose(1, 2).contiguous().transpose(1, 2)], vds)
    flipped = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert "not contiguous" in MK.merge_unsupported(flipped, [k.transpose(-1, -2).contiguous().transpose(-1, -2)
                                                              for k in kds], vds)


def test_the_torch_merge_unless_the_setting_is_on_and_the_kernels_run(monkeypatch):
    q, kds, vds, *_ = _inputs(2, torch.float32, T=8)
    monkeypatch.setattr(ttt, "_MERGE_CHOICE", {})
    monkeypatch.setattr(ttt, "TRITON_MERGE", False)
    assert ttt._merges(q, kds, vds) == (ttt._merge_fwd, ttt._merge_bwd) and ttt._MERGE_CHOICE == {}
    monkeypatch.setattr(ttt, "TRITON_MERGE", True)
    # on the CPU without the interpreter the kernels do not run (or triton is absent): the torch merge, remembered
    monkeypatch.setattr(MK, "kernel_unavailable", lambda device: "the Triton kernel needs CUDA")
    assert ttt._merges(q, kds, vds) == (ttt._merge_fwd, ttt._merge_bwd)
    assert ttt._MERGE_CHOICE == {("cpu", torch.float32, torch.float32, 64): False}
    # where they run and pass their check: the kernels; grouped diagonals keep the torch merge without a check
    monkeypatch.setattr(ttt, "_MERGE_CHOICE", {})
    monkeypatch.setattr(MK, "kernel_unavailable", lambda device: None)
    monkeypatch.setattr(ttt, "check_merge_kernels", lambda device, dtype, d: None)
    assert ttt._merges(q, kds, vds) == (MK.merge_fwd, MK.merge_bwd)
    grouped = [k[:, :1] for k in kds]
    assert ttt._merges(q, grouped, grouped) == (ttt._merge_fwd, ttt._merge_bwd)


def _wrong_lse(q, kds, vds, out_c, lse_c, scale):
    out, lse = ttt._merge_fwd(q, kds, vds, out_c, lse_c, scale)
    return out, lse + 0.05


def _wrong_dk(q, kds, vds, out, lse, dout, dq_c, scale):
    dq, dks, dvs = ttt._merge_bwd(q, kds, vds, out, lse, dout, dq_c, scale)
    return dq, [dks[0], *(2 * dk for dk in dks[1:])], dvs


def _crashes(*args):
    raise RuntimeError("no kernel image")


@pytest.mark.parametrize("fwd, bwd, says", [
    (ttt._merge_fwd, ttt._merge_bwd, None), (_wrong_lse, ttt._merge_bwd, "lse differs"),
    (ttt._merge_fwd, _wrong_dk, "dk1 differs"), (_crashes, ttt._merge_bwd, "failed: RuntimeError: no kernel image")])
def test_startup_check_catches_a_wrong_merge(monkeypatch, fwd, bwd, says):
    monkeypatch.setattr(MK, "merge_fwd", fwd)
    monkeypatch.setattr(MK, "merge_bwd", bwd)
    why = ttt.check_merge_kernels(torch.device("cpu"), torch.float32)
    assert why is None if says is None else (why is not None and says in why), why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_merge_kernels_on_cuda(dtype, d):
    """The compiled kernels (SmolLM2's head dim 64, the 8B shape's 128) pass the start-up check on the GPU, and every
    J the kernels take gives the torch merge's outputs."""
    dev = torch.device("cuda")
    assert ttt.check_merge_kernels(dev, dtype, d=d) is None
    for J in range(1, MK.MAX_J + 1):
        q, kds, vds, out_c, lse_c, dout, dq_c, scale = (x.to(dev) if torch.is_tensor(x) else x
                                                        for x in _inputs(J, dtype, d=d, T=1000, seed=J))
        kds, vds = [k.to(dev) for k in kds], [v.to(dev) for v in vds]
        out, lse = MK.merge_fwd(q, kds, vds, out_c, lse_c, scale)
        r_out, r_lse = ttt._merge_fwd(q, kds, vds, out_c, lse_c, scale)
        assert float((lse - r_lse).abs().max()) < 1e-3
        assert float((out.float() - r_out.float()).abs().max()) < (1e-4 if dtype == torch.float32 else 3e-2)
