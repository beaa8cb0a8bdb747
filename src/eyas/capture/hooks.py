"""One forward of the target that writes the captured rows straight into their stored layout.

`forward_capture_packed` is the capture fast path. Like `eyas.target.forward_capture` it runs the
base model only (no lm_head) through `eyas.target.run_hooked` (pre-hooks on the aux layers, a hook
on the final norm), but each hook immediately gathers the real (non-padding) rows of its layer into slot a
of one preallocated `hidden_NLD` buffer, already cast (bf16, fp32) or quantised (fp8, scale per row)
to the stored dtype. So no [B, T, A, D] stack is ever built, padding rows are dropped on the device,
each layer's activation can be freed as soon as the next layer runs, and the buffer is exactly the
bytes that go to disk: one contiguous device-to-host copy per batch.

`eyas.target.forward_capture` is the simple reference; tests check both agree row for row.

Shape legend: B batch, T padded length, N real rows (sum of lengths), L = A + 1 slots, D hidden.
"""

from __future__ import annotations

import torch

from eyas.store.format import quantize_fp8, stored_dtype
from eyas.target import run_hooked


@torch.no_grad()
def forward_capture_packed(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor | None,
    rows_index: torch.Tensor | None,
    *,
    layer_ids: list[int],
    dtype: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (hidden_NLD in the stored dtype, scale_NL float32 for fp8 else None), on the model's device.

    rows_index: flat indices (b*T + t) of the real rows in batch order, or None for all rows.
    attention_mask_BT: None for right-padded batches (see batching.py: causal attention needs none).
    Slot a < A is the input to decoder layer layer_ids[a]; slot A is the final norm's output.
    """
    sd = stored_dtype(dtype)
    b, t = input_ids_BT.shape
    n = b * t if rows_index is None else rows_index.numel()
    slots = len(layer_ids) + 1
    device = input_ids_BT.device
    out: dict[str, torch.Tensor] = {}

    def put(slot: int, hs_BTD: torch.Tensor) -> None:
        rows_ND = hs_BTD.reshape(b * t, hs_BTD.shape[-1])
        if rows_index is not None:
            rows_ND = rows_ND.index_select(0, rows_index)
        if "hidden" not in out:
            out["hidden"] = torch.empty((n, slots, rows_ND.shape[-1]), dtype=sd.torch_dtype, device=device)
            if sd.scaled:
                out["scale"] = torch.empty((n, slots), dtype=torch.float32, device=device)
        if sd.scaled:
            q, scale = quantize_fp8(rows_ND)
            out["hidden"][:, slot] = q
            out["scale"][:, slot] = scale
        else:
            out["hidden"][:, slot] = rows_ND

    run_hooked(model, input_ids_BT, attention_mask_BT, layer_ids=layer_ids, put=put)
    return out["hidden"], out.get("scale")
