"""Training throughput of the EAGLE-3 drafter: tokens/s, peak memory and MFU.

Two suites, one JSON document as the last stdout line (metric names of benchmarks/results.jsonl):

`--suite 8b` (default): the Llama-3.1-8B-shaped drafter (H 4096, 32 heads / 8 KV heads, head dim 128, intermediate
14336, target vocab 128256, draft vocab 32000, llama3 RoPE), TTT 7, one sample of 2048 tokens per step, synthetic
stored states (aux [T, 3, H] and final [T, H] in bf16, copied from pinned host memory every step on a side stream,
one step ahead, as the store loader does). A step is what `eyas train` runs: the packed forward/backward with the
fused chunked head loss (teacher logits from the target lm_head on the fly), bf16 autocast with fp32 master weights,
grad clipping, fused AdamW, the LR scheduler and the per-step statistics read back to the host. In the same process:
the earlier padded path with materialised teacher probabilities (`reference`), the other setting of
TTTConfig.cast_once than the default picks for the shape (`eyas-per-step-casts`: every TTT step casts the mid
layer's weights itself and autograd sums their gradients; `eyas-cast-once`: weights cast once a forward, autograd
summing the steps' gradients),
`eyas-head-grad-copies` (the head's weight gradient summed through an fp32 copy of each chunk's product: kernel
addmm_fp32 off), `eyas-repeated-keys` (step 0's keys repeated to every query head instead of read by the varlen
flash kernel's grouped-query mode: kernel gqa_flash off), `eyas-stats-every-step` (the statistics read at the end of
each step instead of one step late: what a per-step wait for the GPU costs),
`eyas-stats-late-on-device` (read one step late but from the device tensors, which waits for the step queued after
them too: the loop before its pinned host copies, train/prefetch.py HostCopies),
`eyas-no-align` (every supervised row's loss kept: TrainConfig.align_topk 0), `eyas-muon`
(`--optimizer muon`), `eyas-torch-ce` (the head loss's compiled torch cross-entropy, not the fused kernel: kernel ce
off), `eyas-torch-stats` (the kept teacher table's maximum and log-sum-exp by a compiled torch reduction, not the
Triton kernel: kernel teacher_stats off),
and SpecForge 0.2.0's own trainer on the same configuration when it is importable (benchmarks/specforge_peer.py).
Metrics: train_8b_tok_s, train_8b_vs_specforge (both of the default options: the ratio of the medians),
train_8b_vs_specforge_paired (the median of the per-round ratios), train_8b_per_step_casts_vs_specforge.
On CUDA the variants are timed in turns (--rounds, default 5 rounds of --steps steps each, every variant built and
resident first) and each one's median round is reported with its spread and, for eyas's steps, the host's median
wait for the GPU in a step (`wait ms`; well above 0: the GPU bounds the step; near 0 says nothing by itself, see
`wait ms` under --suite smol): one after another, the same code measures noticeably apart within a call (the step's
host time can exceed its GPU time).

`--suite smol --target DIR --data PREPARED [--data PREPARED ...]`: the real `eyas train` (online,
the SmolLM2-135M target in the loop, TTT 7, draft vocab 32000) on prepared chats, for each
`--budgets` tokens per batch: steady-state tokens/s from metrics.jsonl (after `--skip` steps),
supervised (answer) tokens/s, the share of time the target took, peak GPU memory, and the host's median wait
for the GPU in a step (the records' host_wait_s). Near 0 does not by itself say the host bounds the step: when the
GPU's launch queue is full, the host blocks inside kernel launches instead of at the read (a profile names that
wait `Command Buffer Full`; seen on 2026-12-02 in the online SmolLM2 step, GPU-bound with a 0.05 ms wait). Metrics:
train_smol_tok_s (real tokens, no padding), train_smol_supervised_tok_s, train_smol_peak_gb_128k.
`--cache off` measures the target in the loop on every batch (a first epoch); `--cache on` with a small
prepared set (a few batches an epoch) and --skip past its first epoch measures the rate of the epochs
after the first, which read the target's states from the state cache.

    PYTHONPATH=src python benchmarks/train_bench.py                       # GPU, 8B shape
    PYTHONPATH=src python benchmarks/train_bench.py --suite smol --target /root/smol --data /root/prep
    PYTHONPATH=src python benchmarks/train_bench.py --small               # CPU, SmolLM2 drafter shape
    PYTHONPATH=src torchrun --standalone --nproc_per_node 2 benchmarks/train_bench.py [--fsdp]

MFU counts matmul FLOPs per token (T tokens, K TTT steps, H hidden, Hq heads, d head dim, I inter,
V draft vocab, Vt target vocab):
    per TTT step, linears (fwd + bwd = 6 FLOPs per MAC):
        6 * [2H*Hq*d + 2*(2H*Hkv*d) + Hq*d*H + 3*H*I + H*V]
    per TTT step k, attention (QK^T and PV, fwd + bwd = 3x the forward 4*Hq*d per key):
        12 * Hq * d * ((T + 1) / 2 + k)       (causal keys on average + k diagonal keys)
    once: fc 4 * 3H*H (no input gradient)  +  teacher lm_head 2 * H * Vt (forward only)
MFU = tokens/s * FLOPs/token / peak, against the 989 TFLOP/s dense bf16 datasheet figure and
the 756 TFLOP/s bf16 matmul rate measured on an H200 with a plain torch.matmul loop (2026-11-29).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # --cast-once, --cache -> the config fields (None: default)

H200_PEAK, H200_MEASURED = 989e12, 756e12


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shapes(small: bool) -> dict:
    if small:  # SmolLM2-135M-Instruct
        return dict(
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            draft_vocab_size=32000,
            target_hidden_size=576,
            aux_layer_ids=[2, 15, 27],
            target_num_layers=30,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
        )
    return dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        draft_vocab_size=32000,
        target_hidden_size=4096,
        aux_layer_ids=[2, 16, 29],
        target_num_layers=32,
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


def flops_per_token(c: dict, *, T: int, K: int) -> dict:
    H, Hq, Hkv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    I = c["intermediate_size"]  # noqa: E741
    V, Vt = c["draft_vocab_size"], c["vocab_size"]
    lin = 2 * H * Hq * d + 2 * (2 * H * Hkv * d) + Hq * d * H + 3 * H * I + H * V
    linears = 6 * lin * K
    attention = sum(12 * Hq * d * ((T + 1) / 2 + k) for k in range(K))
    fc = 4 * 3 * H * H
    teacher = 2 * H * Vt
    return {
        "linears": linears,
        "attention": attention,
        "fc": fc,
        "teacher": teacher,
        "total": linears + attention + fc + teacher,
    }


def _synthetic(c: dict, *, B: int, T: int, device, seed: int, rank: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed + 1 + 1000 * rank)  # each rank its own batch
    bf16 = device.type == "cuda"
    sdt = torch.bfloat16 if bf16 else torch.float32
    # synthetic stored states: residual-stream-like aux, unit-RMS final, a target head with peaked logits
    return {
        "ids": torch.randint(0, c["vocab_size"], (B, T), generator=g),
        "mask": torch.arange(T)[None].expand(B, T) >= T // 10,
        "aux": (torch.randn(B, T, len(c["aux_layer_ids"]), c["hidden_size"], generator=g) * 4).to(sdt),
        "final": torch.randn(B, T, c["hidden_size"], generator=g).to(sdt),
        "head": (torch.randn(c["vocab_size"], c["hidden_size"], generator=g) * 0.05).to(device, sdt),
    }


def _drafter(c: dict, device, *, seed: int, compile_parts: bool):
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(seed)
    cfg = DrafterConfig(**c)
    with torch.device(device):
        drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values)
    if compile_parts:
        from eyas.drafter.ttt import compile_drafter

        compile_drafter(drafter)
    return drafter


def make_fast_step(
    c: dict,
    *,
    B: int,
    T: int,
    K: int,
    device,
    dist=None,
    fsdp: bool = False,
    seed: int = 0,
    compile_parts: bool = False,
    grad_reduce: str = "fp32",
    cast_once: bool | None = None,
    defer_stats: bool | None = None,
    align_topk: int | None = None,
    bf16: bool | None = None,
    host_copies: bool = True,
    optimizer: str = "adamw",
):
    """One `eyas train` step on the packed path (train/loop.py), data copied from pinned host memory.
    `defer_stats`: the step's statistics are copied to pinned host memory behind it and read after the NEXT step is
    queued, as the loop does (None: as the loop); else at the step's end, which waits for the
    GPU. `host_copies` False: the deferred statistics read from the device instead, which waits for the next step too
    (the loop before HostCopies). No other wait in a step: its per-step denominators go through pinned memory, as
    the loop's. `align_topk`: TrainConfig's (None: its default, as `eyas train`). The step's `waited` holds the
    seconds its statistics' reads waited for the GPU (measure_rounds' wait_ms).
    `bf16`: bf16 autocast (default: on CUDA, as `eyas train`). `optimizer`: TrainConfig's (`muon`: Muon for the
    drafter's hidden matrices, train/optim.py; not with FSDP).
    On CUDA the next step's batch is copied on a side stream while this step runs, as the loop's offline reader
    does (train/prefetch.py AheadUploader)."""
    from eyas.drafter.ttt import TTTConfig
    from eyas.packing import to_device
    from eyas.train.batches import PackedBatch, _packed_to, pack_tokens
    from eyas.train.data import Item
    from eyas.train.loop import PackedTTTModule, TrainConfig, lr_lambda
    from eyas.train.optim import make_optimizer
    from eyas.train.prefetch import AheadUploader, HostCopies

    defer_stats = True if defer_stats is None else defer_stats
    if align_topk is None:
        align_topk = TrainConfig.__dataclass_fields__["align_topk"].default

    drafter = _drafter(c, device, seed=seed, compile_parts=compile_parts)
    data = _synthetic(c, B=B, T=T, device=device, seed=seed, rank=dist.rank if dist is not None else 0)
    module = PackedTTTModule(
        drafter, TTTConfig(steps=K, cast_once=cast_once, align_topk=align_topk), head_VtD=data["head"]
    ).to(device)
    bf16 = device.type == "cuda" if bf16 is None else bf16
    if dist is not None and dist.enabled:
        from eyas.train.dist import wrap_model

        module = wrap_model(module, dist, fsdp=fsdp, bf16=bf16, grad_reduce=grad_reduce)
    items = [Item(str(i), data["ids"][i], data["mask"][i]) for i in range(B)]
    ids, mask, seg, rows = pack_tokens(items, steps=K, pad_to=None)
    pin = device.type == "cuda"
    host = PackedBatch(
        ids, seg, rows, data["aux"].flatten(0, 1), data["final"].flatten(0, 1), B * T, B * T, int(mask.sum())
    )
    if pin:
        host = PackedBatch(
            ids.pin_memory(),
            seg.pin_memory(),
            [r.pin_memory() for r in rows],
            host.aux_NAD.pin_memory(),
            host.final_ND.pin_memory(),
            B * T,
            B * T,
            host.supervised,
        )
    denoms = torch.tensor([float(len(r)) for r in rows], dtype=torch.float64)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(module, optimizer, lr=1e-4, weight_decay=0.0, fused=device.type == "cuda" and not fsdp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup=10, total=10_000, min_ratio=0.1))
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and not fsdp)

    uploader = AheadUploader(device) if pin else None

    def step():
        if uploader is None:
            b = _packed_to(host, device)
        else:
            if not uploader.started:
                uploader.start(host)
            b = uploader.take()
            uploader.start(host)  # the next step's copy overlaps this step's compute
        with amp:
            loss, stats = module(b.input_ids_N, b.seg, b.rows, b.aux_NAD, b.final_ND, to_device(denoms, device), b.live)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if not defer_stats:
            stats.tolist()  # the loop reads its statistics back every step
        else:
            if pending:  # the step before's, copied to the host behind it: waits for that step alone
                pending.pop().get()[0].tolist()
            pending.append(HostCopies((stats,)) if host_copies else _OnDevice(stats))
        waited[0] += time.perf_counter() - t0
        return loss

    pending: list = []
    waited = [0.0]
    step.waited = waited
    return step


class _OnDevice:
    """A step's statistics kept on the device (`make_fast_step(host_copies=False)`): reading them waits for all the
    work queued after them."""

    def __init__(self, t):
        self.t = t

    def get(self):
        return (self.t,)


def patched(step, patcher):
    """`step` run under `patcher` (a unittest.mock patch of a ttt setting: the variants of the default path)."""

    def run():
        with patcher:
            return step()

    run.waited = getattr(step, "waited", None)
    return run


def kernel_setting(spec: str) -> tuple[str, str]:
    """NAME[=0|1|on|off] (NAME a kernel of eyas.kernels) -> (NAME, 'on' or 'off')."""
    from eyas import kernels

    name, _, value = spec.partition("=")
    mode = {"": "on", "1": "on", "on": "on", "0": "off", "off": "off"}.get(value.lower())
    if name not in kernels.names() or mode is None:
        raise SystemExit(
            f"--flag {spec!r}: expected KERNEL[=on|off], KERNEL one of {', '.join(kernels.names())} "
            "(eyas's module settings were removed: lab/LOG.md)"
        )
    return name, mode


def set_flag(spec: str) -> None:
    """--flag KERNEL[=0|off]: force a kernel of eyas.kernels on (or off) for this process (EYAS_KERNELS)."""
    name, mode = kernel_setting(spec)
    os.environ[kernels_env()] = ",".join(filter(None, [os.environ.get(kernels_env(), ""), f"{name}:{mode}"]))


def kernels_env() -> str:
    from eyas import kernels

    return kernels.ENV


def with_kernel(step, name: str, mode: str):
    """`step` with one kernel of eyas.kernels forced on or off while it runs (EYAS_KERNELS), e.g. gqa_flash off."""
    kernel_setting(f"{name}={mode}")
    value = ",".join(filter(None, [os.environ.get(kernels_env(), ""), f"{name}:{mode}"]))
    return patched(step, mock.patch.dict(os.environ, {kernels_env(): value}))


def make_reference_step(c: dict, *, B: int, T: int, K: int, device, seed: int = 0):
    """The earlier path: padded rows, teacher probabilities materialised for the whole batch."""
    from eyas.drafter.ttt import TTTConfig, step_denominators, teacher_from_final
    from eyas.train.loop import TTTModule

    drafter = _drafter(c, device, seed=seed, compile_parts=False)
    module = TTTModule(drafter, TTTConfig(steps=K)).to(device)
    data = {k: v.to(device) for k, v in _synthetic(c, B=B, T=T, device=device, seed=seed).items()}
    bf16 = device.type == "cuda"
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    used, t2d = drafter.used_target_ids(), drafter.t2d
    denoms = step_denominators(data["mask"], K).to(device)

    def step():
        teacher = teacher_from_final(data["final"], data["head"], used, t2d)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _stats = module(
                data["ids"], data["mask"], data["aux"], teacher.probs_BTV, teacher.top_BT, teacher.in_vocab_BT, denoms
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_up(step, *, warmup: int, device, label: str) -> float:
    """`warmup` untimed steps (compiles, allocator), each logged; -> their seconds."""
    t0 = time.perf_counter()
    for i in range(warmup):
        loss = step()
        sync(device)
        log(f"[{label}] warmup {i + 1}/{warmup}: loss {float(loss.detach()):.3f} ({time.perf_counter() - t0:.1f}s)")
    return time.perf_counter() - t0


def measure(step, *, warmup: int, steps: int, device, tokens_per_step: int, label: str) -> dict:
    t0 = time.perf_counter()
    warm_up(step, warmup=warmup, device=device, label=label)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    dt = (time.perf_counter() - t1) / steps
    res = {"s_per_step": dt, "tokens_per_s": tokens_per_step / dt, "warmup_s": t1 - t0, "loss": float(loss.detach())}
    if device.type == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    log(f"[{label}] {dt * 1000:.1f} ms/step, {res['tokens_per_s']:.0f} tok/s")
    return res


def measure_rounds(
    variants: list, runs: dict, *, rounds: int, warmup: int, steps: int, device, tokens_per_step: int
) -> float | None:
    """Every variant built and warmed up first, then timed in `rounds` rounds of `steps` steps, the variants taking
    turns within each round; a variant's time is the median of its rounds. Run one after another, variants of the
    same code differed by up to 13% between two calls (a step bound by the host: what else the host does moves
    it), more than the variants' effects; taking turns spreads such drift over all of them. -> the peak GPU memory
    of the whole run (all variants resident), None off CUDA."""
    built: dict = {}
    for label, make in variants:

        def warm(label=label, make=make):
            step = make()
            seconds = warm_up(step, warmup=warmup, device=device, label=label)
            built[label] = step
            return {"warmup_s": seconds}

        _try(label, runs, warm)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: dict = {label: [] for label in built}
    waits: dict = {label: [] for label in built}  # per step, the time the host waited for the GPU (eyas's steps)
    for r in range(rounds):
        for label in list(built):
            waited = getattr(built[label], "waited", None)
            try:
                sync(device)
                w0 = waited[0] if waited else 0.0
                t0 = time.perf_counter()
                for _ in range(steps):
                    loss = built[label]()
                sync(device)
            except Exception as exc:  # e.g. out of memory with every variant resident: the others go on
                log(f"[{label}] failed in round {r + 1} ({type(exc).__name__}: {str(exc)[:300]})")
                runs[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                del built[label], times[label]
                continue
            times[label].append((time.perf_counter() - t0) / steps)
            if waited:
                waits[label].append((waited[0] - w0) / steps)
            runs[label]["loss"] = float(loss.detach())
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1] * 1000:.1f}" for k, v in times.items()) + " ms/step")
    for label, ts in times.items():
        dt = statistics.median(ts)
        runs[label].update(
            s_per_step=dt,
            tokens_per_s=tokens_per_step / dt,
            rounds_ms=[round(t * 1000, 2) for t in ts],
            spread=(max(ts) - min(ts)) / dt,
        )
        if waits[label]:  # well above 0: the GPU bounds the step (near 0: see the module's docstring)
            runs[label]["wait_ms"] = statistics.median(waits[label]) * 1000
    return torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None


def _paired_ratio(ours: dict, peer: dict) -> float | None:
    """The median over rounds of peer ms / our ms, each round's pair timed back to back (None without rounds).
    The rounds move together (the machine's state: 2026-12-01, every variant slow in the same rounds), which a
    ratio of the two medians does not cancel."""
    a, b = ours.get("rounds_ms"), peer.get("rounds_ms")
    if not a or not b or len(a) != len(b):
        return None
    return statistics.median(y / x for x, y in zip(a, b))


def _finish_runs(runs: dict, fl: dict, W: int) -> None:
    for r in runs.values():
        if "tokens_per_s" in r:
            achieved = r["tokens_per_s"] * fl["total"]
            r["tflops"] = achieved / 1e12
            r["mfu_vs_989"] = achieved / (H200_PEAK * W)  # per GPU
            r["mfu_vs_756_measured"] = achieved / (H200_MEASURED * W)


def _try(label: str, runs: dict, fn) -> None:
    """Run one measured variant; a failure is reported and the other variants stand."""
    try:
        runs[label] = fn()
    except Exception as exc:  # an optional variant (compile, a peer) must not sink the benchmark
        log(f"[{label}] failed ({type(exc).__name__}: {str(exc)[:500]})")
        runs[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def suite_8b(args, dist) -> dict:
    device, W = dist.device, dist.world
    T = args.seq or (512 if args.small else 2048)
    B, K = args.batch, args.ttt_steps
    steps = args.steps or (10 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    c = shapes(args.small)
    fl = flops_per_token(c, T=T, K=K)
    log(
        f"drafter H={c['hidden_size']} heads={c['num_attention_heads']}/{c['num_key_value_heads']} I={c['intermediate_size']} "
        f"V={c['draft_vocab_size']}/{c['vocab_size']}, batch {B} x {T}, TTT {K}; {fl['total'] / 1e9:.2f} GFLOP/token"
    )
    result: dict = {
        "suite": "8b" if not args.small else "small",
        "batch": B,
        "seq": T,
        "ttt_steps": K,
        "world": W,
        "parallel": ("fsdp2" if args.fsdp else f"ddp-{args.grad_reduce}") if W > 1 else "none",
        "gflop_per_token": fl["total"] / 1e9,
        "flops_breakdown_gflop": {k: v / 1e9 for k, v in fl.items()},
    }
    if device.type == "cuda":
        from eyas.drafter.ttt import check_fast_attention
        from eyas.packing import check_varlen_kernel, pick_varlen_kernel

        result["varlen_check_max_abs_diff"] = check_varlen_kernel(device, torch.bfloat16)
        result["varlen_kernel"] = pick_varlen_kernel(
            torch.empty(1, 1, 1, c["head_dim"], device=device, dtype=torch.bfloat16)
        )
        log(
            f"packed attention kernel {result['varlen_kernel']}: max |diff| vs exact {result['varlen_check_max_abs_diff']:.4f}"
        )
        result["fast_attention_check_max_abs_diff"] = check_fast_attention(device, torch.bfloat16)
        log(
            f"fast attention vs dense reference (bf16, out + grads): max |diff| {result['fast_attention_check_max_abs_diff']:.4f}"
        )
    runs: dict = {}
    kw = dict(device=device, tokens_per_step=W * B * T)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        step = make_fast_step(
            c,
            B=B,
            T=T,
            K=K,
            device=device,
            dist=dist,
            fsdp=args.fsdp,
            grad_reduce=args.grad_reduce,
            compile_parts=device.type == "cuda",
            cast_once=AUTO_ON_OFF[args.cast_once],
        )
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(2):
                step()
            sync(device)
        print_profile(prof, device, args.profile)
        return result
    # "eyas" = `eyas train`'s default options: the drafter's pieces compiled on CUDA
    fast = dict(c=c, B=B, T=T, K=K, device=device, dist=dist, grad_reduce=args.grad_reduce)
    variants = [("eyas", lambda: make_fast_step(**fast, fsdp=args.fsdp, compile_parts=device.type == "cuda"))]
    if device.type == "cuda" and not args.fsdp:
        from eyas.drafter.ttt import TTTConfig

        other = not TTTConfig().cast_once_for(c["hidden_size"])  # the other cast_once setting than the default's
        variants += [
            (
                "eyas-cast-once" if other else "eyas-per-step-casts",
                lambda: make_fast_step(**fast, compile_parts=True, cast_once=other),
            ),
            (
                "eyas-head-grad-copies",
                lambda: with_kernel(make_fast_step(**fast, compile_parts=True), "addmm_fp32", "off"),
            ),
            # step 0's keys repeated to every query head, not read by the flash kernel's grouped-query mode
            ("eyas-repeated-keys", lambda: with_kernel(make_fast_step(**fast, compile_parts=True), "gqa_flash", "off")),
            ("eyas-stats-every-step", lambda: make_fast_step(**fast, compile_parts=True, defer_stats=False)),
            # read one step late from the device: the read waits for the step queued after them (before HostCopies)
            ("eyas-stats-late-on-device", lambda: make_fast_step(**fast, compile_parts=True, host_copies=False)),
            ("eyas-no-align", lambda: make_fast_step(**fast, compile_parts=True, align_topk=0)),
            # Muon for fc and the decoder layer's matrices (its Newton-Schulz iterations' cost at this shape)
            ("eyas-muon", lambda: make_fast_step(**fast, compile_parts=True, optimizer="muon")),
            # the head loss's cross-entropy by compiled torch (the default: the fused Triton kernel)
            ("eyas-torch-ce", lambda: with_kernel(make_fast_step(**fast, compile_parts=True), "ce", "off")),
            # the kept teacher table's row statistics by a compiled torch reduction (the default: one Triton kernel)
            (
                "eyas-torch-stats",
                lambda: with_kernel(make_fast_step(**fast, compile_parts=True), "teacher_stats", "off"),
            ),
        ]
    if device.type == "cuda" and not args.no_compile:
        variants.append(("eyas-no-compile", lambda: make_fast_step(**fast, fsdp=args.fsdp)))
    if W == 1 and not args.no_reference:
        variants.append(("eyas-reference-path", lambda: make_reference_step(c, B=B, T=T, K=K, device=device)))
    if W == 1 and device.type == "cuda" and not args.no_specforge:
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
        try:
            import specforge_peer

            why = specforge_peer.specforge_available()
        except Exception as exc:  # the peer harness itself missing or broken
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            variants.append(
                ("specforge", lambda: specforge_peer.build_specforge_step(c, seq=T, ttt_steps=K, device=device))
            )
        else:
            log(f"SpecForge not measured: {why}")
            result["specforge_skipped"] = why
    if args.variants:
        keep = args.variants.split(",")
        unknown = sorted(set(keep) - {label for label, _ in variants})
        if unknown:
            raise SystemExit(f"--variants: {', '.join(unknown)} not among {', '.join(label for label, _ in variants)}")
        variants = [v for v in variants if v[0] in keep]
    rounds = args.rounds if args.rounds is not None else (5 if device.type == "cuda" else 1)
    result["rounds"] = rounds
    if rounds > 1:
        result["peak_mem_gb_all_variants"] = measure_rounds(
            variants, runs, rounds=rounds, warmup=warmup, steps=steps, **kw
        )
    else:
        for label, make in variants:
            _try(
                label,
                runs,
                lambda label=label, make=make: measure(make(), warmup=warmup, steps=steps, label=label, **kw),
            )
    if device.type == "cuda":
        from eyas import kernels

        why = kernels.checked().get(("addmm_fp32", device.type, torch.bfloat16), "not checked")
        result["head_grad_in_matmul"] = why is None
        log(f"head weight gradient summed inside the matmul: {result['head_grad_in_matmul']}")
    _finish_runs(runs, fl, W)
    ours = [k for k in ("eyas", "eyas-no-compile") if "tokens_per_s" in runs.get(k, {})]
    result["runs"] = runs
    if ours:
        best = max(ours, key=lambda k: runs[k]["tokens_per_s"])
        result["best"] = best
        result["train_8b_tok_s"] = runs["eyas"].get("tokens_per_s")  # default options
        result["train_8b_best_tok_s"] = runs[best]["tokens_per_s"]
        if "tokens_per_s" in runs.get("specforge", {}):
            result["train_8b_vs_specforge"] = runs["eyas"]["tokens_per_s"] / runs["specforge"]["tokens_per_s"]
            result["train_8b_best_vs_specforge"] = runs[best]["tokens_per_s"] / runs["specforge"]["tokens_per_s"]
            paired = _paired_ratio(runs["eyas"], runs["specforge"])
            if paired is not None:
                result["train_8b_vs_specforge_paired"] = paired
            if "tokens_per_s" in runs.get("eyas-per-step-casts", {}):
                result["train_8b_per_step_casts_vs_specforge"] = (
                    runs["eyas-per-step-casts"]["tokens_per_s"] / runs["specforge"]["tokens_per_s"]
                )
    if dist.is_main:
        print(
            f"{'mode':22s} {'ms/step':>9s} {'tok/s':>10s} {'TFLOP/s':>9s} {'MFU/989':>8s} {'MFU/756':>8s} {'peak GB':>8s}"
            f" {'spread':>7s} {'wait ms':>8s}"
        )
        for name, r in runs.items():
            if "tokens_per_s" not in r:
                print(f"{name:22s} failed: {r['error'][:80]}")
                continue
            print(
                f"{name:22s} {r['s_per_step'] * 1000:9.1f} {r['tokens_per_s']:10.0f} {r['tflops']:9.1f} "
                f"{r['mfu_vs_989']:8.3f} {r['mfu_vs_756_measured']:8.3f} "
                + (f"{r['peak_mem_gb']:8.1f}" if r.get("peak_mem_gb") is not None else f"{'-':>8s}")
                + f" {r['spread'] if 'spread' in r else float('nan'):7.3f}"
                + (f" {r['wait_ms']:8.2f}" if "wait_ms" in r else f" {'-':>8s}")
            )
        if result.get("peak_mem_gb_all_variants"):
            print(
                f"peak GPU memory with every variant resident: {result['peak_mem_gb_all_variants']:.1f} GB; "
                f"ms/step: the median of {rounds} rounds (spread: (max - min) / median); wait ms: the host's wait "
                "for the GPU in a step (its statistics' read); well above 0: the GPU bounds the step"
            )
    return result


BY_SHAPE = (
    "aten::copy_",
    "aten::_to_copy",
    "aten::add_",
    "aten::add",
    "aten::mul",
    "aten::clone",
    "aten::zero_",
    "aten::fill_",
    "aten::index_add_",
    "aten::index_copy_",
    "aten::index_select",
    "aten::gather",
)
"""The ops `print_profile` splits by input shapes: copies, casts, additions, and the fills and index ops behind the
online SmolLM2 step's memsets (cudaMemsetAsync: 31.9 ms of device time in two steps, 2026-12-02, not yet placed)."""


def print_profile(prof, device, rows: int) -> None:
    """The top `rows` ops of a finished torch profile by device time (CPU: CPU time), by host time on CUDA (where
    a step bound by the host spends it), the ops of BY_SHAPE split by their input shapes (where they come from), and
    the step's named parts (RANGES). A profile whose event tree cannot be built prints why, not a traceback: the run's
    figures still follow."""
    limit = sys.getrecursionlimit()
    # torch's profiler builds its event tree by recursion; a profile taken with stacks once raised RecursionError
    # there at the default limit (in a full test run); Python-to-Python calls cost no C stack on Python >= 3.11
    sys.setrecursionlimit(max(limit, 50_000))
    try:
        _print_profile(prof, device, rows)
    except RecursionError:
        print("profile: its event tree is nested too deep to build; no tables")
    finally:
        sys.setrecursionlimit(limit)


def _print_profile(prof, device, rows: int) -> None:
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key.removeprefix("self_"), row_limit=rows))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in BY_SHAPE]

    def self_us(e):  # torch 2.11 names the device time self_device_time_total (self_cuda_time_total before)
        return (
            getattr(e, "self_device_time_total", None)
            if device.type == "cuda" and hasattr(e, "self_device_time_total")
            else getattr(e, key)
        )

    by_shape.sort(key=self_us, reverse=True)
    print(f"{'op':16s} {'calls':>6s} {'self ms':>8s}  input shapes")
    for e in by_shape[:rows]:
        print(f"{e.key:16s} {e.count:6d} {self_us(e) / 1e3:8.2f}  {str(e.input_shapes)[:150]}")
    print_ranges(prof.key_averages(), device)
    print_fill_sites(prof, device, rows)


