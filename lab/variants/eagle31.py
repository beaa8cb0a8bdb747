"""EAGLE-3.1 as a lab variant: eyas patched for one run (train, eval, export) to compute what SGLang serves.

What SGLang 0.5.17 serves (sglang/srt/models/llama_eagle3.py, read from the staged wheel):

- `LlamaModel.__init__` reads three draft-config keys. `fc_norm` (top level; the legacy `use_aux_norm` also turns
  it on): an `nn.ModuleList` of one RMSNorm(target_hidden_size) per aux state, weights `fc_norm.{i}.weight`
  (legacy names `aux_norm_low|mid|high` are renamed to `fc_norm.0|1|2` by `LlamaForCausalLMEagle3.load_weights`).
  `norm_before_fc` (`eagle_config.norm_before_fc`, else top level): ONE RMSNorm(A x target_hidden_size) over the
  concatenated aux states, weight `input_norm.weight`. `norm_output` (top level): see below.
- `LlamaModel.forward`: when the incoming hidden state is wider than the embedding (the target's concatenated aux
  states, first draft step), `input_norm` over the whole concatenation, then `fc_norm[i]` over chunk i, then `fc`.
  Later steps get the draft's own previous output, which skips all three.
- The layer ends in `self.norm(hidden, residual)` (add, then norm): the normed state goes to lm_head, and the state
  handed to the next draft step (the captured aux) is the normed one under `norm_output`, the pre-norm sum otherwise.
  The next step takes that state as its residual and through `hidden_norm` as usual.
- `load_weights` looks a checkpoint name up as given, then under `model.`; a name matching no parameter is
  dropped without a word, and a norm the config asks for but the file lacks stays at ones.

Which engines serve it (read from their sources and pull requests, not run here; the release tags are inferred
from dates): SGLang reads `fc_norm` and `norm_output` from about 0.5.12 (sgl-project/sglang#24663); an older SGLang
drops the norms' weights without a word and drafts as EAGLE-3 (acceptance falls, the output stays right). vLLM
reads both at the top level from 0.22.0 (vllm-project/vllm#42764); an older vLLM refuses the unknown `fc_norm.*`
weights at load and ignores `norm_output`. speculators names them the same (0.7.0). So a product option, if this
wins, must name the minimum engine in the export and refuse an older one: only vLLM fails loudly by itself.

EAGLE-3.1 (the paper, vLLM, speculators, SpecForge, TorchSpec) is `fc_norm` (per aux state) + `norm_output`; the
single norm over the concatenation (`norm_before_fc`) is the older speculators option (`--fc-norm concat` here).

The patch. Weight names are SGLang's, so exports copy them as they are, and all eyas paths change the same way:
- `Eagle3Drafter` gets `fc_norm` (or `input_norm`) modules, applied in `project_aux` before `fc`; under
  `norm_output` `MidLayer.finish` returns the final norm's output (that state feeds the next TTT / draft step) and
  `compute_logits` and the packed loss's `normed_rows` take it as already normed.
- `FunctionalDrafter` (eval, generate): the same in `fuse`, `finish` and `logits`.
- Layouts: drafters written by the patched eyas carry `lab_variant` in their config.json and the norms' weights;
  the SGLang and speculators configs get `fc_norm`, `norm_before_fc` and `norm_output` at the top level. Reading
  a drafter under the patch refuses one made without it (or with another variant), and the unpatched eyas refuses
  the variant's weights as unknown keys: neither evaluates the other's drafter as its own.
- `eyas pipeline`: the train stage's fingerprint includes the variant, so a workdir never skips or resumes a
  training of the other kind.

Run: `python lab/variants/eagle31.py [--fc-norm per-aux|concat|none] [--no-norm-output] EYAS ARGS...`, e.g.
`python lab/variants/eagle31.py pipeline recipes/smollm2-gpu.toml --set train.seed=2` (eyas's CLI in-process,
patched). From Python: `with patched(Variant()): ...` (undone on exit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NAME = "eagle31"
FC_NORMS = ("per-aux", "concat")
USAGE = "usage: python lab/variants/eagle31.py [--fc-norm per-aux|concat|none] [--no-norm-output] EYAS ARGS..."
_NORM_KEY = re.compile(r"^(?:model\.)?(fc_norm\.\d+\.weight|input_norm\.weight)$")


@dataclass(frozen=True)
class Variant:
    """Which of the EAGLE-3.1 changes a run makes (the default: both, as the paper and the engines define it)."""

    fc_norm: str | None = "per-aux"
    """'per-aux': SGLang's `fc_norm`, one RMSNorm per aux state; 'concat': `norm_before_fc`, one RMSNorm over their
    concatenation; None: no norm before fc."""
    norm_output: bool = True
    """The final norm's output feeds the next draft step (SGLang's `norm_output`)."""

    def __post_init__(self):
        if self.fc_norm not in (None, *FC_NORMS):
            raise ValueError(f"fc_norm {self.fc_norm!r}: expected one of {', '.join(FC_NORMS)} or None")
        if self.fc_norm is None and not self.norm_output:
            raise ValueError("a variant with neither fc_norm nor norm_output is EAGLE-3 itself: run eyas unpatched")

    def marker(self) -> dict[str, Any]:
        """What the eyas layout's config.json records (`lab_variant`)."""
        return {"name": NAME, "fc_norm": self.fc_norm, "norm_output": self.norm_output}

    def engine_fields(self) -> dict[str, bool]:
        """The top-level keys of the SGLang and speculators configs that SGLang's (and vLLM's) loader reads."""
        return {
            "fc_norm": self.fc_norm == "per-aux",
            "norm_before_fc": self.fc_norm == "concat",
            "norm_output": self.norm_output,
        }

    def weight_shapes(self, config) -> dict[str, tuple[int, ...]]:
        """The norms' weights this variant adds (SGLang names) and their shapes, for a DrafterConfig."""
        A, Dt = len(config.aux_layer_ids), config.target_hidden_size
        if self.fc_norm == "per-aux":
            return {f"fc_norm.{i}.weight": (Dt,) for i in range(A)}
        if self.fc_norm == "concat":
            return {"input_norm.weight": (A * Dt,)}
        return {}

    def describe(self) -> str:
        return f"{NAME} (fc_norm={self.fc_norm or 'none'}, norm_output={self.norm_output})"


