"""SpecForge 0.2.0's own EAGLE-3 training step, built in-process as the peer of benchmarks/train_bench.py.

train_bench.py times eyas's training step; this module builds ONE step of SpecForge's offline
EAGLE-3 trainer on the same drafter shape and the same synthetic batch (one sample x `seq` tokens),
so the eyas/SpecForge throughput ratio comes from one process on one machine, with no copied figure.
Everything that does work is SpecForge's own code, called the way its trainer calls it:

    draft      specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3 (bf16 parameters,
               embedding frozen, t2d/d2t set from a random sorted subset of the target vocabulary)
    training   specforge.algorithms.eagle3.model.OnlineEagle3Model (TTT unroll, per-step loss)
    teacher    specforge.modeling.target.target_head.TargetHead over the stored final hidden state:
               TargetHead.preprocess shift, then full-vocab logits + _compute_target_p (its default),
               or with teacher="compact" the streamed compute_target_p_padded_from_hidden
    loss       specforge.training.strategies.base.Eagle3TrainStrategy: sum_k 0.8**k * ploss_k, each
               ploss from its Triton LogSoftmaxLoss kernel
    step       specforge.training.controller.TrainerCore.train_step: backward, then
               specforge.optimizer.BF16Optimizer.step (global-norm clip 0.5, AdamW on fp32 masters,
               LR scheduler, copy back into the bf16 parameters), then its metric reduction
    attention  the trainer's default backend, flex_attention, on CUDA; sdpa on CPU

The key trade-off: we call SpecForge's modules directly instead of its `specforge train` entry
point, which needs a dataset on disk, a target checkpoint and a process group. The pieces we skip
are data loading (eyas's benchmark skips it too) and the FSDP wrapper that the launcher puts around
the draft at world size 1 (it can only add time, so leaving it out favours SpecForge).
Two settings differ from SpecForge's CLI defaults on purpose, to match eyas's benchmark; neither
changes the cost of a step: a constant learning rate 1e-4 with no warmup (SpecForge: cosine with
1.5% warmup) and AdamW betas (0.9, 0.95) (SpecForge: torch's default (0.9, 0.999)).

Import stand-ins (only inside this benchmark, never in eyas): SpecForge's packages are imported
module by module, never through `specforge.cli` or `specforge.training.trainer`, so sglang, yunchang,
wandb, openai-harmony, datasets and pydantic are not needed. Two stand-ins exist, and neither
changes what SpecForge computes:
  * If the import still fails on one of those optional packages (missing here), it is retried with
    an empty placeholder for that package (its attributes raise when called), served only during
    the import and removed from sys.modules afterwards; each one is logged. 0.2.0 needs none.
  * CPU only (the --tiny check): Triton cannot run on CPU. specforge.core.loss is imported with a
    placeholder `triton` that only satisfies its decorators, and OnlineEagle3Model's loss is bound to
    SpecForge's own reference `_compute_loss` from the same file, which computes the same value
    (mean over positions of the masked soft cross-entropy); and torch.compile is off during a CPU
    step (SpecForge compiles its teacher, loss, RoPE and RMSNorm helpers; eager gives the same
    numbers). Both are set for the length of each CPU step only and undone after it.
On CUDA the second is never used: the real Triton kernel and the compiled helpers run.

Run (SpecForge unpacked from its wheel on PYTHONPATH, e.g. pip install --no-deps --target DIR):
    PYTHONPATH=DIR:src python benchmarks/specforge_peer.py --tiny                     # CPU check
                      (20 steps on one fixed batch at lr 1e-3: the loss must be finite and go down)
    PYTHONPATH=DIR:src python benchmarks/specforge_peer.py --shape 8b --device cuda   # GPU timing
The last stdout line is one JSON document; progress goes to stderr.

Shape legend: B batch (1), T tokens, H hidden, Vt target vocab, Vd draft vocab, K TTT steps.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import time
import types
from collections.abc import Callable

import torch

SPECFORGE_VERSION = "0.2.0"
PLOSS_DECAY = 0.8  # Eagle3TrainStrategy's default
MAX_GRAD_NORM = 0.5  # SpecForge TrainingConfig.max_grad_norm default
LEARNING_RATE = 1e-4  # SpecForge TrainingConfig.learning_rate default (and eyas's benchmark)
OPTIONAL_PACKAGES = ("sglang", "yunchang", "wandb", "openai_harmony", "datasets", "pydantic")
SPECFORGE_MODULES = (
    "specforge.modeling.draft.llama3_eagle",
    "specforge.algorithms.eagle3.model",
    "specforge.modeling.target.target_head",
    "specforge.runtime.contracts",
    "specforge.training.strategies.base",
    "specforge.training.backend",
    "specforge.training.controller",
    "specforge.optimizer",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Importing SpecForge module by module
# ---------------------------------------------------------------------------------------------


class _Placeholder(types.ModuleType):
    """An optional package SpecForge imports but this step never uses: any attribute is an object
    that raises as soon as it is called, so a feature that did need it fails loudly."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*_a, **_k):
            raise RuntimeError(f"{self.__name__}.{name} is a benchmark placeholder: the package is not installed")

        return unavailable


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves placeholder modules for missing optional packages (and their submodules)."""

    def __init__(self, roots: set[str]):
        self.roots, self.created = roots, []

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Placeholder(spec.name)
        mod.__path__ = []
        self.created.append(spec.name)
        return mod

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _placeholders(roots: set[str]):
    finder = _PlaceholderFinder(roots)
    sys.meta_path.append(finder)  # last: a real installed package always wins
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in finder.created:
            sys.modules.pop(name, None)
        if finder.created:
            log(f"[specforge] placeholder modules used during import: {', '.join(finder.created)}")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _triton_placeholder() -> dict[str, types.ModuleType]:
    """Just enough of `triton` for specforge.core.loss's decorators at import time (CPU only)."""
    tl = types.ModuleType("triton.language")
    tl.constexpr = int
    tr = types.ModuleType("triton")
    tr.jit = lambda fn=None, **_k: fn if fn is not None else (lambda f: f)
    tr.language = tl
    tr.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    return {"triton": tr, "triton.language": tl}


