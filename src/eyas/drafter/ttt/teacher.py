"""The teacher: the target's distribution p_{t+1} over the draft vocabulary at every position, made from its final
states and lm_head. `Teacher` holds the padded path's probabilities; `PackedTeacher` the packed path's final states
(and, when they fit, its draft-vocab logits with their row statistics), recomputed chunk by chunk otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas import kernels
from eyas.drafter import ce_kernel as CE
from eyas.drafter.ttt.compiled import _fast


@dataclass
class Teacher:
    probs_BTV: torch.Tensor
    """fp32 softmax of the target's logits restricted to the draft vocab, at every position."""
    top_BT: torch.Tensor
    """Draft id of the target's argmax over the draft vocab."""
    in_vocab_BT: torch.Tensor
    """True where the target's full-vocab argmax is in the draft vocab."""


@torch.no_grad()
def teacher_from_final(
    final_BTD: torch.Tensor,
    head_weight_VtD: torch.Tensor,
    used_V: torch.Tensor,
    t2d_Vt: torch.Tensor,
    *,
    chunk_rows: int = 2048,
) -> Teacher:
    """Teacher logits = target lm_head(final) computed on the fly, in row chunks so the full-vocab
    logits exist for at most `chunk_rows` positions at a time."""
    B, T, D = final_BTD.shape
    flat = final_BTD.reshape(B * T, D).to(head_weight_VtD.dtype)
    probs, tops, inv = [], [], []
    for a in range(0, B * T, chunk_rows):
        logits = flat[a : a + chunk_rows] @ head_weight_VtD.T  # [n, Vt]
        inv.append(t2d_Vt[logits.argmax(-1)])
        restricted = logits.index_select(1, used_V).float()
        tops.append(restricted.argmax(-1))
        probs.append(torch.softmax(restricted, dim=-1))
    return Teacher(torch.cat(probs).view(B, T, -1), torch.cat(tops).view(B, T), torch.cat(inv).view(B, T))


@dataclass
class PackedTeacher:
    final_ND: torch.Tensor
    """The target's final (post-norm) states of the packed row, in the compute dtype."""
    head_VD: torch.Tensor
    """The target's lm_head rows of the draft vocab: teacher logits = final @ head_VD.T."""
    top_N: torch.Tensor
    """Draft id of the target's argmax over the draft vocab."""
    in_vocab_N: torch.Tensor
    """True where the target's full-vocab argmax is in the draft vocab."""
    logits_NV: torch.Tensor | None = None
    """The draft-vocab teacher logits of every row, kept when they fit `cache_bytes` (small
    batches: no recomputation per TTT step); None = recomputed chunk by chunk."""
    lse_N: torch.Tensor | None = None
    """fp32 log-sum-exp of each row of `logits_NV`, made with it where the fused CE kernel (its one reader) runs, so
    that the kernel's first pass reads the student's logits only; else None."""


TEACHER_CACHE_BYTES = 1 << 30
"""Keep the draft-vocab teacher logits of a row when they take at most this much (1 GiB): memory
stays bounded by a constant and by tokens x hidden beyond it."""


def _teacher_lse(logits_nV: torch.Tensor) -> torch.Tensor:
    """[n] fp32 log-sum-exp of each row (the kept teacher's `lse_N`), summed in fp32 whatever the logits' dtype (in bf16 it would
    keep 3 significant digits). Compiled on CUDA (`_fast`): one pass over the logits."""
    return torch.logsumexp(logits_nV.float(), -1)