def engine_flags(cfg: dict[str, Any], fmt: str) -> dict[str, bool]:
    """The three flags as the engine reads them from an exported config.json (`fmt` sglang or speculators)."""
    eagle = (cfg.get("eagle_config") or {}) if fmt == "sglang" else {}
    return {
        "fc_norm": bool(cfg.get("fc_norm") or cfg.get("use_aux_norm", False)),
        "norm_before_fc": bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
        "norm_output": bool(cfg.get("norm_output", False)),
    }


def normed_aux(aux, weights: list, eps: float):
    """aux [..., A*Dt] (low/mid/high concatenated) through the fc norms: one weight of width A*Dt normalises the
    whole concatenation (`norm_before_fc`), A weights of width Dt one chunk each (`fc_norm`); in aux's dtype."""
    from eyas.drafter.model import rms_norm

    if len(weights) == 1:
        return rms_norm(aux, weights[0], eps).to(aux.dtype)
    chunks = aux.chunk(len(weights), dim=-1)
    return torch.cat([rms_norm(c, w, eps).to(aux.dtype) for c, w in zip(chunks, weights)], dim=-1)


_ACTIVE: Variant | None = None


def active() -> Variant | None:
    """The variant eyas is patched with now (None: eyas as it is)."""
    return _ACTIVE


@contextlib.contextmanager
def patched(variant: Variant | None = None) -> Iterator[Variant]:
    """eyas computes, writes and reads `variant` (default: EAGLE-3.1) inside the block; everything is put back on
    exit. Drafters built inside keep the variant's modules afterwards."""
    global _ACTIVE
    variant = variant or Variant()
    if _ACTIVE is not None:
        raise RuntimeError(f"eyas is already patched with {_ACTIVE.describe()}")
    saved: list[tuple[Any, str, Any]] = []

    def put(owner, name: str, value) -> None:
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    try:
        for owner, name, value in _patches(variant):
            put(owner, name, value)
        _ACTIVE = variant
        yield variant
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
        _ACTIVE = None


