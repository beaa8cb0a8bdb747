"""The nn.Modules that `eyas train` wraps in DDP/FSDP2: the drafter plus its TTT loss (drafter/ttt/) as one forward,
on packed rows (the training path) or on padded rows (the reference path: tests, benchmarks)."""

from __future__ import annotations

import torch
from torch import nn


def teacher_cache_bytes(device: torch.device) -> int:
    """How many bytes of draft-vocab teacher logits a step may keep for its TTT steps to share.

    Kept logits save one [rows x V] matmul per TTT step (7 of them a step at TTT 7); beyond the cap
    they are recomputed chunk by chunk. The cap is a constant per device, so memory still grows with
    tokens x hidden, not tokens x vocab, past it: a tenth of the GPU's memory, at most 16 GiB (an H200
    keeps a whole 131,072-token batch at a 32,000-token draft vocab: 8.4 GB), and 1 GiB elsewhere."""
    from eyas.drafter.ttt.teacher import TEACHER_CACHE_BYTES

    if device.type != "cuda":
        return TEACHER_CACHE_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return max(TEACHER_CACHE_BYTES, min(16 << 30, total // 10))


HEAD_CHUNK_ROWS = 8192
"""Rows a chunk of the heads' work (the drafter's head with its soft cross-entropy, the teacher's logits) holds at a
time: its [rows x vocab] logits are the head's whole extra memory, whatever the batch; larger chunks cost memory
and gain nothing, since the step is bound by the GPU, not by the chunks' launches."""


class PackedTTTModule(nn.Module):
    """The drafter plus its packed TTT loss as one forward(), so DDP/FSDP2 hooks see every use.

    The target's lm_head (`head_VtD`, frozen, not a parameter) turns the stored final states into
    teacher logits inside the forward, chunk by chunk (drafter/ttt/unroll.py, the packed path; `chunk_rows`: HEAD_CHUNK_ROWS
    unless given)."""

    def __init__(self, drafter, ttt_cfg, *, head_VtD: torch.Tensor, chunk_rows: int | None = None):
        super().__init__()
        self.drafter = drafter
        self.ttt_cfg = ttt_cfg
        self.chunk_rows = chunk_rows or HEAD_CHUNK_ROWS
        self.teacher_cache_bytes = teacher_cache_bytes(head_VtD.device)
        self.set_teacher_head(head_VtD)

    def set_teacher_head(self, head_VtD: torch.Tensor) -> None:
        used = self.drafter.used_target_ids().to(head_VtD.device)
        t2d = self.drafter.t2d.to(head_VtD.device)
        self._head = (head_VtD, head_VtD.index_select(0, used), used, t2d)
        self._unused = None  # the rows outside the draft vocab, made on first use

    def teacher(self, final_ND):
        """The packed row's teacher (drafter/ttt/teacher.py packed_teacher) from its final states. (Made ahead of its
        step, on the side stream that brings the batch in, it did not pay.)"""
        from eyas.drafter.ttt.teacher import packed_teacher, unused_head

        head, head_used, used, t2d = self._head
        if self._unused is None:
            self._unused = unused_head(head, t2d)
        return packed_teacher(
            final_ND,
            head,
            head_used,
            used,
            t2d,
            chunk_rows=self.chunk_rows,
            cache_bytes=self.teacher_cache_bytes,
            unused=self._unused,
        )

    def forward(self, input_ids_N, seg, rows, aux_NAD, final_ND, denominators, live=None):
        from eyas.drafter.ttt.unroll import ttt_loss_packed

        teacher = self.teacher(final_ND)
        out = ttt_loss_packed(
            self.drafter,
            input_ids_N=input_ids_N,
            seg=seg,
            rows=rows,
            aux_NAD=aux_NAD,
            teacher=teacher,
            cfg=self.ttt_cfg,
            denominators=denominators,
            chunk_rows=self.chunk_rows,
            live=live,
        )
        stats = torch.cat([out.ce_sum, out.correct, out.valid, out.accepted.view(1), out.rounds.view(1)])
        return out.loss, stats


class TTTModule(nn.Module):
    """The reference path: padded rows and materialised teacher probabilities (tests, benchmarks)."""

    def __init__(self, drafter, ttt_cfg):
        super().__init__()
        self.drafter = drafter
        self.ttt_cfg = ttt_cfg

    def forward(self, input_ids_BT, loss_mask_BT, aux_BTAD, probs_BTV, top_BT, in_vocab_BT, denominators):
        from eyas.drafter.ttt.reference import ttt_loss
        from eyas.drafter.ttt.teacher import Teacher

        out = ttt_loss(
            self.drafter,
            input_ids_BT=input_ids_BT,
            loss_mask_BT=loss_mask_BT,
            aux_BTAD=aux_BTAD,
            teacher=Teacher(probs_BTV, top_BT, in_vocab_BT),
            cfg=self.ttt_cfg,
            denominators=denominators,
        )
        stats = torch.cat([out.ce_sum, out.correct, out.valid, out.accepted.view(1), out.rounds.view(1)])
        return out.loss, stats
