"""The fused soft cross-entropy kernel (eyas.drafter.ce_kernel) equals `_chunk_ce`, and the head loss
picks it only where it runs and passes its start-up check.

The kernel runs on CPU under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is imported: the Triton checks run in a child process (`_in_interpreter`) and print
a marker once they passed. Without triton they skip, with the reason (CI has none). The interpreter
handles bf16 loads and stores here (no tl.dot), so bf16 inputs are checked too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from eyas import kernels
from eyas.drafter import ce_kernel as CE, ttt
from eyas.drafter.ttt import head_loss, teacher as ttt_teacher
from eyas.errors import EyasError

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable here")


def _in_interpreter(call: str) -> str:
    """Run `tests.test_ce_kernel.<call>` in a child with TRITON_INTERPRET=1; its stdout, failing
    with its output if the child failed."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    env.pop(kernels.ENV, None)
    code = f"import tests.test_ce_kernel as t; t.{call}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _chunk(c: int, V: int, s_dtype: torch.dtype, t_dtype: torch.dtype, seed: int):
    """Logits ~ N(0, 3); row 1 has weight 0; row 0 holds its maximum at two indices; half the tops hit."""
    g = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(c, V, generator=g)).to(s_dtype)
    t = (3 * torch.randn(c, V, generator=g)).to(t_dtype)
    s[0, 1] = s[0, V - 1] = s[0].max() + 1  # the tie straddles blocks; the first index must win
    w = torch.rand(c, generator=g)
    w[1] = 0.0
    top = s.float().argmax(-1)
    miss = torch.randint(1, V, (len(range(2, c, 2)),), generator=g)  # any id but the argmax
    top[2::2] = (top[2::2] + miss) % V
    return s, t, w, top


def _steps(seed: int):
    """Three TTT steps' rows of a head loss over 40 positions (hidden 12, vocab 30): (x, W, f, wt, weights, top,
    teacher rows, positions, lengths), each step's positions ascending, its teacher rows one further per step, every
    7th weight 0; x and W require gradients."""
    gen = torch.Generator().manual_seed(seed)
    N, Dm, V, steps = 40, 12, 30, 3
    rows = [torch.randperm(N - 1 - j, generator=gen)[: 24 - 4 * j].sort().values for j in range(steps)]
    pos, tr = torch.cat(rows), torch.cat([r + 1 + j for j, r in enumerate(rows)])
    x = torch.randn(pos.numel(), Dm, generator=gen).requires_grad_()
    W = torch.randn(V, Dm, generator=gen).requires_grad_()
    f, wt = torch.randn(N, Dm, generator=gen), torch.randn(V, Dm, generator=gen)
    top, wn = (f @ wt.T).argmax(-1)[tr], torch.rand(pos.numel(), generator=gen) + 0.1
    wn[::7] = 0
    return x, W, f, wt, wn, top, tr, pos, [r.numel() for r in rows]


@needs_triton
def test_kernel_equals_chunk_ce_under_interpreter():
    out = _in_interpreter("check_kernel()")
    assert out.count("kernel ok") == 6 and "all kernel checks ok" in out, out[-2000:]  # every case ran


def check_kernel() -> None:
    assert CE.kernel_unavailable(torch.device("cpu")) is None, CE.kernel_unavailable(torch.device("cpu"))
    cases = [  # (rows, V, s dtype, t dtype, block): V is never a multiple of the block
        (6, 3000, torch.float32, torch.float32, 1024),
        (5, 1000, torch.float32, torch.float32, 128),
        (4, 777, torch.bfloat16, torch.bfloat16, 256),
        (4, 777, torch.bfloat16, torch.float32, 256),
        (3, 50, torch.float32, torch.bfloat16, 64),  # one partial block: the row held whole (ONE_BLOCK)
        (5, 777, torch.bfloat16, torch.float32, 1024),  # ONE_BLOCK, bf16 student
    ]
    for i, (c, V, sd, td, block) in enumerate(cases):
        s, t, w, top = _chunk(c, V, sd, td, seed=i)
        ce, hits, g = CE.fused_chunk_ce(s, t, w, top, block_v=block)
        ce_r, hits_r, g_r = head_loss._chunk_ce(s, t, w, top)
        assert ce.dtype == torch.float32 and ce.shape == () and hits.dtype == torch.bool and g.dtype == sd
        assert hits[0] and torch.equal(hits, hits_r), (hits, hits_r)  # row 0: the first of the tied maxima
        assert 0 < hits.sum() < c  # both outcomes occur
        torch.testing.assert_close(ce, ce_r, rtol=1e-5, atol=1e-5)
        if sd == torch.float32:
            torch.testing.assert_close(g, g_r, rtol=1e-5, atol=1e-7)
        else:  # both round an fp32 value to bf16: at most one ulp apart
            torch.testing.assert_close(g.float(), g_r.float(), rtol=2**-7, atol=1e-7)
        assert torch.all(g[1] == 0)  # the zero-weight row
        print("kernel ok", i)
    # rows with a stride larger than V (a view into a wider buffer) and ce not scaled by w twice
    s, t, w, top = _chunk(4, 300, torch.float32, torch.float32, seed=9)
    wide = torch.zeros(4, 333)
    wide[:, :300] = s
    ce, hits, g = CE.fused_chunk_ce(wide[:, :300], t, w, top, block_v=128)
    p = torch.softmax(t, -1)
    per_row = torch.logsumexp(s, -1) - (p * s).sum(-1)  # soft CE written out
    torch.testing.assert_close(ce, (per_row * w).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, (torch.softmax(s, -1) - p) * w[:, None], rtol=1e-5, atol=1e-7)
    # the head loss picks the kernel here (interpreter, check passed) and still equals the reference
    kernels.forget()
    assert ttt.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32) is CE.fused_chunk_ce
    gen = torch.Generator().manual_seed(3)
    x, wv = torch.randn(10, 16, generator=gen), torch.randn(300, 16, generator=gen)
    f, wt = torch.randn(10, 16, generator=gen), torch.randn(300, 16, generator=gen)
    weight, topn = torch.rand(10, generator=gen), torch.zeros(10, dtype=torch.long)
    tot, _ = ttt.head_soft_ce(x, wv, f, wt, weight, topn, chunk_rows=4)
    torch.testing.assert_close(tot, ttt.reference_head_soft_ce(x, wv, f, wt, weight), rtol=1e-5, atol=1e-5)
    print("all kernel checks ok")