FILLS = ("aten::zero_", "aten::fill_")


def print_fill_sites(prof, device, rows: int) -> None:
    """Where the fills (memsets on CUDA) come from: FILLS grouped by the Python lines that queued them (autograd's
    fills under the forward line whose backward made them), by device time; only in a profile taken with stacks
    (--profile-stacks)."""
    try:
        sites = [e for e in prof.key_averages(group_by_stack_n=4) if e.key in FILLS and e.stack]
    except (AssertionError, RuntimeError):  # a profile without stacks
        return
    if not sites:
        return
    key = (
        "self_device_time_total"
        if device.type == "cuda" and hasattr(sites[0], "self_device_time_total")
        else "self_cpu_time_total"
    )
    sites.sort(key=lambda e: getattr(e, key), reverse=True)
    print(f"{'fill':12s} {'calls':>6s} {'self ms':>8s}  where (innermost first)")
    for e in sites[:rows]:
        print(f"{e.key:12s} {e.count:6d} {getattr(e, key) / 1e3:8.2f}  {' <- '.join(e.stack)[:200]}")


RANGES = (
    "eyas.target_forward",
    "eyas.drafter_forward",
    "_HeadSoftCE",
    "eyas.drafter_backward",
    "eyas.optimizer",
    "Command Buffer Full",
)
"""The named parts of the real loop's step (train/step.py, train/batches.py; _HeadSoftCE is the head's loss with its
gradients, inside the drafter's forward) and the host's waits for a full GPU launch queue."""