_SF: types.SimpleNamespace | None = None


def _import_specforge() -> types.SimpleNamespace:
    """Import the SpecForge modules this step uses; raises ImportError with the cause."""
    global _SF
    if _SF is not None:
        return _SF
    import torch._dynamo  # noqa: F401  (torch probes for triton once; do it before any placeholder)

    torch.compile(lambda x: x)  # same: loads the compile machinery with the real (or no) triton
    if importlib.util.find_spec("specforge") is None:
        raise ImportError(
            f"specforge is not importable (install specforge=={SPECFORGE_VERSION} with "
            "`pip install --no-deps --target DIR` and put DIR on PYTHONPATH)"
        )
    # First without any placeholder; only a missing optional package that the import path really
    # reaches gets one, and the import is retried from scratch.
    stand_ins: set[str] = set()
    while True:
        try:
            with _placeholders(stand_ins):
                mods, loss_mod = _import_modules()
            break
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if root not in OPTIONAL_PACKAGES or root in stand_ins or not _missing(root):
                raise
            stand_ins.add(root)
            for name in [m for m in sys.modules if m == "specforge" or m.startswith("specforge.")]:
                del sys.modules[name]
    version = _installed_version()
    if version is not None and version != SPECFORGE_VERSION:
        log(f"[specforge] warning: found specforge {version}, this peer was written against {SPECFORGE_VERSION}")
    _SF = types.SimpleNamespace(loss=loss_mod, version=version, **mods)
    return _SF


def _import_modules() -> tuple[dict[str, types.ModuleType], types.ModuleType]:
    if _missing("triton"):
        # CPU only: the placeholder lives in sys.modules for this one import and is removed
        # again, so torch keeps seeing no triton.
        fake = _triton_placeholder()
        sys.modules.update(fake)
        try:
            importlib.import_module("specforge.core.loss")
        finally:
            for name in fake:
                sys.modules.pop(name, None)
    mods = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in SPECFORGE_MODULES}
    return mods, importlib.import_module("specforge.core.loss")


