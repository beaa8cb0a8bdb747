"""The LK loss as a lab variant: eyas trains its drafter on the acceptance rate instead of the soft cross-entropy.

LK losses (Samarin et al., arXiv 2602.23881): a draft token is accepted with probability
alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), p the target's distribution, q = softmax(student logits s). The
hyperparameter-free loss per supervised row is L = -log(max(alpha, EPS)); with `kl_weight` W > 0 it is the fixed mix
W * softCE(p, q) + (1 - W) * L.

Gradient, per row, in closed form (the chunk never builds an autograd graph over [rows x vocab]):
with m_v = [q_v < p_v], d alpha / d s_j = q_j * (m_j - sum_v m_v q_v), so dL/ds_j = -(1 / alpha) * d alpha / d s_j.
- Ties q_v == p_v count as the teacher's side (m_v = 0: there min(p_v, q_v) is taken as p_v, flat in s); autograd
  of `torch.minimum` splits a tie in halves instead. Ties have measure zero on real logits.
- Below EPS the loss is the clamped value but the gradient keeps its direction, scaled by 1 / EPS (autograd of
  the clamp would give zero and stop learning on exactly the rows furthest off).
- At a point-mass teacher p = e_y, alpha = q_y and the gradient is q - e_y: the cross-entropy's.

The patch (every place eyas trains or reports the head loss computes LK):
- `head_loss.chunk_ce_for` returns the LK chunk behind `_gathering` (compiled with `_fast` on CUDA): the packed
  training path and the held-out evaluation in `eyas train` take the torch path on every device, so the fused
  Triton CE kernel is never called; the reachability test (`align_topk`) then runs on its own, as on CPU.
- `soft_ce` in `head_loss`, `reference` and `unroll` (the padded reference `ttt_loss`, `compile_drafter`'s
  compiled copy, `reference_head_soft_ce`): the plain per-row formula, differentiated by autograd; the product's
  tests comparing the packed path with the reference then compare the closed form with autograd.
- What is logged as the loss (`loss`, `loss_per_step`, the held-out `loss`, TTTOutput.ce_sum) is then the LK value
  (the mix under `--kl-weight`), not a cross-entropy; accuracies and the simulated tau are unchanged in meaning.
- Drafters written under the patch carry `lab_loss` in their config.json (a loss does not change what a drafter
  computes, so the product and other variants read them as they are); `eyas pipeline`'s train stage fingerprint
  includes the variant, so a workdir never skips or resumes a training of the other kind.

Run: `python lab/variants/lk.py [--kl-weight W] EYAS ARGS...`, e.g.
`python lab/variants/lk.py pipeline recipes/smollm2-gpu.toml --set train.seed=2` (eyas's CLI in-process, patched);
with other variants: `python lab/variants/run.py --variant eagle31 --variant lk -- pipeline ...`.
From Python: `with patched(Variant()): ...` (undone on exit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NAME = "lk"
EPS = 1e-6
"""alpha's floor before the log: below the acceptance of a uniform guess over any realistic draft vocabulary."""
USAGE = "usage: python lab/variants/lk.py [--kl-weight W] EYAS ARGS..."


@dataclass(frozen=True)
class Variant:
    """Which loss a run trains on (the default: pure -log alpha)."""

    kl_weight: float = 0.0
    """W in W * softCE + (1 - W) * (-log alpha), in [0, 1)."""

    def __post_init__(self):
        if not 0.0 <= self.kl_weight < 1.0:
            raise ValueError(f"kl_weight {self.kl_weight!r}: expected 0 <= W < 1 (W = 1 is eyas's own loss)")

    def marker(self) -> dict[str, Any]:
        """What the eyas layout's config.json records (`lab_loss`)."""
        return {"name": NAME, "kl_weight": self.kl_weight}

    def describe(self) -> str:
        return f"{NAME} (kl_weight={self.kl_weight:g})"


def lk_chunk(s, t, w, top, *, kl_weight: float = 0.0):
    """`_chunk_ce`'s contract with the LK loss: (sum_n w_n L_n, top-1 hits [c], w_n * dL_n/ds [c, V] in s's dtype)
    from student logits s and teacher logits t ([c, V], any float dtype), computed in fp32."""
    s32, t32 = s.float(), t.float()
    q = torch.softmax(s32, -1)
    p = torch.softmax(t32, -1)
    m = (q < p).float()  # ties go to the teacher (module docstring)
    a = torch.minimum(p, q).sum(-1).clamp_min(EPS)  # alpha [c]
    loss = -torch.log(a)
    g = ((m * q).sum(-1, keepdim=True) - m) * q / a[:, None]
    if kl_weight:
        ce = torch.logsumexp(s32, -1) - (p * s32).sum(-1)
        loss = kl_weight * ce + (1 - kl_weight) * loss
        g = kl_weight * (q - p) + (1 - kl_weight) * g
    return (loss * w).sum(), s32.argmax(-1) == top, (g * w[:, None]).to(s.dtype)