@needs_triton
def test_indexed_teacher_rows_under_interpreter():
    out = _in_interpreter("check_indexed()")
    assert out.count("indexed ok") == 4 and "head loss on a cached teacher ok" in out, out[-2000:]


def check_indexed() -> None:
    """t_rows mode: row n's teacher is table[t_rows[n]] (ids repeated and out of order, a table with
    more rows than the chunk and a row stride wider than V), equal to `_chunk_ce` on the gathered rows."""
    cases = [
        (6, 700, torch.float32, torch.float32, 256),
        (5, 777, torch.bfloat16, torch.bfloat16, 256),
        (4, 300, torch.bfloat16, torch.float32, 128),
        (3, 50, torch.float32, torch.bfloat16, 64),
    ]
    for i, (c, V, sd, td, block) in enumerate(cases):
        s, _, w, top = _chunk(c, V, sd, td, seed=20 + i)
        gen = torch.Generator().manual_seed(40 + i)
        wide = (3 * torch.randn(c + 5, V + 9, generator=gen)).to(td)
        table = wide[:, :V]  # [c + 5, V], row stride V + 9
        t_rows = torch.randperm(c + 5, generator=gen)[:c].flip(0)
        t_rows[-1] = t_rows[0]  # a repeated id
        assert not torch.equal(t_rows.sort().values, t_rows)  # out of order
        ce, hits, g = CE.fused_chunk_ce(s, table, w, top, t_rows=t_rows, block_v=block)
        ce_r, hits_r, g_r = head_loss._chunk_ce(s, table[t_rows], w, top)
        assert torch.equal(hits, hits_r) and hits[0], (hits, hits_r)
        torch.testing.assert_close(ce, ce_r, rtol=1e-5, atol=1e-5)
        rtol = 1e-5 if sd == torch.float32 else 2**-7  # bf16 g: both round fp32, one ulp apart
        torch.testing.assert_close(g.float(), g_r.float(), rtol=rtol, atol=1e-7)
        assert torch.equal(g[-1], CE.fused_chunk_ce(s[-1:], table[t_rows[-1:]], w[-1:], top[-1:], block_v=block)[2][0])
        print("indexed ok", i)
    # the head loss on a cached teacher table: the kernel gets the whole table and the row ids (no
    # gathered copy), and loss and gradients equal the plain fp32 reference
    kernels.forget()
    chosen = ttt.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32)
    assert chosen is CE.fused_chunk_ce
    gen = torch.Generator().manual_seed(5)
    n, D, V, N = 11, 16, 300, 19
    x, wv = torch.randn(n, D, generator=gen, requires_grad=True), torch.randn(V, D, generator=gen, requires_grad=True)
    f_all, wt = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen)
    table = f_all @ wt.T  # [N, V]
    rows = torch.randint(0, N, (n,), generator=gen)
    rows[3] = rows[7]
    weight, topn = torch.rand(n, generator=gen), (table[rows]).argmax(-1)
    seen = []

    def spy(s, t, w, top, *, t_rows=None):
        seen.append((t.data_ptr() == table.data_ptr() and t.shape == table.shape, t_rows))
        return chosen(s, t, w, top, t_rows=t_rows)

    head_loss.chunk_ce_for = lambda *a: spy  # (a child process: nothing to restore)
    tot, _ = ttt.head_soft_ce(x, wv, None, None, weight, topn, chunk_rows=4, teacher_logits=table, teacher_rows=rows)
    assert len(seen) == 3 and all(whole for whole, _ in seen), seen  # 11 rows in chunks of 4
    assert torch.equal(torch.cat([r for _, r in seen]), rows)
    dx, dw = torch.autograd.grad(tot, (x, wv))
    ref = ttt.reference_head_soft_ce(x, wv, f_all[rows], wt, weight)
    dx_r, dw_r = torch.autograd.grad(ref, (x, wv))
    torch.testing.assert_close(tot, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw, dw_r, rtol=1e-4, atol=1e-5)
    print("head loss on a cached teacher ok")