def _installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("specforge")
    except metadata.PackageNotFoundError:
        return None


def specforge_available() -> str | None:
    """None when SpecForge's EAGLE-3 trainer can be imported here; otherwise why not (one line)."""
    try:
        _import_specforge()
    except Exception as exc:  # any failure means "no peer", reported by the caller
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


# ---------------------------------------------------------------------------------------------
# Building one SpecForge training step
# ---------------------------------------------------------------------------------------------


def _draft_config(sf, shape: dict):
    LlamaConfig = sf.llama3_eagle.LlamaConfig
    rope = dict(shape.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", float(shape["rope_theta"]))
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        draft_vocab_size=shape["draft_vocab_size"],
        target_hidden_size=shape.get("target_hidden_size", shape["hidden_size"]),
        rms_norm_eps=shape["rms_norm_eps"],
        max_position_embeddings=shape["max_position_embeddings"],
        rope_parameters=rope,
        hidden_act="silu",
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )


def _target_head(sf, head_VtH: torch.Tensor):
    """SpecForge's TargetHead holding `head_VtH`, built without from_pretrained (which reads a
    checkpoint from disk); forward and preprocess are SpecForge's."""
    th = sf.target_head.TargetHead.__new__(sf.target_head.TargetHead)
    torch.nn.Module.__init__(th)
    th.hidden_size, th.vocab_size = head_VtH.shape[1], head_VtH.shape[0]
    th.fc = torch.nn.Linear(th.hidden_size, th.vocab_size, bias=False, device=head_VtH.device, dtype=head_VtH.dtype)
    with torch.no_grad():
        th.fc.weight.copy_(head_VtH)
    th.freeze_weights()
    return th.eval()