def lk_rows(logits_BnV: torch.Tensor, probs_BnV: torch.Tensor) -> torch.Tensor:
    """-log(max(alpha, EPS)) per position (fp32), written plainly for autograd: the reference paths' loss."""
    q = torch.softmax(logits_BnV.float(), -1)
    return -torch.log(torch.minimum(probs_BnV, q).sum(-1).clamp_min(EPS))


def chunk_for(variant: Variant):
    """The variant's chunk as f(s, t, w, top), named per weight (`_fast` compiles one graph per name)."""

    def chunk(s, t, w, top):
        return lk_chunk(s, t, w, top, kl_weight=variant.kl_weight)

    chunk.__name__ = chunk.__qualname__ = f"lk_chunk_w{variant.kl_weight!r}"
    return chunk


def rows_for(variant: Variant, soft_ce):
    """The variant's per-position loss over (logits, probs) for the reference paths; `soft_ce`: eyas's own."""
    if not variant.kl_weight:
        return lk_rows
    W = variant.kl_weight

    def rows(logits_BnV, probs_BnV):
        return W * soft_ce(logits_BnV, probs_BnV) + (1 - W) * lk_rows(logits_BnV, probs_BnV)

    return rows


_ACTIVE: Variant | None = None


def active() -> Variant | None:
    """The variant eyas is patched with now (None: eyas's own loss)."""
    return _ACTIVE


@contextlib.contextmanager
def patched(variant: Variant | None = None) -> Iterator[Variant]:
    """eyas trains on `variant`'s loss (default: -log alpha) inside the block; everything is put back on exit.
    Composes with other variants' patches: each piece wraps what is there when the block starts."""
    global _ACTIVE
    variant = variant or Variant()
    if _ACTIVE is not None:
        raise RuntimeError(f"eyas is already patched with {_ACTIVE.describe()}")
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, value in _patches(variant):
            saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, value)
        _ACTIVE = variant
        yield variant
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
        _ACTIVE = None


def _patches(v: Variant):
    """(owner, attribute, replacement) for every piece of eyas the variant changes."""
    import eyas.pipeline as pipeline
    from eyas.drafter import writer
    from eyas.drafter.ttt import head_loss, reference, unroll
    from eyas.drafter.ttt.compiled import _fast

    chunk = chunk_for(v)
    rows = rows_for(v, head_loss.soft_ce)
    write_eyas_was, fingerprint = writer.write_eyas, pipeline.fingerprint
    mine = v.marker()

    def chunk_ce_for(device, s_dtype, t_dtype):
        return head_loss._gathering(_fast(chunk, device))

    def write_eyas(out_dir, config, weights, *, target=None, extra=None):
        return write_eyas_was(out_dir, config, weights, target=target, extra={**(extra or {}), "lab_loss": mine})

    def stage_fingerprint(stage, cfg, input_fp, *, auto=frozenset()):
        if stage == "train":  # eval and export take the train stage's fingerprint as their input's
            input_fp = hashlib.sha256(json.dumps([input_fp, {"lab_loss": mine}], sort_keys=True).encode()).hexdigest()
        return fingerprint(stage, cfg, input_fp, auto=auto)

    return [
        (head_loss, "chunk_ce_for", chunk_ce_for),
        (head_loss, "soft_ce", rows),
        (reference, "soft_ce", rows),
        (unroll, "soft_ce", rows),
        (writer, "write_eyas", write_eyas),
        (pipeline, "fingerprint", stage_fingerprint),
    ]


def parse_args(argv: list[str]) -> tuple[Variant, list[str]]:
    """The variant's own leading options, then the eyas command line."""
    variant, args = Variant(), list(argv)
    while args and args[0].startswith("--kl-weight"):
        opt = args.pop(0)
        value = opt.partition("=")[2] if "=" in opt else (args.pop(0) if args else "")
        try:
            variant = Variant(kl_weight=float(value))
        except ValueError as exc:
            raise SystemExit(f"--kl-weight {value!r}: expected a number with 0 <= W < 1") from exc
    if not args:
        raise SystemExit(USAGE)
    return variant, args


def main(argv: list[str] | None = None) -> None:
    """Patch eyas with the variant, then run eyas's command line in this process."""
    from lab.variants import run_eyas

    variant, args = parse_args(sys.argv[1:] if argv is None else argv)
    run_eyas(args, patched(variant), f"lab variant {variant.describe()}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "src"), str(root)]  # the eyas and the lab of this checkout
    main()