def test_torch_fallback_gathers_teacher_rows(monkeypatch):
    kernels.forget()
    monkeypatch.setenv(kernels.ENV, "ce:off")
    chunk = ttt.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32)
    s, _, w, top = _chunk(5, 40, torch.float32, torch.float32, seed=1)
    table = torch.randn(9, 40, generator=torch.Generator().manual_seed(2))
    t_rows = torch.tensor([8, 2, 2, 0, 5])
    out, ref = chunk(s, table, w, top, t_rows=t_rows), head_loss._chunk_ce(s, table[t_rows], w, top)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
    assert not torch.equal(out[2], head_loss._chunk_ce(s, table[:5], w, top)[2])  # the rows did matter


def test_selection_falls_back_to_torch_on_cpu(monkeypatch):
    kernels.forget()
    monkeypatch.delenv(kernels.ENV, raising=False)
    cpu = torch.device("cpu")
    if CE.kernel_unavailable(cpu) is None:
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernel runs on CPU here")
    assert ttt.chunk_ce_for(cpu, torch.float32, torch.float32).__wrapped__ is head_loss._chunk_ce
    monkeypatch.setenv(kernels.ENV, "ce:on")
    kernels.forget()
    with pytest.raises(EyasError, match="ce:on, but"):
        ttt.chunk_ce_for(cpu, torch.float32, torch.float32)
    monkeypatch.setenv(kernels.ENV, "ce:fast")
    with pytest.raises(EyasError, match="expected NAME:on"):
        ttt.chunk_ce_for(cpu, torch.float32, torch.float32)


def test_forced_torch_skips_a_working_kernel(monkeypatch):
    kernels.forget()
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)  # as if on a GPU with triton

    @head_loss._gathering
    def kernel(s, t, w, top):  # a stand-in kernel that passes its check
        return head_loss._chunk_ce(s, t, w, top)

    monkeypatch.setattr(CE, "fused_chunk_ce", kernel)
    monkeypatch.setattr(head_loss, "check_fused_chunk_ce", lambda *a, **k: None)
    cpu = torch.device("cpu")
    monkeypatch.setenv(kernels.ENV, "ce:auto")
    assert ttt.chunk_ce_for(cpu, torch.float32, torch.float32) is kernel
    assert ttt.chunk_ce_for(cpu, torch.float32, torch.float32) is kernel  # decided once, then cached
    assert kernels.checked() == {("ce", "cpu", torch.float32, torch.float32): None}
    kernels.forget()
    monkeypatch.setenv(kernels.ENV, "ce:off")
    assert ttt.chunk_ce_for(cpu, torch.float32, torch.float32).__wrapped__ is head_loss._chunk_ce


@head_loss._gathering
def _wrong_argmax(s, t, w, top):  # the last index of a tied maximum
    ce, _, g = head_loss._chunk_ce(s, t, w, top)
    last = s.shape[1] - 1 - s.float().flip(-1).argmax(-1)
    return ce, last == top, g


@head_loss._gathering
def _wrong_grad(s, t, w, top):  # forgets the row weights in g
    ce, hits, _ = head_loss._chunk_ce(s, t, w, top)
    return ce, hits, (torch.softmax(s.float(), -1) - torch.softmax(t.float(), -1)).to(s.dtype)


@head_loss._gathering
def _wrong_loss(s, t, w, top):  # unweighted sum
    _, hits, g = head_loss._chunk_ce(s, t, w, top)
    return head_loss._chunk_ce(s, t, torch.ones_like(w), top)[0], hits, g


def _crashes(s, t, w, top, *, t_rows=None):
    raise RuntimeError("no kernel image is available")


def _reads_row_n(s, t, w, top, *, t_rows=None):  # ignores t_rows: the table's first c rows
    return head_loss._chunk_ce(s, t[: s.shape[0]], w, top)


def _crashes_indexed(s, t, w, top, *, t_rows=None):
    if t_rows is not None:
        raise TypeError("unexpected keyword t_rows")
    return head_loss._chunk_ce(s, t, w, top)


def _ranks(off_by: int, lse: bool = True):
    """A stand-in kernel with `rank_topk` whose top-K test uses K + off_by (0: right), taking `t_lse` (unless not
    `lse`)."""

    def kernel(s, t, w, top, *, t_rows=None, rank_topk=None, **kw):
        if kw and not lse:
            raise TypeError(f"unexpected keyword {next(iter(kw))}")
        t_lse = kw.get("t_lse")
        at = torch.arange(s.shape[0]) if t_rows is None else t_rows
        out = head_loss._chunk_ce(s, t[at], w, top, None if t_lse is None else t_lse[at])
        return out if rank_topk is None else (*out, ttt.top_rank_below(s, top, rank_topk + off_by))

    return kernel