def print_ranges(averages, device) -> None:
    """Device and host time of each of RANGES present in a profile's averages (every profiled step together)."""
    found = {e.key: e for e in averages if e.key in RANGES}
    if not found:
        return
    dev_key = "device_time_total" if hasattr(next(iter(found.values())), "device_time_total") else "cuda_time_total"
    print(f"{'part of the step':24s} {'calls':>6s} {'device ms':>10s} {'host ms':>9s}")
    for name in RANGES:
        if name in found:
            e = found[name]
            dev_ms = getattr(e, dev_key, 0) / 1e3 if device.type == "cuda" else float("nan")
            print(f"{name:24s} {e.count:6d} {dev_ms:10.1f} {e.cpu_time_total / 1e3:9.1f}")


def _steady(metrics_file, skip: int) -> dict:
    recs = [json.loads(x) for x in Path(metrics_file).read_text().splitlines() if '"eval"' not in x]
    tail = recs[skip:] or recs
    secs = sum(r["step_s"] for r in tail)
    return {
        "steps_timed": len(tail),
        "tokens_per_s": sum(r["tokens"] for r in tail) / secs,
        "supervised_tokens_per_s": sum(r["supervised_tokens"] for r in tail) / secs,
        "useful_fraction": sum(r["tokens"] for r in tail) / max(1, sum(r["padded_tokens"] for r in tail)),
        "target_share": tail[-1].get("target_share"),
        "final_loss": tail[-1]["loss"],
        "wait_ms": statistics.median(r.get("host_wait_s", 0.0) for r in tail) * 1000,
    }