def _patches(v: Variant):
    """(owner, attribute, replacement) for every piece of eyas the variant changes."""
    from torch import nn

    import eyas.pipeline as pipeline
    from eyas.drafter import reader, writer
    from eyas.drafter.model import Eagle3Drafter, MidLayer, RMSNorm, rms_norm
    from eyas.drafter.ttt import unroll
    from eyas.errors import EyasError
    from eyas.specdec.functional import FunctionalDrafter

    orig = {name: getattr(Eagle3Drafter, name) for name in ("__init__", "project_aux")}
    f_orig = {name: getattr(FunctionalDrafter, name) for name in ("fuse", "finish")}
    mid_finish = MidLayer.finish
    owner = {
        name: reader
        for name in ("canonical_weights", "check_shapes", "_eyas_config", "_config_from_sglang", "_speculators_layer")
    }
    owner.update({name: writer for name in ("write_eyas", "sglang_config", "vllm_config")})
    lay = {name: getattr(mod, name) for name, mod in owner.items()}
    fingerprint = pipeline.fingerprint
    mine = v.marker()

    # -- the training model -------------------------------------------------------------------------------------
    def __init__(self, cfg):
        orig["__init__"](self, cfg)
        A, Dt, eps = len(cfg.aux_layer_ids), cfg.target_hidden_size, cfg.rms_norm_eps
        if v.fc_norm == "per-aux":
            self.fc_norm = nn.ModuleList([RMSNorm(Dt, eps) for _ in range(A)])
        elif v.fc_norm == "concat":
            self.input_norm = RMSNorm(A * Dt, eps)
        if v.norm_output:  # the mid layer finishes with the drafter's final norm (kept out of its state_dict)
            object.__setattr__(self.midlayer, "_output_norm", self.norm)

    def fc_weights(drafter) -> list:
        if v.fc_norm == "per-aux":
            return [n.weight for n in drafter.fc_norm]
        return [drafter.input_norm.weight]

    def project_aux(self, aux):
        if v.fc_norm is not None:
            flat = aux.flatten(-2) if aux.dim() == 4 else aux
            if flat.shape[-1] == self.config.fc_in_features:  # (else the original names the mismatch)
                aux = normed_aux(flat, fc_weights(self), self.config.rms_norm_eps)
        return orig["project_aux"](self, aux)

    def finish(self, attn_BHTd, feature_BTD, w=None):
        out = mid_finish(self, attn_BHTd, feature_BTD, w)
        norm = getattr(self, "_output_norm", None)
        if norm is None:
            raise RuntimeError(f"{v.describe()}: a MidLayer outside an Eagle3Drafter has no final norm to finish with")
        return rms_norm(out, norm.weight, norm.eps).to(out.dtype)

    def compute_logits(self, hidden_BTD):
        return self.lm_head(hidden_BTD)  # already the final norm's output

    def rows(hidden_ND, rows, weight, eps, dtype=None):
        """`normed_rows` where the unroll's states are already the final norm's output: the rows, cast."""
        out = hidden_ND.index_select(0, rows)
        return out if dtype is None else out.to(dtype)

    # -- the decoding drafter (eval, generate) --------------------------------------------------------------------
    def fuse(self, aux):
        if v.fc_norm is not None:
            aux = normed_aux(aux.to(self.dtype), [self.w[k] for k in v.weight_shapes(self.config)], self.eps)
        return f_orig["fuse"](self, aux)

    def f_finish(self, attn, residual):
        return rms_norm(f_orig["finish"](self, attn, residual), self.w["norm.weight"], self.eps)

    def logits(self, out):
        import torch.nn.functional as F

        return F.linear(out, self.w["lm_head.weight"]).float()

    # -- layouts --------------------------------------------------------------------------------------------------
    def canonical_weights(raw, *, where):
        norms = {_NORM_KEY.match(k).group(1): t for k, t in raw.items() if _NORM_KEY.match(k)}
        out = lay["canonical_weights"]({k: t for k, t in raw.items() if not _NORM_KEY.match(k)}, where=where)
        out.update(norms)
        return out

    def check_shapes(config, weights, *, where):
        lay["check_shapes"](config, weights, where=where)
        want = v.weight_shapes(config)
        have = {k for k in weights if _NORM_KEY.match(k)}
        if have != set(want):
            raise EyasError(
                f"--drafter {where}: norm weights {sorted(have) or 'none'}, but {v.describe()} needs "
                f"{sorted(want) or 'none'}: a drafter trained without this variant (or with another)"
            )
        for k, shape in want.items():
            if tuple(weights[k].shape) != shape:
                raise EyasError(
                    f"--drafter {where}: {k} has shape {tuple(weights[k].shape)}, the config implies {shape}"
                )

    def _eyas_config(meta, directory):
        got = meta.get("lab_variant") if isinstance(meta, dict) else None
        if got != mine:
            raise EyasError(
                f"{Path(directory) / 'config.json'}: lab_variant {got!r}, but eyas is patched with "
                f"{v.describe()}: evaluate it with the eyas that trained it"
            )
        return lay["_eyas_config"](meta, directory)

    def write_eyas(out_dir, config, weights, *, target=None, extra=None):
        return lay["write_eyas"](out_dir, config, weights, target=target, extra={**(extra or {}), "lab_variant": mine})

    def check_flags(cfg, fmt, where):
        got, want = engine_flags(cfg, fmt), v.engine_fields()
        if got != want:
            raise EyasError(f"--drafter {where}: config flags {got}, but eyas is patched with {v.describe()} ({want})")

    def _config_from_sglang(cfg, *, where, target_layers, target_model_type):
        check_flags(cfg, "sglang", where)
        return lay["_config_from_sglang"](
            cfg, where=where, target_layers=target_layers, target_model_type=target_model_type
        )

    def _speculators_layer(cfg, *, where):
        check_flags(cfg, "speculators", where)
        return lay["_speculators_layer"]({k: x for k, x in cfg.items() if k not in v.engine_fields()}, where=where)

    def sglang_config(config, *, dtype):
        return {**lay["sglang_config"](config, dtype=dtype), **v.engine_fields()}

    def vllm_config(config, **kw):
        return {**lay["vllm_config"](config, **kw), **v.engine_fields()}

    # -- the pipeline ---------------------------------------------------------------------------------------------
    def stage_fingerprint(stage, cfg, input_fp, *, auto=frozenset()):
        if stage == "train":  # eval and export take the train stage's fingerprint as their input's
            input_fp = hashlib.sha256(json.dumps([input_fp, mine], sort_keys=True).encode()).hexdigest()
        return fingerprint(stage, cfg, input_fp, auto=auto)

    out = [(Eagle3Drafter, "__init__", __init__), (Eagle3Drafter, "project_aux", project_aux)]
    out += [(FunctionalDrafter, "fuse", fuse)]
    if v.norm_output:
        out += [
            (MidLayer, "finish", finish),
            (Eagle3Drafter, "compute_logits", compute_logits),
            (unroll, "normed_rows", rows),
            (FunctionalDrafter, "finish", f_finish),
            (FunctionalDrafter, "logits", logits),
        ]
    out += [
        (owner[name], name, fn)
        for name, fn in (
            ("canonical_weights", canonical_weights),
            ("check_shapes", check_shapes),
            ("_eyas_config", _eyas_config),
            ("write_eyas", write_eyas),
            ("_config_from_sglang", _config_from_sglang),
            ("_speculators_layer", _speculators_layer),
            ("sglang_config", sglang_config),
            ("vllm_config", vllm_config),
        )
    ]
    out += [(pipeline, "fingerprint", stage_fingerprint)]
    return out


def parse_args(argv: list[str]) -> tuple[Variant, list[str]]:
    """The variant's own leading options, then the eyas command line."""
    fc_norm, norm_output = "per-aux", True
    args = list(argv)
    while args and args[0].startswith(("--fc-norm", "--no-norm-output")):
        opt = args.pop(0)
        if opt == "--no-norm-output":
            norm_output = False
            continue
        value = opt.partition("=")[2] if "=" in opt else (args.pop(0) if args else "")
        if value not in (*FC_NORMS, "none"):
            raise SystemExit(f"--fc-norm {value!r}: expected one of {', '.join(FC_NORMS)} or none")
        fc_norm = None if value == "none" else value
    if not args:
        raise SystemExit(USAGE)
    return Variant(fc_norm=fc_norm, norm_output=norm_output), args


def main(argv: list[str] | None = None) -> None:
    """Patch eyas with the variant, then run eyas's command line in this process."""
    from lab.variants import run_eyas

    variant, args = parse_args(sys.argv[1:] if argv is None else argv)
    run_eyas(args, patched(variant), f"lab variant {variant.describe()}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "src"), str(root)]  # the eyas and the lab of this checkout
    main()