@pytest.mark.parametrize("off_by, says", [(0, None), (1, "top-K test differs"), (-1, "top-K test differs")])
def test_startup_check_tests_the_fused_rank(monkeypatch, off_by, says):
    monkeypatch.setattr(CE, "fused_chunk_ce", _ranks(off_by))
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)  # as if on a GPU with triton
    why = ttt.check_fused_chunk_ce(torch.device("cpu"), torch.bfloat16, torch.float32, rows=8, vocab=2000)
    assert why is None if says is None else (why is not None and says in why), why


@pytest.mark.parametrize(
    "bad, says",
    [
        (_ranks(0), None),
        (_wrong_argmax, "hits differ"),
        (_wrong_grad, "gradient differs"),
        (_wrong_loss, "loss differs"),
        (_crashes, "failed: RuntimeError"),
        (_reads_row_n, "by index): "),
        (_crashes_indexed, "by index) failed: TypeError"),
    ],
)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_startup_check_catches_a_wrong_kernel(monkeypatch, bad, says, dtypes):
    monkeypatch.setattr(CE, "fused_chunk_ce", bad)
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)  # as if on a GPU with triton
    why = ttt.check_fused_chunk_ce(torch.device("cpu"), *dtypes, rows=8, vocab=2000)
    if says is None:
        assert why is None  # the reference itself passes: the tolerances are not too tight
    else:
        assert why is not None and says in why, why


@needs_triton
def test_top_rank_counted_in_the_kernel_under_interpreter():
    out = _in_interpreter("check_rank()")
    assert out.count("rank ok") == 4 and "head loss: fused top-K test as the separate one" in out, out[-2000:]