def _teacher_max_lse(logits_nV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, first index of the max, fp32 log-sum-exp) of each row: `packed_teacher`'s fallback for the row statistics
    kernel, compiled on CUDA (`_fast`) so that the three reductions read each chunk of the table once, not twice."""
    top_max, top = logits_nV.max(-1)
    return top_max, top, _teacher_lse(logits_nV)


def teacher_stats_for(device: torch.device, dtype: torch.dtype):
    """`packed_teacher`'s (max, first index of the max, fp32 log-sum-exp) of the rows of a kept chunk: the Triton
    kernel where it runs and passed its check on this device at this dtype (kernels: `teacher_stats`), else the
    torch reduction (compiled on CUDA)."""
    if kernels.use("teacher_stats", device, dtype):
        return CE.row_max_lse
    return _fast(_teacher_max_lse, device)


@torch.no_grad()
def check_row_max_lse(device: torch.device, dtype: torch.dtype, *, rows: int = 37, vocab: int = 32000) -> str | None:
    """None when `ce_kernel.row_max_lse` equals `_teacher_max_lse` (eager) on random rows on `device`; else why not.
    Logits ~ N(0, 3); rows strided (a wider table's columns); row 0 holds its maximum twice in different blocks
    (the first index wins), row 1 its maximum in the last, partial block, row 2 a maximum far above the rest (the
    sum-exp rescaled past the block that held it)."""
    why = CE.stats_unavailable(device)
    if why is not None:
        return why
    g = torch.Generator(device="cpu").manual_seed(0)
    wide = (3 * torch.randn(rows, vocab + 16, generator=g)).to(dtype)
    wide[0, 5], wide[0, vocab - 7] = 40.0, 40.0
    wide[1, vocab - 1] = 41.0
    wide[2, 1] = 90.0
    x = wide.to(device)[:, :vocab]
    try:
        got = CE.row_max_lse(x)
    except Exception as exc:  # noqa: BLE001  (a kernel that cannot compile or run here: the torch version)
        return f"the row statistics kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    ref = _teacher_max_lse(x)
    if not torch.equal(got[0], ref[0]):
        return "the row statistics kernel's maximum differs from torch's"
    if not torch.equal(got[1], ref[1]):
        return "the row statistics kernel's index of the maximum differs from torch's first index"
    err = float((got[2] - ref[2]).abs().max())
    if not err <= 1e-4:
        return f"the row statistics kernel's log-sum-exp differs from torch's by {err:.2e}"
    return None


def unused_head(head_weight_VtD: torch.Tensor, t2d_Vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's rows outside the draft vocab [U, D], their ascending target ids [U]) for `packed_teacher` (reads
    the draft-vocab mask once: call it at set-up, not per step)."""
    unused_U = (~t2d_Vt.bool()).nonzero().squeeze(1)
    return head_weight_VtD.index_select(0, unused_U), unused_U


@torch.no_grad()
def packed_teacher(
    final_ND: torch.Tensor,
    head_weight_VtD: torch.Tensor,
    head_used_VD: torch.Tensor,
    used_V: torch.Tensor,
    t2d_Vt: torch.Tensor,
    *,
    chunk_rows: int = 4096,
    cache_bytes: int = TEACHER_CACHE_BYTES,
    unused: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedTeacher:
    """Argmax flags over the full target vocab, in row chunks; the draft-vocab logits are kept only
    when they fit `cache_bytes` (else the fused loss recomputes them chunk by chunk), with their log-sum-exp where the
    fused CE kernel runs on this device. `unused`: `unused_head(...)` (made here when not given).

    The final states are multiplied by the draft vocab's rows and by the other rows apart, and the full-vocab argmax
    comes from the two maxima (ties to the smaller target id, as one argmax over the whole row takes its first): the
    same products as one [rows x target vocab] product, without writing and re-reading a copy of its draft columns.
    The flags can differ from one product's only where two logits tie to the last bit of one product and not of the
    other."""
    flat = final_ND.to(head_weight_VtD.dtype)
    N, V = flat.shape[0], used_V.shape[0]
    keep = N * V * flat.element_size() <= cache_bytes
    if unused is None:
        unused = unused_head(head_weight_VtD, t2d_Vt)
    # (only where the fused kernel, its one reader, can run: on the CPU no chunk CE would read it)
    lse_wanted = keep and kernels.setting("ce") != "off" and CE.kernel_unavailable(flat.device) is None
    max_lse_of = teacher_stats_for(flat.device, flat.dtype) if lse_wanted else None
    # the kept table is written in place, chunk by chunk (no [N, V] concatenation at the end: a copy of the whole
    # table, and twice its memory for a moment)
    table = flat.new_empty(N, V) if keep else None
    tops, inv, lses = [], [], []
    for a in range(0, N, chunk_rows):
        into = table[a : a + chunk_rows] if keep else None
        restricted = torch.matmul(flat[a : a + chunk_rows], head_used_VD.T, out=into)  # [n, V]
        if max_lse_of is not None:  # the maximum and the log-sum-exp in one read of the chunk
            top_max, top, lse = max_lse_of(restricted)
            lses.append(lse)
        else:
            top_max, top = restricted.max(-1)  # (the first index of the maximum, as argmax)
        inv.append(_draft_argmax_wins(flat[a : a + chunk_rows], top_max, used_V[top], *unused))
        tops.append(top)
    return PackedTeacher(flat, head_used_VD, torch.cat(tops), torch.cat(inv), table, torch.cat(lses) if lses else None)


def _draft_argmax_wins(flat_nD, used_max_n, used_id_n, head_unused_UD, unused_U) -> torch.Tensor:
    """[n] bool: the full-vocab argmax is a draft-vocab id, given the draft vocab's maximum and its target id: above
    the other rows' maximum, or equal to it at a smaller target id."""
    if unused_U.numel() == 0:
        return torch.ones_like(used_max_n, dtype=torch.bool)
    other_max, other = (flat_nD @ head_unused_UD.T).max(-1)
    return (used_max_n > other_max) | ((used_max_n == other_max) & (used_id_n < unused_U[other]))
