"""The packed path that training runs: `ttt_loss_packed`, the same loss as the padded `ttt_loss` on one packed row,
over its supervised rows only, with the chunked head loss.

Samples are laid end to end in one row (eyas.packing.Segments): step-0 attention is causal within each sample,
positions restart per sample, and the step-k shift x_{t+1+k} never crosses a sample's end (those positions get token
0 and no loss). Only the positions that carry a loss at step k (`supervised_rows`) go through the head
(`head_loss.head_soft_ce_ranges`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.drafter.model import Eagle3Drafter, rms_norm
from eyas.drafter.ttt.attention import _step_keys, fast_attention, reference_attention
from eyas.drafter.ttt.config import TTTConfig, TTTOutput
from eyas.drafter.ttt.head_loss import head_soft_ce_ranges, soft_ce
from eyas.drafter.ttt.teacher import PackedTeacher
from eyas.packing import to_device


def compile_drafter(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """torch.compile the per-step pieces (norms + q/k/v + RoPE; o_proj + residual + MLP; final norm +
    lm_head; the soft cross-entropy; the head's normed rows): small graphs that compile
    in seconds and fuse the elementwise work around the matmuls. The attention and the step loop stay eager."""
    mid = drafter.midlayer
    mid.project_qkv = torch.compile(mid.project_qkv)
    mid.finish = torch.compile(mid.finish)
    drafter.compute_logits = torch.compile(drafter.compute_logits)
    drafter._soft_ce = torch.compile(soft_ce)
    drafter._normed_rows = torch.compile(normed_rows, dynamic=True)  # the rows' count changes every step
    return drafter


def normed_rows(
    hidden_ND: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`rms_norm` of rows `rows` of hidden_ND, cast to `dtype` when given."""
    out = rms_norm(hidden_ND.index_select(0, rows), weight, eps)
    return out if dtype is None else out.to(dtype)


class PackedUnroll:
    """`ttt_unroll` over one packed row, one TTT step per `step` call. Step k feeds x_{t+1+k} when t+1+k is inside
    t's sample (else token 0: such positions never carry a loss) at RoPE position (t - start of t's sample) + k;
    step-0 keys are causal within each sample.

    Past step 0's keys and values, a position's states reach nothing but the same position's later steps (its
    queries read the step-0 keys of earlier positions and its own diagonals). So each step may run on fewer
    positions than the last (`pos`, sorted, a subset of the previous step's): the positions that carry no loss at
    any step (`live_positions`) are computed at step 0 up to their keys and values and then dropped."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        input_ids_N: torch.Tensor,
        seg,
        aux_NAD: torch.Tensor,
        *,
        steps: int,
        attention: str = "fast",
        cast_once: bool = False,
    ):
        self.drafter, self.ids, self.seg = drafter, input_ids_N, seg
        N = input_ids_N.shape[0]
        dev = input_ids_N.device
        self.all = torch.arange(N, device=dev)
        # every step's input tokens at once, [steps, N]: x_{t+1+k} where t+1+k lies inside t's sample, else token 0
        j = self.all[None] + torch.arange(1, steps + 1, device=dev)[:, None]
        self.tokens_KN = torch.where(j < seg.ends_N[None], input_ids_N[j.clamp_max(N - 1)], 0)
        self.feature = drafter.project_aux(aux_NAD[None])
        self.pos = self.all  # positions of `feature`'s rows (and of the diagonal keys' rows)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.w = None  # the mid layer's weights cast once for all steps (cast_once)
        if cast_once and torch.is_autocast_enabled(dev.type):
            cdtype = torch.get_autocast_dtype(dev.type)
            if drafter.midlayer.self_attn.q_proj.weight.dtype != cdtype:
                self.w = drafter.midlayer.linear_weights(cdtype)
        self.attend = fast_attention if attention == "fast" else reference_attention

    def step(self, k: int, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Step k's hidden_prenorm [1, n, D] at positions `pos` (None: all N), which hold a subset of the last
        step's positions (step 0: computed at all N up to its keys and values, then kept at `pos`)."""
        d, seg = self.drafter, self.seg
        if pos is None:
            pos = self.all
        if k and pos is not self.pos:  # fewer positions than the last step: its states and diagonals narrowed
            sub = torch.searchsorted(self.pos, pos)
            self.feature = self.feature.index_select(1, sub)
            self.keys[1:] = [x.index_select(2, sub) for x in self.keys[1:]]
            self.values[1:] = [x.index_select(2, sub) for x in self.values[1:]]
        t = self.all if k == 0 else pos
        full = t is self.all
        positions = seg.positions_N if full else seg.positions_N.index_select(0, t)
        tokens = self.tokens_KN[k] if full else self.tokens_KN[k].index_select(0, t)
        emb = d.embed_tokens(tokens[None])
        dev = self.ids.device
        cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else emb.dtype
        cos, sin = d.rope_at(positions, k, cdtype, seg.max_len + k)  # (positions restart per sample: < max_len)
        q, kk, vv = d.midlayer.project_qkv(emb, self.feature, cos, sin, self.w)
        if k == 0:  # laid out [1, N, K, d] as the varlen kernels read them, once: v is a strided slice of the
            # q/k/v product, which every step's attention (forward and backward) would copy again otherwise
            vv = vv.transpose(1, 2).contiguous().transpose(1, 2)
        self.keys.append(_step_keys(kk, d.config.num_attention_heads, packed_step0=k == 0))
        self.values.append(_step_keys(vv, d.config.num_attention_heads, packed_step0=k == 0))
        att = self.attend(q, self.keys, self.values, seg=seg, rows=None if full else t)
        feature = self.feature
        if k == 0 and pos is not self.all:  # step 0's keys and values are made for all N; the rest for `pos`
            att, feature = att.index_select(2, pos), feature.index_select(1, pos)
        hidden = d.midlayer.finish(att, feature, self.w)
        self.feature, self.pos = hidden, pos
        return hidden


def ttt_loss_packed(
    drafter: Eagle3Drafter,
    *,
    input_ids_N: torch.Tensor,
    seg,
    rows: list[torch.Tensor],
    aux_NAD: torch.Tensor,
    teacher: PackedTeacher,
    cfg: TTTConfig,
    denominators: torch.Tensor,
    chunk_rows: int = 4096,
    live: torch.Tensor | None = None,
) -> TTTOutput:
    """`ttt_loss` on a packed row: same loss, same statistics, same normalisation (`denominators`:
    the global batch's loss-mask counts per step = the summed lengths of `rows`). `live`: `live_positions(rows)`
    (made by the data loader on the host: its length sets shapes): the only positions computed past step 0's keys
    and values (the same loss and gradients)."""
    K, dev = cfg.steps, input_ids_N.device
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    # 1. unroll the K draft steps over the row, keeping each step's supervised rows, normed for the head
    x, last_hidden = _unroll_supervised(drafter, input_ids_N, seg, aux_NAD, rows, cfg, live)
    lengths = [int(r.numel()) for r in rows]
    if not sum(lengths):
        # no supervised position (a rank's loss-free filler at an epoch's end): a zero that still
        # reaches every trainable weight, so backward runs and DDP/FSDP2 reduce as on the other ranks
        return _no_rows_output(loss + _zero_through_head(drafter, last_hidden), K, dev)
    # 2. each row's step k, teacher row t+1+k, the target's top token and its weight w_k / denominator_k
    sup = _Supervised.of(rows, lengths, teacher, cfg, denominators, dev)
    # 3. the head's soft cross-entropy of every step's rows in one chunked call
    total, per_step, hits = _head_loss(drafter, x, sup, teacher, cfg, input_ids_N.shape[0], chunk_rows)
    loss = loss + total
    # 4. with `feature_loss`: the regression of the head's input onto the teacher row's final state
    if cfg.feature_loss:
        loss = loss + cfg.feature_loss * _feature_term(x, teacher.final_ND, sup.tr, sup.scale_n)
    # 5. the statistics: per-step CE sums, top-1 hits, valid rows and the simulated chain's accepted length
    return _with_statistics(loss, sup, per_step, hits, K, input_ids_N.shape[0])


def _unroll_supervised(
    drafter: Eagle3Drafter,
    input_ids_N: torch.Tensor,
    seg,
    aux_NAD: torch.Tensor,
    rows: list[torch.Tensor],
    cfg: TTTConfig,
    live: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [n, D]: the supervised rows `rows` of every step's hidden state, in step order, normed and cast to the
    head's compute dtype; the last step's hidden state [1, n', D]).

    The head's loss never feeds a later step: all steps' supervised rows go through ONE head call after the unroll
    (one weight-gradient buffer for the head instead of one per step). Each step's rows are gathered, normed and
    cast by one `normed_rows` (compiled with the drafter), then concatenated once: written slice by slice into one
    buffer instead, autograd would clone the buffer's whole gradient once per step."""
    dev = input_ids_N.device
    N = input_ids_N.shape[0]
    cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else drafter.lm_head.weight.dtype
    norm_rows = getattr(drafter, "_normed_rows", normed_rows)
    if not (live is not None and 0 < live.shape[0] < N):
        live = None  # (no supervised row: the filler needs a hidden row)
    unroll = PackedUnroll(
        drafter,
        input_ids_N,
        seg,
        aux_NAD,
        steps=cfg.steps,
        attention=cfg.attention,
        cast_once=cfg.cast_once_for(drafter.config.hidden_size),
    )
    parts: list[torch.Tensor] = []
    for k in range(cfg.steps):
        hidden = unroll.step(k, live)
        r = rows[k]
        if r.numel():
            at = r if live is None else torch.searchsorted(live, r)  # rows of the step's states
            parts.append(norm_rows(hidden[0], at, drafter.norm.weight, drafter.norm.eps, cdtype))
    x = torch.cat(parts) if parts else torch.empty(0, drafter.config.hidden_size, dtype=cdtype, device=dev)
    return x, hidden


def _zero_through_head(drafter: Eagle3Drafter, hidden_1nD: torch.Tensor) -> torch.Tensor:
    """0 times the head's logits of one row of the last step: a zero loss whose graph reaches every trainable weight."""
    last = F.linear(drafter.norm(hidden_1nD[0, :1]), drafter.lm_head.weight)
    return 0.0 * last.float().sum()


def _no_rows_output(loss: torch.Tensor, K: int, device) -> TTTOutput:
    """The output of a row without a supervised position: its loss and zero statistics."""
    f64 = dict(dtype=torch.float64, device=device)
    valids = torch.zeros(K, **f64)
    return TTTOutput(
        loss=loss,
        ce_sum=torch.zeros(K, **f64),
        correct=torch.zeros(K, **f64),
        valid=valids,
        accepted=torch.zeros((), **f64),
        rounds=valids[0],
    )


@dataclass
class _Supervised:
    """Every step's supervised rows concatenated in step order, with what the head loss and the statistics read of
    each. Made for all steps at once (each row's step from the host's lengths): a few kernels a step instead of a
    few per TTT step (the 8B-shaped step is bound by its host)."""

    lengths: list[int]
    """Rows per step."""
    k_of_row: torch.Tensor
    """[n] each row's step k."""
    r_cat: torch.Tensor
    """[n] each row's position t."""
    tr: torch.Tensor
    """[n] its teacher row t+1+k (p_{t+1+k})."""
    valid: torch.Tensor
    """[n] bool: the target's top token is in the draft vocabulary."""
    top: torch.Tensor
    """[n] the draft id of the target's top token."""
    scale: torch.Tensor
    """[K] w_k / denominator_k."""
    scale_n: torch.Tensor
    """[n] each row's w_k / denominator_k."""
    w: torch.Tensor
    """[n] each row's weight in the head loss: scale_n, 0 where the target's top token is outside the draft vocab."""

    @classmethod
    def of(
        cls,
        rows: list[torch.Tensor],
        lengths: list[int],
        teacher: PackedTeacher,
        cfg: TTTConfig,
        denominators: torch.Tensor,
        device,
    ) -> _Supervised:
        k_of_row = _step_of_rows(lengths, device)
        r_cat = torch.cat(rows)
        tr = r_cat + 1 + k_of_row  # teacher row of step k's row t: p_{t+1+k}
        valid = teacher.in_vocab_N[tr]  # the target's top token in the draft vocabulary
        denominators = denominators.to(device).clamp_min(1)
        scale = to_device(torch.tensor(cfg.weights, dtype=torch.float32), device) / denominators.float()
        scale_n = scale.index_select(0, k_of_row)  # each row's w_k / denominator_k
        w = valid.float() * scale_n  # (0 where the target's top token is outside the draft vocab)
        return cls(lengths, k_of_row, r_cat, tr, valid, teacher.top_N[tr], scale, scale_n, w)


def _head_loss(
    drafter: Eagle3Drafter,
    x: torch.Tensor,
    sup: _Supervised,
    teacher: PackedTeacher,
    cfg: TTTConfig,
    N: int,
    chunk_rows: int,
):
    """(total, per-step weighted sums, top-1 hits [n]) of the head over `x` against the teacher: its kept logits
    table where there is one, else recomputed from its final states. One range per step (empty ones too)."""
    align = (sup.r_cat, N, cfg.align_topk) if cfg.align_topk else None
    if teacher.logits_NV is not None:
        return head_soft_ce_ranges(
            x,
            drafter.lm_head.weight,
            None,
            None,
            sup.w,
            sup.top,
            sup.lengths,
            chunk_rows=chunk_rows,
            teacher_logits=teacher.logits_NV,
            teacher_rows=sup.tr,
            align=align,
            teacher_lse=teacher.lse_N,
        )
    return head_soft_ce_ranges(
        x,
        drafter.lm_head.weight,
        teacher.final_ND,
        teacher.head_VD,
        sup.w,
        sup.top,
        sup.lengths,
        chunk_rows=chunk_rows,
        teacher_rows=sup.tr,
        align=align,
    )


@torch.no_grad()
def _with_statistics(
    loss: torch.Tensor, sup: _Supervised, per_step: torch.Tensor, hits: torch.Tensor, K: int, N: int
) -> TTTOutput:
    """`loss` with the step's statistics. The valid rows (the statistics' denominators) are every supervised row whose
    target top token is in the draft vocab; a position's step k is accepted while its steps 0..k all hit."""
    f64 = dict(dtype=torch.float64, device=loss.device)
    hit = hits & sup.valid
    ce_sum = (per_step / sup.scale).double()  # each step's unweighted soft-CE sum (0 for an empty step)
    correct = torch.zeros(K, **f64).index_add_(0, sup.k_of_row, hit.double())
    hit_KN = torch.zeros(K, N, dtype=torch.float32, device=loss.device).index_put_(
        (sup.k_of_row, sup.r_cat), hit.float()
    )
    accepted = hit_KN.cumprod(0).sum().double()
    valids = torch.zeros(K, **f64).index_add_(0, sup.k_of_row, sup.valid.double())
    return TTTOutput(loss=loss, ce_sum=ce_sum, correct=correct, valid=valids, accepted=accepted, rounds=valids[0])


def _feature_term(x_nD: torch.Tensor, final_ND: torch.Tensor, rows_n: torch.Tensor, w_n: torch.Tensor) -> torch.Tensor:
    """sum_n w_n * mean_D smooth_l1(x_n, final[rows_n]) (TTTConfig.feature_loss), in fp32."""
    reg = F.smooth_l1_loss(x_nD.float(), final_ND.index_select(0, rows_n).float(), reduction="none").mean(-1)
    return (reg * w_n).sum()


def _step_of_rows(lengths: list[int], device) -> torch.Tensor:
    """[sum(lengths)] the step k of each row of the steps' rows concatenated (k repeated lengths[k] times), made on
    the host."""
    return to_device(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), device)
