"""Decode and prefill attention (eyas.regen.attention): the per-row Triton kernel equals the SDPA
reference for any row length, and the engine on the kernel equals `generate`.

The kernel runs on CPU under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is imported: the Triton checks run in a child process (`_in_interpreter`). Without
triton they skip, with the reason (CI has none)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas.regen import attention as A

needs_triton = pytest.mark.skipif(A.TRITON_ERROR is not None, reason=f"triton unavailable: {A.TRITON_ERROR}")


def _in_interpreter(call: str) -> str:
    """Run `tests.test_regen_attention.<call>` in a child with TRITON_INTERPRET=1; its stdout (the
    checks print a marker once they passed), failing with its output if the child failed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = f"import tests.test_regen_attention as t; t.{call}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@needs_triton
def test_triton_decode_equals_sdpa_for_every_length():
    out = _in_interpreter("check_kernel(3, 3); t.check_kernel(2, 1)")
    assert "kernel ok 3 3" in out and "kernel ok 2 1" in out, out[-2000:]  # both checks ran to the end


def check_kernel(kv_heads: int, groups: int) -> None:
    """Lengths 1, one under / at / over the tile and the split, and the whole cache; rows whose
    keys after their length are garbage (the kernel must not read them)."""
    g = torch.Generator().manual_seed(0)
    S, D = 3 * A.SPLIT - 64 + 8, 64  # not a multiple of the split, nor of the tile
    lens = [1, A.BLOCK_N - 1, A.BLOCK_N, A.BLOCK_N + 1, A.SPLIT, A.SPLIT + 1, 2 * A.SPLIT + 3, S]
    B = len(lens)
    q = torch.randn(B, kv_heads * groups, D, generator=g)
    k = torch.randn(B, kv_heads, S, D, generator=g)
    v = torch.randn(B, kv_heads, S, D, generator=g)
    len_B = torch.tensor(lens)
    ref = A.decode_reference(q, k, v, len_B, 0.125, S)
    kp, vp = k.clone(), v.clone()
    for b, n in enumerate(lens):  # the kernel must not read past a row's length
        kp[b, :, n:] = 1e4  # would dominate the softmax
        vp[b, :, n:] = float("nan")
    got = A.decode_triton(q, kp, vp, len_B, 0.125)
    assert got.shape == (B, kv_heads * groups, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and against plain softmax attention written out, row by row
    for b, n in enumerate(lens):
        kr = k[b, :, :n].repeat_interleave(groups, 0)
        vr = v[b, :, :n].repeat_interleave(groups, 0)
        w = torch.softmax((q[b, :, None] @ kr.transpose(1, 2))[:, 0] * 0.125, -1)
        torch.testing.assert_close(got[b], (w[:, None] @ vr)[:, 0], rtol=1e-5, atol=1e-5)
    print("kernel ok", kv_heads, groups)


def test_packed_prefill_equals_per_prompt_causal_attention():
    g = torch.Generator().manual_seed(1)
    lens = [4, 1, 9]
    q = torch.randn(sum(lens), 6, 16, generator=g)
    k = torch.randn(sum(lens), 2, 16, generator=g)
    v = torch.randn(sum(lens), 2, 16, generator=g)
    got = A.prefill_per_prompt(q, k, v, lens, 0.25)
    start = 0
    for n in lens:
        for t in range(n):  # token t of a prompt sees tokens 0..t of the same prompt only
            kr = k[start : start + t + 1].repeat_interleave(3, 1)  # t+1,H,d
            vr = v[start : start + t + 1].repeat_interleave(3, 1)
            w = torch.softmax((kr * q[start + t]).sum(-1) * 0.25, 0)  # t+1,H
            torch.testing.assert_close(got[start + t], (w[..., None] * vr).sum(0), rtol=1e-5, atol=1e-5)
        start += n


def test_kernel_unavailable_reasons():
    assert A.flash_varlen_unavailable(torch.device("cpu"), torch.float32) is not None
    assert A.flash_varlen_unavailable(torch.device("cuda"), torch.float32) is not None  # fp32: no flash


@needs_triton
def test_engine_on_triton_kernel_equals_generate(tiny_target_dir):
    out = _in_interpreter(f"check_engine({str(tiny_target_dir)!r})")
    assert "engine ok" in out, out[-2000:]  # the engine ran on the kernel and matched generate


def check_engine(tiny_target_dir: str) -> None:
    """The whole engine with per-row attention (one span, every row its own length; refill at batch 2)."""
    from eyas.regen.local import StaticEngine
    from eyas.regen.sampling import Sampling
    from tests.test_regen_engine import PROMPTS, _generate_ids, _requests, _run

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    ref = _generate_ids(model, tok, PROMPTS, 10, [tok.eos_token_id])
    eng = StaticEngine(
        model,
        tok,
        sampling=Sampling(),
        max_len=128,
        batch=2,
        max_new_tokens=10,
        attention="triton",
        sync_every=3,
        refill_min=1,
    )
    assert eng.per_row and eng.spans == [128] and eng.describe()["decode_attention"] == "triton"
    res = _run(eng, _requests(PROMPTS, 10))
    assert [res[(i, 0)].token_ids for i in range(len(PROMPTS))] == ref
    stats = eng.stats()
    assert 0 < stats["attention_efficiency"] <= 1 and stats["decode_attention"] == "triton"
    assert stats["decode_tokens"] == sum(r.new_tokens for r in res.values()) - len(PROMPTS)
    print("engine ok", stats["attention_efficiency"])


def test_engine_sdpa_when_triton_cannot_run(tiny_target_dir, monkeypatch):
    """auto without a usable kernel (CPU, no interpreter): SDPA, with the reason recorded."""
    from eyas.regen.local import StaticEngine
    from eyas.regen.sampling import Sampling

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    eng = StaticEngine(model, tok, sampling=Sampling(), max_len=128, batch=2, max_new_tokens=4)
    d = eng.describe()
    assert d["decode_attention"] == "sdpa" and d["decode_attention_note"] and d["prefill_attention"] == "sdpa"
    with pytest.raises(ValueError, match="triton"):
        StaticEngine(model, tok, sampling=Sampling(), max_len=128, batch=2, max_new_tokens=4, attention="triton")