def synthetic_batch(shape: dict, *, seq: int, device, seed: int = 0, dtype=torch.bfloat16) -> dict:
    """The stored-state batch of train_bench.py (same generator, same draw order): ids [1, T],
    loss mask (t >= T // 10) [1, T], aux [1, T, 3H] (eyas's [1, T, 3, H] flattened), final [1, T, H],
    target head [Vt, H]."""
    B, T, H, Vt = 1, seq, shape["hidden_size"], shape["vocab_size"]
    n_aux = len(shape.get("aux_layer_ids") or (0, 1, 2))
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return {
        "ids": torch.randint(0, Vt, (B, T), generator=g).to(device),
        "mask": (torch.arange(T)[None].expand(B, T) >= T // 10).long().to(device),
        "aux": (torch.randn(B, T, n_aux, H, generator=g) * 4).reshape(B, T, n_aux * H).to(device, dtype),
        "final": torch.randn(B, T, H, generator=g).to(device, dtype),
        "head": (torch.randn(Vt, H, generator=g) * 0.05).to(device, dtype),
    }


def build_specforge_step(
    shape: dict,
    *,
    seq: int,
    ttt_steps: int,
    device,
    seed: int = 0,
    attention: str | None = None,
    teacher: str = "full",
    lr: float = LEARNING_RATE,
    betas: tuple[float, float] = (0.9, 0.95),
) -> Callable[[], torch.Tensor]:
    """One full SpecForge offline EAGLE-3 training step on a fixed synthetic batch; returns a
    callable that runs it and returns the weighted TTT loss (a detached scalar tensor).

    attention: SpecForge backend; default flex_attention on CUDA (its trainer's default), sdpa
    elsewhere. teacher: "full" (SpecForge's default: full-vocab logits from TargetHead) or "compact"
    (its --compact-teacher: streamed from hidden states and the head weight)."""
    device = torch.device(device)
    if teacher not in ("full", "compact"):
        raise ValueError(f"teacher must be 'full' or 'compact', got {teacher!r}")
    sf = _import_specforge()
    on_cuda = device.type == "cuda"
    backend = attention or ("flex_attention" if on_cuda else "sdpa")
    dtype = torch.bfloat16  # SpecForge's torch_dtype default; parameters are bf16, no autocast

    # draft and training model, as build_eagle3_draft / build_eagle3_model do
    torch.manual_seed(seed)
    config = _draft_config(sf, shape)
    draft = sf.llama3_eagle.LlamaForCausalLMEagle3(config, attention_backend=backend).to(dtype=dtype)
    Vt, Vd = shape["vocab_size"], shape["draft_vocab_size"]
    used = torch.sort(torch.randperm(Vt)[:Vd]).values  # as eyas's benchmark: a random sorted subset
    with torch.no_grad():
        draft.t2d.zero_()
        draft.t2d[used] = True
        draft.d2t.copy_(used - torch.arange(Vd))  # draft id i -> target id i + d2t[i]
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=dtype)
    model = sf.model.OnlineEagle3Model(draft_model=draft, length=ttt_steps, attention_backend=backend)
    model = model.to(device=device, dtype=dtype)

    data = synthetic_batch(shape, seq=seq, device=device, seed=seed, dtype=dtype)
    head = _target_head(sf, data["head"])
    strategy = sf.base.Eagle3TrainStrategy(
        model, target_head=head, ploss_decay=PLOSS_DECAY, compact_teacher=teacher == "compact"
    )

    def make_optimizer(target):
        opt = sf.optimizer.BF16Optimizer(
            target, lr=lr, max_grad_norm=MAX_GRAD_NORM, warmup_ratio=0.0, lr_scheduler="constant", total_steps=10**9
        )
        for group in opt.optimizer.param_groups:
            group["betas"] = tuple(betas)
        return opt

    backend_obj = sf.backend.FSDPTrainingBackend(sf.backend.ParallelConfig(), optimizer_factory=make_optimizer)
    wrapped = backend_obj.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    assert wrapped is model
    core = sf.controller.TrainerCore(strategy, backend_obj, accumulation_steps=1)

    # the offline collator's batch: TargetHead.preprocess shifts ids/target/mask inside the step
    loss_mask = data["mask"].clone()
    loss_mask[0, -1] = 0  # as SpecForge's offline normaliser does
    batch = sf.contracts.TrainBatch(
        sample_ids=["synthetic-0"],
        strategy="eagle3",
        tensors={
            "input_ids": data["ids"],
            "attention_mask": torch.ones_like(data["ids"]),
            "loss_mask": loss_mask,
            "hidden_state": data["aux"],
            "target": data["final"],
        },
        metadata={"target_repr": "hidden_state"},
    )

    last: dict = {}
    forward_loss = strategy.forward_loss

    def recording_forward_loss(b, ctx=None):
        out = forward_loss(b, ctx)
        last["loss"] = out.loss.detach()
        return out

    strategy.forward_loss = recording_forward_loss

    mode = contextlib.nullcontext if on_cuda else (lambda: _cpu_reference_mode(sf))

    def step() -> torch.Tensor:
        with mode():
            core.train_step(batch)
        return last["loss"]

    step.info = {
        "attention": backend,
        "teacher": teacher,
        "specforge_version": sf.version,
        "trainable_params_m": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
    }
    return step


@contextlib.contextmanager
def _cpu_reference_mode(sf):
    """CPU only, for the length of one step: SpecForge's loss bound to its reference implementation
    (its Triton kernel cannot run on CPU) and its torch.compile-decorated helpers run eagerly (the
    same numbers, without a C++ compile on every shape). Both are undone when the step ends."""
    import torch._dynamo

    reference = sf.loss._compute_loss

    class ReferenceLogSoftmaxLoss:
        @staticmethod
        def apply(logits, target, position_mask):
            return reference(logits, target, position_mask)

    kernel = sf.model.LogSoftmaxLoss
    sf.model.LogSoftmaxLoss = ReferenceLogSoftmaxLoss
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        sf.model.LogSoftmaxLoss = kernel


# ---------------------------------------------------------------------------------------------
# CLI: --tiny (CPU check) and --shape 8b (GPU timing)
# ---------------------------------------------------------------------------------------------

TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    draft_vocab_size=256,
    target_hidden_size=64,
    aux_layer_ids=[1, 2, 3],
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
)
LLAMA_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    draft_vocab_size=32000,
    target_hidden_size=4096,
    aux_layer_ids=[2, 16, 29],
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_tiny(*, steps: int, lr: float) -> dict:
    """Train the tiny shape on one fixed batch on CPU; the loss must be finite and go down."""
    device = torch.device("cpu")
    step = build_specforge_step(TINY, seq=64, ttt_steps=3, device=device, lr=lr)
    curve = []
    for i in range(steps):
        curve.append(float(step()))
        log(f"[tiny] step {i + 1:02d}/{steps}: loss {curve[-1]:.5f}")
    ok = all(map(lambda v: v == v and abs(v) != float("inf"), curve)) and curve[-1] < curve[0]
    return {
        "bench": "specforge_peer_tiny",
        "ok": ok,
        "loss_first": curve[0],
        "loss_last": curve[-1],
        "loss_curve": curve,
        "lr": lr,
        **step.info,
    }


def run_timed(
    shape: dict,
    *,
    device: torch.device,
    seq: int,
    ttt_steps: int,
    warmup: int,
    steps: int,
    attention: str | None,
    teacher: str,
) -> dict:
    step = build_specforge_step(
        shape, seq=seq, ttt_steps=ttt_steps, device=device, attention=attention, teacher=teacher
    )
    t0 = time.perf_counter()
    for i in range(warmup):
        loss = step()
        _sync(device)
        log(f"[specforge] warmup {i + 1}/{warmup}: loss {float(loss):.3f} ({time.perf_counter() - t0:.1f}s)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t1 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    dt = (time.perf_counter() - t1) / steps
    res = {"s_per_step": dt, "tokens_per_s": seq / dt, "warmup_s": t1 - t0, "loss": float(loss)}
    if device.type == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    log(f"[specforge] {dt * 1000:.1f} ms/step, {res['tokens_per_s']:.0f} tok/s")
    return {**res, **step.info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny shape, loss finite and decreasing")
    ap.add_argument("--shape", choices=["8b", "tiny"], default="8b", help="drafter shape to time")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny: training steps, 20)")
    ap.add_argument(
        "--attention",
        default=None,
        choices=["flex_attention", "sdpa", "fa"],
        help="SpecForge attention backend (default: flex_attention on CUDA, sdpa on CPU)",
    )
    ap.add_argument(
        "--teacher",
        default="full",
        choices=["full", "compact"],
        help="full: SpecForge's default teacher; compact: its --compact-teacher",
    )
    ap.add_argument("--lr", type=float, default=None, help="--tiny only (default 1e-3 there)")
    args = ap.parse_args()

    reason = specforge_available()
    if reason is not None:
        log(f"[specforge] not available: {reason}")
        print(json.dumps({"bench": "specforge_peer", "available": False, "reason": reason}))
        sys.exit(1)
    if args.tiny:
        res = run_tiny(steps=args.steps or 20, lr=args.lr or 1e-3)
        print(
            f"loss {res['loss_first']:.4f} -> {res['loss_last']:.4f} over {len(res['loss_curve'])} steps: "
            f"{'ok' if res['ok'] else 'FAILED'}"
        )
        print(json.dumps(res, sort_keys=True))
        sys.exit(0 if res["ok"] else 1)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = LLAMA_8B if args.shape == "8b" else TINY
    log(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}; SpecForge step, shape {args.shape}, 1 x {args.seq}, TTT {args.ttt_steps}"
    )
    res = run_timed(
        shape,
        device=device,
        seq=args.seq,
        ttt_steps=args.ttt_steps,
        warmup=args.warmup,
        steps=args.steps or 10,
        attention=args.attention,
        teacher=args.teacher,
    )
    res.update(
        {
            "bench": "specforge_peer",
            "shape": args.shape,
            "device": str(device),
            "seq": args.seq,
            "ttt_steps": args.ttt_steps,
            "batch": 1,
        }
    )
    print(f"{'peer':10s} {'ms/step':>9s} {'tok/s':>10s} {'peak GB':>8s}")
    print(
        f"{'specforge':10s} {res['s_per_step'] * 1000:9.1f} {res['tokens_per_s']:10.0f} {res.get('peak_mem_gb') or 0:8.1f}"
    )
    print(json.dumps(res, sort_keys=True))


if __name__ == "__main__":
    main()
