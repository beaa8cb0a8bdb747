"""The padded reference path: `ttt_unroll` and `ttt_loss` over right-padded [B, T] rows with the teacher's
probabilities materialised (simple and slow; the packed path in `unroll` must match it).

Step k at position t feeds token x_{t+1+k} at RoPE position t + k with the feature f_t = fc(aux_t) (k = 0) or the
previous step's hidden state, and learns p_{t+1+k} where m_{t+2+k} (docs/ttt.md works an example)."""

from __future__ import annotations

import torch

from eyas.drafter.model import Eagle3Drafter
from eyas.drafter.ttt.attention import _step_keys, fast_attention, reference_attention
from eyas.drafter.ttt.config import TTTConfig, TTTOutput
from eyas.drafter.ttt.head_loss import soft_ce
from eyas.drafter.ttt.masks import step_denominators, step_mask
from eyas.drafter.ttt.teacher import Teacher


def ttt_unroll(
    drafter: Eagle3Drafter, input_ids_BT: torch.Tensor, aux_BTAD: torch.Tensor, *, steps: int, attention: str = "fast"
):
    """Yield (k, hidden_prenorm_BTD) for k = 0..steps-1 (positions t >= T-1-k carry no meaning).

    Step k feeds token x_{t+1+k} at RoPE position t+k with feature fc(aux_t) (k = 0) or the
    previous step's hidden state; attention: causal step-0 keys + the diagonal keys of steps 1..k.
    """
    B, T = input_ids_BT.shape
    dev = input_ids_BT.device
    attn_fn = fast_attention if attention == "fast" else reference_attention
    feature = drafter.project_aux(aux_BTAD)
    positions = torch.arange(T, device=dev)[None].expand(B, T)
    keys, values = [], []
    for k in range(steps):
        tokens = torch.cat([input_ids_BT[:, 1 + k :], input_ids_BT.new_zeros(B, min(1 + k, T))], dim=1)[:, :T]
        emb = drafter.embed_tokens(tokens)
        cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else emb.dtype
        cos, sin = drafter.rope(positions + k, cdtype)
        q, kk, vv = drafter.midlayer.project_qkv(emb, feature, cos, sin)
        keys.append(_step_keys(kk, drafter.config.num_attention_heads))
        values.append(_step_keys(vv, drafter.config.num_attention_heads))
        hidden = drafter.midlayer.finish(attn_fn(q, keys, values), feature)
        yield k, hidden
        feature = hidden


def ttt_loss(
    drafter: Eagle3Drafter,
    *,
    input_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    aux_BTAD: torch.Tensor,
    teacher: Teacher,
    cfg: TTTConfig,
    denominators: torch.Tensor | None = None,
) -> TTTOutput:
    """Unroll K draft steps over one batch and return the weighted loss and per-step statistics.

    `denominators` [K]: the loss-mask counts of the GLOBAL batch (all micro-batches and ranks);
    default this batch's own (`step_denominators`). The padded reference has no `align_topk` nor `feature_loss`.
    """
    if cfg.align_topk or cfg.feature_loss:
        raise ValueError("TTTConfig.align_topk and feature_loss: the packed path (ttt_loss_packed) only")
    T = input_ids_BT.shape[1]
    K = cfg.steps
    dev = input_ids_BT.device
    if denominators is None:
        denominators = step_denominators(loss_mask_BT, K)
    denominators = denominators.to(dev).clamp_min(1)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    ce_sums, corrects, valids = [zero] * K, [zero] * K, [zero] * K
    chain_alive = None  # [B, n] step-0 positions whose simulated chain is still fully accepted
    accepted, rounds = zero, zero
    for k, hidden in ttt_unroll(drafter, input_ids_BT, aux_BTAD, steps=K, attention=cfg.attention):
        n = T - 1 - k  # positions with a teacher at this step
        if n <= 0:
            break
        logits = drafter.compute_logits(hidden[:, :n]).float()  # [B, n, V]
        valid = step_mask(loss_mask_BT, k) & teacher.in_vocab_BT[:, 1 + k :]
        ce = getattr(drafter, "_soft_ce", soft_ce)(logits, teacher.probs_BTV[:, 1 + k :])  # [B, n]
        ce_sum = (ce * valid).sum()
        loss = loss + cfg.weights[k] * ce_sum / denominators[k].float()
        with torch.no_grad():
            hit = (logits.argmax(-1) == teacher.top_BT[:, 1 + k :]) & valid
            ce_sums[k], corrects[k], valids[k] = ce_sum.detach().double(), hit.sum().double(), valid.sum().double()
            if k == 0:
                chain_alive, rounds = hit, valid.sum().double()
            else:
                chain_alive = chain_alive[:, :n] & hit
            accepted = accepted + chain_alive.sum().double()
    return TTTOutput(
        loss=loss,
        ce_sum=torch.stack(ce_sums),
        correct=torch.stack(corrects),
        valid=torch.stack(valids),
        accepted=accepted,
        rounds=rounds,
    )
