"""Training-time test (TTT): the EAGLE-3 loss, unrolled over several draft steps.

docs/ttt.md works the off-by-one example (tokens, teachers and loss mask shifted per step, the attention mask of
step k) and gives the shape legend of the names' suffixes (_BTD, _ND, ...). One concern a module:

    config      TTTConfig (the settings) and TTTOutput (the loss and its statistics)
    masks       which positions carry a loss at step k: step masks, denominators, supervised rows, live positions
    attention   step k's causal-plus-diagonals attention: the dense reference and the flash + merge fast path
    teacher     the target's distribution over the draft vocab: Teacher (padded), PackedTeacher (packed)
    head_loss   the draft head's chunked soft cross-entropy and its fused-kernel choice and checks
    reference   the padded reference path: ttt_unroll, ttt_loss
    unroll      the packed path training runs: PackedUnroll, ttt_loss_packed, compile_drafter
    compiled    the small fp32 helpers compiled once per device on CUDA
"""

from eyas.drafter.ttt.attention import KERNELS, check_fast_attention, fast_attention, pick_kernel, reference_attention
from eyas.drafter.ttt.config import CAST_ONCE_MIN_HIDDEN, TTTConfig, TTTOutput
from eyas.drafter.ttt.head_loss import (
    addmm_fp32_,
    check_addmm_fp32,
    check_fused_chunk_ce,
    chunk_ce_for,
    head_soft_ce,
    head_soft_ce_ranges,
    reference_head_soft_ce,
    soft_ce,
    teacher_groups,
    top_rank_below,
)
from eyas.drafter.ttt.masks import live_positions, step_denominators, step_mask, supervised_rows
from eyas.drafter.ttt.reference import ttt_loss, ttt_unroll
from eyas.drafter.ttt.teacher import (
    TEACHER_CACHE_BYTES,
    PackedTeacher,
    Teacher,
    check_row_max_lse,
    packed_teacher,
    teacher_from_final,
    teacher_stats_for,
    unused_head,
)
from eyas.drafter.ttt.unroll import PackedUnroll, compile_drafter, normed_rows, ttt_loss_packed

__all__ = [
    "CAST_ONCE_MIN_HIDDEN",
    "KERNELS",
    "TEACHER_CACHE_BYTES",
    "PackedTeacher",
    "PackedUnroll",
    "TTTConfig",
    "TTTOutput",
    "Teacher",
    "addmm_fp32_",
    "check_addmm_fp32",
    "check_fast_attention",
    "check_fused_chunk_ce",
    "check_row_max_lse",
    "chunk_ce_for",
    "compile_drafter",
    "fast_attention",
    "head_soft_ce",
    "head_soft_ce_ranges",
    "live_positions",
    "normed_rows",
    "packed_teacher",
    "pick_kernel",
    "reference_attention",
    "reference_head_soft_ce",
    "soft_ce",
    "step_denominators",
    "step_mask",
    "supervised_rows",
    "teacher_from_final",
    "teacher_groups",
    "teacher_stats_for",
    "top_rank_below",
    "ttt_loss",
    "ttt_loss_packed",
    "ttt_unroll",
    "unused_head",
]