def check_rank() -> None:
    """rank_topk: the kernel's fourth output equals `top_rank_below` (ties with the token's logit do not count
    against it; a token id past the row is clamped as the torch test clamps it), blocked and whole-row, with the
    first three outputs unchanged; the head loss picks it (its start-up check passes) and gives the loss, gradients
    and hits of the torch fallback's separate test (EYAS_KERNELS=ce:off)."""
    cases = [
        (6, 700, torch.float32, 256, 3),
        (5, 777, torch.bfloat16, 256, 40),
        (4, 50, torch.float32, 64, 2),
        (5, 777, torch.bfloat16, 1024, 1),
    ]
    for i, (c, V, sd, block, k) in enumerate(cases):
        s, t, w, top = _chunk(c, V, sd, torch.float32, seed=60 + i)
        s[3, : k + 2] = s[3, top[3]]  # k + 1 logits tied with the token's (itself among them): still rank 0
        out = CE.fused_chunk_ce(s, t, w, top, rank_topk=k, block_v=block)
        plain = CE.fused_chunk_ce(s, t, w, top, block_v=block)
        want = ttt.top_rank_below(s, top, k)
        assert len(out) == 4 and out[3].dtype == torch.bool and torch.equal(out[3], want), (out[3], want)
        assert bool(want[3]) and 0 < int(want.sum()) <= c
        assert all(torch.equal(a, b) for a, b in zip(out[:3], plain))
        print("rank ok", i)
    far = CE.fused_chunk_ce(s, t, w, torch.full_like(top, V + 5), rank_topk=k, block_v=1024)[3]
    assert torch.equal(far, ttt.top_rank_below(s, torch.full_like(top, V + 5), k))
    x, W, f, wt, wn, top, tr, pos, lengths = _steps(11)
    N, topk = f.shape[0], 8
    chunk_ce_for = head_loss.chunk_ce_for
    got = {}
    for fused in (False, True):
        os.environ[kernels.ENV] = "ce:auto" if fused else "ce:off"
        chosen = ttt.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32)
        assert (chosen is CE.fused_chunk_ce) == fused
        calls = []

        def spy(*a, calls=calls, chosen=chosen, **kw):  # this iteration's
            calls.append("rank_topk" in kw)
            return chosen(*a, **kw)

        real = CE.fused_chunk_ce
        head_loss.chunk_ce_for = lambda *a: spy
        if fused:
            CE.fused_chunk_ce = spy  # (the head loss tests `chunk is CE.fused_chunk_ce`)
        try:
            total, _, hits = ttt.head_soft_ce_ranges(
                x,
                W,
                f,
                wt,
                wn,
                top,
                lengths,
                chunk_rows=5,
                compute_dtype=torch.float32,
                align=(pos, N, topk),
                teacher_rows=tr,
            )
        finally:
            CE.fused_chunk_ce = real
            head_loss.chunk_ce_for = chunk_ce_for
        assert calls and all(c == fused for c in calls), calls
        got[fused] = (total.detach(), hits, *torch.autograd.grad(total, [x, W]))
    (total_f, hits_f, gx_f, gw_f), (total_s, hits_s, gx_s, gw_s) = got[True], got[False]
    assert torch.equal(hits_f, hits_s)
    plain, _, _ = ttt.head_soft_ce_ranges(
        x, W, f, wt, wn, top, lengths, chunk_rows=5, compute_dtype=torch.float32, teacher_rows=tr
    )
    assert float(plain.detach()) > float(total_f) + 1e-3  # the test dropped rows: it mattered
    for a, b in ((total_f, total_s), (gx_f, gx_s), (gw_f, gw_s)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    print("head loss: fused top-K test as the separate one")


@needs_triton
def test_teacher_lse_under_interpreter():
    out = _in_interpreter("check_lse()")
    assert out.count("lse ok") == 5 and "all lse checks ok" in out, out[-2000:]


def check_lse() -> None:
    """t_lse: the kernel given the teacher's log-sum-exp (fp32, indexed like t) gives the outputs it gives without it
    (loss, hits, g and the top-K test), blocked and whole-row, the teacher given directly and by `t_rows`, fp32 and
    bf16 logits; given it moved by 0.5 it follows p = exp(t - t_lse) (`_chunk_ce` given the same), so it reads it,
    at the table's row."""
    cases = [  # (rows, V, s dtype, t dtype, block, teacher rows by index): V is never a multiple of the block
        (6, 700, torch.float32, torch.float32, 256, False),
        (5, 777, torch.bfloat16, torch.bfloat16, 256, True),
        (4, 300, torch.bfloat16, torch.float32, 128, True),
        (4, 777, torch.float32, torch.bfloat16, 1024, False),  # the row held whole (ONE_BLOCK)
        (3, 50, torch.bfloat16, torch.float32, 64, True),  # ONE_BLOCK
    ]
    for i, (c, V, sd, td, block, by_index) in enumerate(cases):
        s, t, w, top = _chunk(c, V, sd, td, seed=80 + i)
        t_rows = torch.arange(c)
        if by_index:  # a table with more rows than the chunk and a row stride past V; ids out of order, one repeated
            gen = torch.Generator().manual_seed(90 + i)
            t = (3 * torch.randn(c + 5, V + 9, generator=gen)).to(td)[:, :V]
            t_rows = torch.randperm(c + 5, generator=gen)[:c]
            t_rows[-1] = t_rows[0]
        kw = {"t_rows": t_rows, "block_v": block} if by_index else {"block_v": block}
        lse = torch.logsumexp(t.float(), -1)
        plain = CE.fused_chunk_ce(s, t, w, top, rank_topk=3, **kw)
        given = CE.fused_chunk_ce(s, t, w, top, rank_topk=3, t_lse=lse, **kw)
        assert torch.equal(given[1], plain[1]) and torch.equal(given[3], plain[3]), (given, plain)
        assert 0 < int(plain[1].sum()) < c and 0 < int(plain[3].sum())  # the booleans are not all alike
        rtol = 1e-5 if sd == torch.float32 else 2**-7  # bf16 g: both round fp32, one ulp apart
        torch.testing.assert_close(given[0], plain[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(given[2].float(), plain[2].float(), rtol=rtol, atol=1e-7)
        moved = lse + 0.5
        off = CE.fused_chunk_ce(s, t, w, top, t_lse=moved, **kw)
        want = head_loss._chunk_ce(s, t[t_rows], w, top, moved[t_rows])
        torch.testing.assert_close(off[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(off[2].float(), want[2].float(), rtol=rtol, atol=1e-7)
        assert abs(float(off[0]) - float(plain[0])) > 1e-2, (off[0], plain[0])  # it did use the moved one
        assert float((off[2].float() - plain[2].float()).abs().max()) > 1e-2
        print("lse ok", i)
    print("all lse checks ok")


@needs_triton
def test_head_loss_with_teacher_lse_under_interpreter():
    out = _in_interpreter("check_lse_head()")
    assert "packed loss: teacher lse as without" in out and "groups: teacher lse as without" in out, out[-2000:]


def check_lse_head() -> None:
    """The packed TTT loss on a kept teacher table (whose log-sum-exp `packed_teacher` makes) and the head loss on a
    recomputed teacher's row groups, through the kernel given `t_lse` (in 16-entry blocks, the reachability test
    counted in it), give the loss, gradients and hits of the torch fallback (EYAS_KERNELS=ce:off); the kernel gets
    the table's own log-sum-exp, or the log-sum-exp of the group's logits it reads."""
    import tests.test_train_packed as TP
    from tests.test_drafter_ttt import tiny_drafter

    cpu = torch.device("cpu")
    ids, seg, rows, _, aux, final, den, head, used, t2d = TP._packed_on(cpu, [9, 14, 21], K=4, seed=3)
    x, W, f, wt, wn, top, tr, pos, lengths = _steps(13)
    real_kernel, real_choice = CE.fused_chunk_ce, head_loss.chunk_ce_for
    got = {}
    try:
        for on in (False, True):
            os.environ[kernels.ENV] = "ce:auto" if on else "ce:off"
            CE.fused_chunk_ce = real_kernel
            chosen = ttt.chunk_ce_for(cpu, torch.float32, torch.float32)
            assert (chosen is real_kernel) == on  # the start-up check passed (with the log-sum-exp cases)
            calls = []

            def spy(s, t, w, top_c, *, calls=calls, chosen=chosen, **kw):  # this iteration's
                calls.append((t, kw.get("t_lse")))
                return chosen(s, t, w, top_c, block_v=16, **kw)

            if on:
                CE.fused_chunk_ce = spy  # (the head loss tests `chunk is CE.fused_chunk_ce`)
                head_loss.chunk_ce_for = lambda *a: spy
            m = tiny_drafter(seed=2, vocab_size=80, draft_vocab_size=TP.V)
            m.set_vocab(used)
            pt = ttt.packed_teacher(final, head, head[used], used, t2d, chunk_rows=7)
            assert pt.logits_NV is not None and (pt.lse_N is not None) == on
            out = ttt.ttt_loss_packed(
                m,
                input_ids_N=ids,
                seg=seg,
                rows=rows,
                aux_NAD=aux,
                teacher=pt,
                cfg=ttt.TTTConfig(steps=4, align_topk=8),
                denominators=den,
                chunk_rows=6,
            )
            grads = torch.autograd.grad(out.loss, [p for p in m.parameters() if p.requires_grad])
            assert (len(calls) > 0) == on and all(t is pt.logits_NV and lse is pt.lse_N for t, lse in calls)
            packed = (out.loss.detach(), out.ce_sum, out.correct, *grads)
            calls.clear()
            total, per_step, hits = ttt.head_soft_ce_ranges(
                x,
                W,
                f,
                wt,
                wn,
                top,
                lengths,
                chunk_rows=5,
                compute_dtype=torch.float32,
                align=(pos, f.shape[0], 8),
                teacher_rows=tr,
            )
            assert (len(calls) >= 2) == on and all(t.shape[0] <= 5 for t, _ in calls)  # the groups' logits
            for t, lse in calls:  # each group's log-sum-exp, one per row of its logits
                torch.testing.assert_close(lse, torch.logsumexp(t.float(), -1), rtol=1e-6, atol=1e-6)
            got[on] = (packed, (total.detach(), per_step, hits, *torch.autograd.grad(total, [x, W])))
    finally:
        CE.fused_chunk_ce, head_loss.chunk_ce_for = real_kernel, real_choice
        os.environ.pop(kernels.ENV, None)
    for (on, off), name in zip(zip(got[True], got[False]), ("packed loss", "groups")):
        assert torch.equal(on[2], off[2])  # the hits (packed: correct per step, as counts)
        assert float(off[0]) > 0
        for a, b in zip(on, off):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        print(name + ": teacher lse as without")


def _small_teacher(seed: int, dtype: torch.dtype = torch.float32):
    """A small random `packed_teacher` case: an 80-token target vocab whose ids 5..64 are the draft vocab, 41 rows in
    chunks of 7 (the last partial). (teacher(**kw) -> PackedTeacher, final [41, 16], head [80, 16], used ids)."""
    g = torch.Generator().manual_seed(seed)
    Vt, Dm, N = 80, 16, 41
    head = (2 * torch.randn(Vt, Dm, generator=g)).to(dtype)
    final = torch.randn(N, Dm, generator=g).to(dtype)
    used = torch.arange(5, 65)
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[used] = True

    def teacher(**kw):
        return ttt.packed_teacher(
            final, head, head[used], used, t2d, chunk_rows=7, unused=ttt.unused_head(head, t2d), **kw
        )

    return teacher, final, head, used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_teacher_keeps_the_teacher_lse_for_the_kernel(monkeypatch, dtype):
    """`packed_teacher` keeps the fp32 log-sum-exp of each row of the kept logits (made chunk by chunk,
    the last chunk partial), also for bf16 logits (whose bf16 log-sum-exp keeps 3 significant digits); none when the
    table is not kept, the kernel is switched off (EYAS_KERNELS=ce:off), or the fused kernel (its one reader) does not
    run on the device."""
    teacher, final, _, _ = _small_teacher(4, dtype)
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: "no kernel here")
    assert teacher().logits_NV is not None and teacher().lse_N is None
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)  # as where the kernel runs
    pt = teacher()
    assert pt.logits_NV.dtype == dtype and pt.lse_N.dtype == torch.float32 and pt.lse_N.shape == (final.shape[0],)
    torch.testing.assert_close(pt.lse_N, torch.logsumexp(pt.logits_NV.float(), -1), rtol=1e-6, atol=1e-6)
    assert float(pt.lse_N.std()) > 0.5  # rows that differ
    assert teacher(cache_bytes=0).lse_N is None  # not kept: recomputed per chunk, no table to go with it
    monkeypatch.setenv(kernels.ENV, "ce:off")
    plain = teacher()
    assert plain.lse_N is None
    # the same argmax flags and table with the log-sum-exp made beside them (the split path's one-read reduction)
    assert torch.equal(pt.top_N, plain.top_N) and torch.equal(pt.in_vocab_N, plain.in_vocab_N)
    assert torch.equal(pt.logits_NV, plain.logits_NV) and not bool(plain.in_vocab_N.all())


def _with_lse(misuse: str | None):
    """A stand-in kernel taking `t_lse` (and `rank_topk`): right (None), ignoring it ("ignores"), or reading it at
    the chunk's row instead of the table's ("chunk row")."""

    def kernel(s, t, w, top, *, t_rows=None, t_lse=None, rank_topk=None):
        at = torch.arange(s.shape[0]) if t_rows is None else t_rows
        lse = None if t_lse is None or misuse == "ignores" else t_lse[torch.arange(s.shape[0]) if misuse else at]
        out = head_loss._chunk_ce(s, t[at], w, top, lse)
        return out if rank_topk is None else (*out, ttt.top_rank_below(s, top, rank_topk))

    return kernel


@pytest.mark.parametrize(
    "kernel, says",
    [
        (_with_lse(None), None),
        (_with_lse("ignores"), "log-sum-exp moved by 0.5): loss differs"),
        (_with_lse("chunk row"), "by index, log-sum-exp given): loss differs"),
        (_ranks(0, lse=False), "log-sum-exp given) failed: TypeError"),
    ],
)
def test_startup_check_tests_the_teacher_lse(monkeypatch, kernel, says):
    monkeypatch.setattr(CE, "fused_chunk_ce", kernel)
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)  # as if on a GPU with triton
    why = ttt.check_fused_chunk_ce(torch.device("cpu"), torch.bfloat16, torch.float32, rows=8, vocab=2000)
    assert why is None if says is None else (why is not None and says in why), why
    # the choice: the kernel where its check passed, else the torch version
    kernels.forget()
    monkeypatch.delenv(kernels.ENV, raising=False)
    chosen = ttt.chunk_ce_for(torch.device("cpu"), torch.bfloat16, torch.float32)
    assert chosen is kernel if says is None else chosen.__wrapped__ is head_loss._chunk_ce
    assert list(kernels.checked()) == [("ce", "cpu", torch.bfloat16, torch.float32)]


def test_head_loss_hands_the_teacher_lse_to_the_fused_kernel_only(monkeypatch):
    """The teacher's log-sum-exp, with a stand-in for the fused kernel (no triton needed): the table's head loss hands it the
    table's log-sum-exp and each row group's head loss the log-sum-exp of the group's logits, with the loss the
    torch version gives (which is never handed one: it would fail on the keyword)."""
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)
    calls = []

    def kernel(s, t, w, top, **kw):
        calls.append((t, kw.get("t_lse")))
        return _with_lse(None)(s, t, w, top, **kw)

    monkeypatch.setattr(CE, "fused_chunk_ce", kernel)
    x, W, f, wt, wn, top, tr, pos, lengths = _steps(17)
    table = f @ wt.T
    lse = torch.logsumexp(table, -1)
    chunks = sum(-(-n // 5) for n in lengths)  # the table's calls, and the groups' (a slice each)
    slices = sum(len(sl) for *_, sl in ttt.teacher_groups(tr, lengths, f.shape[0], 5))
    results = {}
    for want in ("auto", "torch"):
        monkeypatch.setenv(kernels.ENV, "ce:auto" if want == "auto" else "ce:off")
        kernels.forget()
        assert (ttt.chunk_ce_for(torch.device("cpu"), torch.float32, torch.float32) is kernel) == (want == "auto")
        calls.clear()
        kept = ttt.head_soft_ce_ranges(
            x,
            W,
            None,
            None,
            wn,
            top,
            lengths,
            chunk_rows=5,
            teacher_logits=table,
            teacher_rows=tr,
            teacher_lse=lse,
            align=(pos, f.shape[0], 8),
        )
        assert all(t is table and t_lse is lse for t, t_lse in calls) and len(calls) == (want == "auto") * chunks
        calls.clear()
        grouped = ttt.head_soft_ce_ranges(x, W, f, wt, wn, top, lengths, chunk_rows=5, teacher_rows=tr)
        assert len(calls) == (want == "auto") * slices and all(t.shape[0] <= 5 for t, _ in calls)
        for t, t_lse in calls:
            torch.testing.assert_close(t_lse, torch.logsumexp(t, -1))
        results[want] = (kept[0], grouped[0])
    torch.testing.assert_close(results["auto"], results["torch"], rtol=1e-6, atol=1e-6)


@needs_triton
def test_row_max_lse_under_interpreter():
    out = _in_interpreter("check_row_stats()")
    assert "row stats ok" in out and "packed teacher: stats kernel as torch" in out, out[-2000:]


def check_row_stats() -> None:
    """`ce_kernel.row_max_lse` equals torch's max, first index of the max and fp32 log-sum-exp, in blocks smaller than
    the row (the last partial) and in one block, on strided bf16 and fp32 rows with ties across blocks; its start-up
    check passes; and `packed_teacher` with the kernel gives the table, flags and log-sum-exp it gives
    with the torch reduction (the kernel chosen, not the fallback)."""
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        wide = (3 * torch.randn(9, 100 + 5, generator=g)).to(dtype)
        x = wide[:, :100]
        x[0, 3] = x[0, 97] = 30.0  # a tie across blocks: the first index
        x[1, 99] = 31.0  # the maximum in the last, partial block
        x[2, 0] = 80.0  # far above the rest, in the first block
        for block in (16, 128):
            got = CE.row_max_lse(x, block_v=block)
            ref = ttt_teacher._teacher_max_lse(x)
            assert got[0].dtype == dtype and got[1].dtype == torch.int64 and got[2].dtype == torch.float32
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (got[1], ref[1])
            assert int(got[1][0]) == 3 and int(got[1][1]) == 99
            torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-5)
    cpu = torch.device("cpu")
    assert ttt.check_row_max_lse(cpu, torch.bfloat16, vocab=300) is None
    print("row stats ok")
    teacher, _, _, _ = _small_teacher(8)
    got = {}
    try:
        for on in (False, True):
            os.environ[kernels.ENV] = "teacher_stats:auto" if on else "teacher_stats:off"
            assert (ttt.teacher_stats_for(cpu, torch.float32) is CE.row_max_lse) == on
            got[on] = teacher()
    finally:
        os.environ.pop(kernels.ENV, None)
    a, b = got[True], got[False]
    assert a.lse_N is not None and torch.equal(a.logits_NV, b.logits_NV)
    assert torch.equal(a.top_N, b.top_N) and torch.equal(a.in_vocab_N, b.in_vocab_N)
    torch.testing.assert_close(a.lse_N, b.lse_N, rtol=1e-6, atol=1e-5)
    print("packed teacher: stats kernel as torch")


@pytest.mark.parametrize("wrong", ["max", "index", "lse", "raises"])
def test_row_stats_check_catches_a_wrong_kernel(monkeypatch, wrong):
    """`check_row_max_lse` refuses a kernel whose maximum, index of the maximum (e.g. the last of a tie) or
    log-sum-exp is off, or that fails; `teacher_stats_for` then keeps the torch reduction."""

    def bad(x, **kw):
        if wrong == "raises":
            raise RuntimeError("no such kernel")
        m, i, lse = ttt_teacher._teacher_max_lse(x)
        if wrong == "max":
            m = m + 1
        elif wrong == "index":  # the last index of each row's maximum
            i = x.shape[1] - 1 - x.flip(-1).float().argmax(-1)
        else:
            lse = lse + 1e-3
        return m, i, lse

    monkeypatch.setattr(CE, "row_max_lse", bad)
    monkeypatch.setattr(CE, "stats_unavailable", lambda device: None)
    cpu = torch.device("cpu")
    why = ttt.check_row_max_lse(cpu, torch.bfloat16, vocab=300)
    assert why is not None and (
        {"max": "maximum differs", "index": "first index", "lse": "log-sum-exp", "raises": "failed"}[wrong] in why
    ), why
    kernels.forget()
    assert ttt.teacher_stats_for(cpu, torch.bfloat16) is not bad


def test_row_stats_default_falls_back_where_the_kernel_cannot_run(monkeypatch):
    """With the default settings, where the row statistics kernel cannot run (no Triton) but the fused CE kernel
    wants the teacher's log-sum-exp, the torch reduction is chosen without trying the kernel, and `packed_teacher`
    gives the eager reference's draft argmax and fp32 log-sum-exp."""
    tried = []
    monkeypatch.setattr(CE, "kernel_unavailable", lambda device: None)
    monkeypatch.setattr(CE, "stats_unavailable", lambda device: "triton is not importable")
    monkeypatch.setattr(CE, "row_max_lse", lambda x, **kw: tried.append(x) or ttt_teacher._teacher_max_lse(x))
    kernels.forget()
    cpu = torch.device("cpu")
    assert ttt.teacher_stats_for(cpu, torch.float32) is not CE.row_max_lse
    teacher, final, head, used = _small_teacher(3)
    out = teacher()
    restricted = final @ head[used].T
    assert not tried and out.lse_N is not None
    assert torch.equal(out.top_N, restricted.argmax(-1))
    torch.testing.assert_close(out.lse_N, torch.logsumexp(restricted, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernel)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_max_lse_on_cuda(dtype):
    """The compiled row statistics kernel passes its start-up check on the GPU, and on a chunk of the SmolLM2 step's
    shape ([8,192 x 32,000], logits ~ N(0, 3) with a tie in every 97th row) gives torch's maximum and first index
    exactly and its fp32 log-sum-exp to rounding."""
    dev = torch.device("cuda")
    assert ttt.check_row_max_lse(dev, dtype) is None
    g = torch.Generator(device="cpu").manual_seed(11)
    x = (3 * torch.randn(8192, 32000, generator=g)).to(dtype)
    x[::97, 31999] = x[::97, 100] = 30.0
    x = x.to(dev)
    got, ref = CE.row_max_lse(x), ttt_teacher._teacher_max_lse(x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert int(got[1][0]) == 100
    assert float((got[2] - ref[2]).abs().max()) < 1e-4