def _loop_profile(args, cuda: bool):
    """With --profile: a torch profile of the real loop's steps --skip + 2 and + 3 (after one warm step), stepped
    through run(step_end=profiler_step(prof)); else None."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stacks = (
        dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))
        if getattr(args, "profile_stacks", False)
        else {}
    )
    prof = profile(
        activities=acts, record_shapes=True, schedule=schedule(wait=args.skip, warmup=1, active=2, repeat=1), **stacks
    )
    return prof


def profiler_step(prof):
    """run()'s step_end for a profile (None: none)."""
    return None if prof is None else (lambda step: prof.step())


def suite_smol(args) -> dict:
    """The real `eyas train` (online) on prepared data, per tokens-per-batch budget."""
    import tempfile
    from pathlib import Path

    from eyas.train.loop import TrainConfig, run

    budgets = [int(x) for x in args.budgets.split(",")]
    result: dict = {"suite": "smol", "target": args.target, "budgets": budgets, "runs": {}}
    work = Path(args.work or tempfile.mkdtemp(prefix="train_bench_"))
    for di, data in enumerate(args.data):
        for budget in budgets:
            for compiled in [None, False] if (args.compile_smol and budget == budgets[-1]) else [None]:
                label = (
                    f"data{di}-{budget // 1024}k"
                    + ("-no-compile" if compiled is False else "")
                    + (f"-cache-{args.cache}" if args.cache != "auto" else "")
                    + (f"-cast-once-{args.cast_once}" if args.cast_once != "auto" else "")
                    + "".join(f"-{f.replace('=', '-')}" for f in args.flag)
                    + (f"-{args.optimizer}" if args.optimizer else "")
                    + ("-profiled" if args.profile else "")
                )
                steps = args.steps or max(12, min(40, (4 << 20) // budget))

                def one(data=data, budget=budget, compiled=compiled, label=label, steps=steps):  # this iteration's
                    cuda = args.device in (None, "cuda") or str(args.device).startswith("cuda")
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    prof = _loop_profile(args, cuda)
                    t0 = time.perf_counter()
                    with prof or nullcontext():
                        summary = run(
                            TrainConfig(
                                target=args.target,
                                data=Path(data),
                                out=work / label,
                                steps=steps,
                                tokens_per_batch=budget,
                                ttt_steps=args.ttt_steps,
                                draft_vocab=args.draft_vocab,
                                device=args.device or "cuda",
                                eval_samples=8,
                                compile=compiled,
                                max_length=min(2048, budget),
                                overwrite=True,
                                lr=1e-4,
                                optimizer=args.optimizer,
                                cache_states=AUTO_ON_OFF[args.cache],
                                ttt_cast_once=AUTO_ON_OFF[args.cast_once],
                            ),
                            step_end=profiler_step(prof),
                        )
                    if prof is not None:
                        print_profile(prof, torch.device("cuda" if cuda else "cpu"), args.profile)
                    r = _steady(work / label / "metrics.jsonl", args.skip)
                    r.update(
                        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                        wall_s=time.perf_counter() - t0,
                        steps=steps,
                        data=str(data),
                        tokens_per_batch=budget,
                        compiled=compiled,
                        summary_tokens_per_s=summary.get("tokens_per_s"),
                        state_cache=summary.get("state_cache"),
                        target_forwards=summary.get("target_forwards"),
                        profiled=prof is not None,
                    )
                    log(
                        f"[{label}] {r['tokens_per_s']:.0f} tok/s ({r['supervised_tokens_per_s']:.0f} supervised), "
                        f"useful {r['useful_fraction']:.3f}, target share {r['target_share']}, "
                        f"peak {r['peak_mem_gb']:.1f} GB"
                    )
                    return r

                _try(label, result["runs"], one)
    ok = {
        k: r for k, r in result["runs"].items() if "tokens_per_s" in r and r["compiled"] is None and not r["profiled"]
    }
    if ok:
        best = max(ok, key=lambda k: ok[k]["tokens_per_s"])
        result["best"] = best
        result["train_smol_tok_s"] = ok[best]["tokens_per_s"]
        result["train_smol_supervised_tok_s"] = ok[best]["supervised_tokens_per_s"]
        for r in ok.values():
            if r["tokens_per_batch"] >= 131072:
                result["train_smol_peak_gb_128k"] = max(result.get("train_smol_peak_gb_128k", 0), r["peak_mem_gb"])
    print(f"{'run':24s} {'tok/s':>9s} {'superv/s':>9s} {'useful':>7s} {'target':>7s} {'peak GB':>8s} {'wait ms':>8s}")
    for name, r in result["runs"].items():
        if "tokens_per_s" not in r:
            print(f"{name:24s} failed: {r['error'][:80]}")
            continue
        print(
            f"{name:24s} {r['tokens_per_s']:9.0f} {r['supervised_tokens_per_s']:9.0f} {r['useful_fraction']:7.3f} "
            f"{(r['target_share'] or 0):7.2f} {r['peak_mem_gb']:8.1f} {r['wait_ms']:8.2f}"
        )
    print(
        "wait ms: the median over the timed steps of the host's wait for the GPU when it read a step's statistics "
        "(well above 0: the GPU bounds the step; near 0: the host did not wait there, which it also does not when "
        "it waits in kernel launches behind a full GPU queue: a profile tells the two apart)"
    )
    return result


def main() -> None:
    from eyas.train.optim import OPTIMIZERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="8b", choices=["8b", "smol"])
    ap.add_argument("--small", action="store_true", help="8b suite with the SmolLM2-135M drafter shape (CPU-sized run)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; --small: 512)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (8b: default 10 on CUDA, 3 on CPU; smol: optimizer steps per run, default by budget)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3 on CUDA, 1 on CPU)")
    ap.add_argument(
        "--variants",
        default=None,
        help="8b: only these variants (comma-separated labels, e.g. eyas,eyas-shared-weight-grads)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="8b: time the variants in this many rounds of --steps "
        "steps, taking turns, and report each one's median (default 5 on CUDA; 1 = one after another)",
    )
    ap.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 instead of DDP")
    ap.add_argument(
        "--grad-reduce",
        default="fp32",
        choices=["fp32", "bf16"],
        help="under torchrun, DDP: gradient all-reduce dtype (eyas train --grad-reduce)",
    )
    ap.add_argument(
        "--profile-stacks",
        action="store_true",
        help="smol --profile: record Python stacks too and place the fills (memsets) at the lines that "
        "queued them (once failed to build its event tree inside a full test run: off by default)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="8b: print the top N ops of two profiled steps and stop; "
        "smol: of two steps of each run after --skip (its rates are then left out of the figures)",
    )
    ap.add_argument(
        "--cast-once",
        default="auto",
        choices=list(AUTO_ON_OFF),
        help="8b --profile and smol: TTTConfig.cast_once (auto: the default, by the drafter's size)",
    )
    ap.add_argument("--no-compile", action="store_true", help="8b: skip the torch.compile variant")
    ap.add_argument("--no-reference", action="store_true", help="8b: skip the earlier padded path")
    ap.add_argument("--no-specforge", action="store_true", help="8b: skip SpecForge even when importable")
    ap.add_argument("--target", default=None, help="smol: the SmolLM2 target directory")
    ap.add_argument("--data", action="append", default=[], help="smol: prepared dataset (repeatable)")
    ap.add_argument("--budgets", default="4096,32768,65536,131072", help="smol: tokens per batch, comma-separated")
    ap.add_argument("--compile-smol", action="store_true", help="smol: also run the last budget with --no-compile")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="smol: draft vocabulary size")
    ap.add_argument("--skip", type=int, default=3, help="smol: steps left out of the steady-state rate")
    ap.add_argument(
        "--cache",
        default="auto",
        choices=list(AUTO_ON_OFF),
        help="smol: the online state cache (eyas train --cache-states); with `on` and a prepared set "
        "of a few batches, --skip past the first epoch measures the cached rate",
    )
    ap.add_argument("--work", default=None, help="smol: run directories (default a temp dir)")
    ap.add_argument(
        "--optimizer",
        default=None,
        choices=list(OPTIMIZERS),
        help="smol: eyas train's --optimizer (default: its own, by the drafter's width)",
    )
    ap.add_argument(
        "--flag",
        action="append",
        default=[],
        metavar="KERNEL[=0]",
        help="smol: force a kernel of eyas.kernels on (=0: off) for the run, e.g. teacher_stats=0 (repeatable)",
    )
    args = ap.parse_args()
    for spec in args.flag:
        set_flag(spec)

    if args.suite == "smol":
        if not args.target or not args.data:
            ap.error("--suite smol needs --target and at least one --data")
        log(f"device {args.device or 'cuda'}, torch {torch.__version__}")
        result = suite_smol(args)
        print(json.dumps(result, sort_keys=True))
        return
    from eyas.train import dist as dd

    dist = dd.setup(args.device or "auto")  # torchrun: one process per GPU (NCCL) or per CPU slot (gloo)
    if not dist.is_main:
        globals()["log"] = lambda msg: None
    device = dist.device
    log(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}"
    )
    result = suite_8b(args, dist)
    if dist.enabled:
        import torch.distributed as tdist

        tdist.barrier()
    dd.teardown(dist)
    if dist.is_main:
        print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
