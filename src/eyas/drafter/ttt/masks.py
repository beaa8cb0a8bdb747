"""Which positions carry a loss at TTT step k: the shifted loss mask, its per-step counts (the denominators), and the
packed path's supervised rows and live positions (docs/ttt.md works an example)."""

from __future__ import annotations

import torch


def step_mask(loss_mask_BT: torch.Tensor, k: int) -> torch.Tensor:
    """m_{t+2+k} for t in [0, T-1-k): the loss mask of step k (before the vocab filter)."""
    B, T = loss_mask_BT.shape
    n = max(T - 1 - k, 0)
    shifted = loss_mask_BT[:, 2 + k :].bool()
    return torch.cat([shifted, shifted.new_zeros(B, n - shifted.shape[1])], dim=1)


def step_denominators(loss_mask_BT: torch.Tensor, steps: int) -> torch.Tensor:
    """[K] float: number of loss-mask positions per step (the normaliser, summed over a global batch)."""
    return torch.stack([step_mask(loss_mask_BT, k).sum() for k in range(steps)]).double()


def supervised_rows(loss_mask_N: torch.Tensor, ends_N: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """[K] int64 positions t that carry a loss at step k: m_{t+2+k} and t+2+k inside t's sample.

    Host tensors in, host tensors out (computed by the data loader, before the batch reaches the GPU).
    Their lengths are the step's loss-mask counts (the denominators of `ttt_loss`)."""
    N = loss_mask_N.shape[0]
    mask = loss_mask_N.bool()
    left = ends_N - torch.arange(N, dtype=ends_N.dtype)  # positions from t to its sample's end
    rows = []
    for k in range(steps):  # (shifted slices, not a gather of j = t + 2 + k: about half the host time)
        ok = torch.zeros(N, dtype=torch.bool)
        ok[: max(0, N - 2 - k)] = mask[2 + k :]
        ok &= left > 2 + k
        rows.append(ok.nonzero().squeeze(1))
    return rows


def live_positions(rows: list[torch.Tensor], N: int) -> torch.Tensor:
    """int64 sorted positions that carry a loss at some TTT step (the union of `supervised_rows`): the only ones
    whose hidden states the packed unroll computes past step 0's keys and values."""
    live = torch.zeros(N, dtype=torch.bool, device=rows[0].device if rows else "cpu")
    for r in rows:
        live[r] = True
    return live.nonzero().squeeze(1)
