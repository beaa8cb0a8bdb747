"""Capture throughput: plain forward vs naive capture vs eyas capture written to disk.

One run measures, on the same batches (B x T tokens of random ids, no padding):
  plain        base-model forward only (no lm_head: capture does not need logits either)
  packed       eyas's forward with packing hooks (stored layout, no copy to host)
  naive        eyas.target.forward_capture (stacked aux) + a same-stream .cpu() of aux and final
  eyas_<dtype> CapturePipeline + StoreWriter into --out: side-stream D2H into pinned buffers, a
               writer thread hashing/writing/fsyncing shards; the clock stops after the last shard
               is committed (fsync + rename + manifest), so the figure is "written to disk"
  eyas_bf16_shm the same into /dev/shm (CUDA only): the pipeline without the disk as a limit
plus the disk's own sequential write rate (4 GB, fsync) in --out, bytes on disk per token
against (A+1) x H x 2 (bf16) and x 1 (fp8), and the worst per-token relative error of the batched
bf16 capture against the unbatched reference that `eyas verify` uses (2 samples; calibrates the
verify tolerance for a bf16 target at this size).

GPU (default when CUDA is present): a Llama-3.1-8B-shaped model with random bf16 weights (32 layers,
H 4096, 32 heads / 8 KV heads, intermediate 14336, vocab 128256), built directly on the GPU; batches
of 8 x 2048; about 2-3 minutes on one H200:

    PYTHONPATH=src python benchmarks/capture_bench.py --out /tmp

CPU (--small): the embedded SmolLM2-135M in fp32, batches of 4 x 128, reports the CPU capture rate:

    PYTHONPATH=src python benchmarks/capture_bench.py --small --out /tmp

Progress goes to stderr; a table and, as the LAST stdout line, one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from eyas.capture.batching import make_batch
from eyas.capture.hooks import forward_capture_packed
from eyas.capture.pipeline import CapturePipeline
from eyas.store.format import bytes_per_token
from eyas.store.writer import StoreSpec, StoreWriter
from eyas.target import forward_capture


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_llama8b(device: str):
    """Llama-3.1-8B shape, random bf16 weights, constructed directly on the device (fast init there)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    # Initialise explicitly (on the device, seconds): the speed must not depend on what post_init did.
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_loop(fn, batches, device, warmup) -> float:
    for b in batches[:warmup]:
        fn(b)
    sync(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        fn(b)
    sync(device)
    return time.perf_counter() - t0


def disk_write_rate(out: Path, nbytes: int) -> float:
    """Sequential write + fsync, bytes/s (the ceiling for anything written to --out)."""
    path = out / f".eyas-disk-probe-{os.getpid()}"
    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return size / dt


def store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="CPU run on the embedded SmolLM2 (fp32)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda unless --small)")
    ap.add_argument("--out", default="/tmp", help="directory for the stores written (deleted after measuring)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (8 GPU, 4 --small)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048 GPU, 128 --small)")
    ap.add_argument("--batches", type=int, default=None, help="timed batches per mode (32 GPU, 3 --small)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed batches first (2 GPU, 1 --small)")
    ap.add_argument("--shard-bytes", type=int, default=1 << 30)
    ap.add_argument("--queue-depth", type=int, default=3)
    ap.add_argument("--no-shm", action="store_true", help="skip the /dev/shm run")
    args = ap.parse_args()

    device = args.device or ("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    small = args.small or device == "cpu"
    bsz = args.batch or (4 if small else 8)
    seq = args.seq or (128 if small else 2048)
    n_timed = args.batches or (3 if small else 32)
    warmup = args.warmup if args.warmup is not None else (1 if small else 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # -- model ----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    if small:
        from eyas.target import load_target

        model = load_target("default", device=device, dtype=torch.float32)
        model_name, model_dtype = "SmolLM2-135M-Instruct (fp32)", "fp32"
    else:
        model = build_llama8b(device)
        model_name, model_dtype = "Llama-3.1-8B shape, random bf16", "bf16"
    cfg = model.config
    n_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    layers = [2, n_layers // 2, n_layers - 3]
    slots = len(layers) + 1
    log(f"model: {model_name}, {n_layers} layers, H={hidden}, built in {time.perf_counter() - t0:.1f}s on {device}")

    g = torch.Generator().manual_seed(0)
    total = warmup + n_timed
    cpu_batches = [
        make_batch(
            [f"b{i}-{j}" for j in range(bsz)],
            [torch.randint(0, cfg.vocab_size, (seq,), generator=g) for _ in range(bsz)],
        )
        for i in range(total)
    ]
    dev_ids = [b.input_ids_BT.to(device) for b in cpu_batches]
    tokens = n_timed * bsz * seq
    results: dict = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "model": model_name,
        "batch": [bsz, seq],
        "timed_batches": n_timed,
        "tokens": tokens,
        "aux_layer_ids": layers,
        "hidden_size": hidden,
        "torch": torch.__version__,
    }

    # -- plain, packed, naive ---------------------------------------------------------------------
    idx = list(range(total))
    with torch.no_grad():
        dt = time_loop(lambda i: model.model(input_ids=dev_ids[i], use_cache=False), idx, device, warmup)
        results["plain_tok_s"] = tokens / dt
        log(f"plain forward: {results['plain_tok_s']:.0f} tok/s")
        dt = time_loop(
            lambda i: forward_capture_packed(model, dev_ids[i], None, None, layer_ids=layers, dtype="bf16"),
            idx,
            device,
            warmup,
        )
        results["packed_forward_tok_s"] = tokens / dt
        log(f"packed forward (hooks, no copy): {results['packed_forward_tok_s']:.0f} tok/s")

        def naive(i):
            aux, final = forward_capture(model, dev_ids[i], None, layer_ids=layers)
            return aux.cpu(), final.cpu()

        dt = time_loop(naive, idx, device, warmup)
        results["naive_capture_tok_s"] = tokens / dt
        log(f"naive capture (same stream .cpu()): {results['naive_capture_tok_s']:.0f} tok/s")

    # -- eyas pipeline into stores ----------------------------------------------------------------
    from eyas.store.writer import check_free_space

    check_free_space(
        out, tokens * bytes_per_token("bf16", slots=slots, hidden_size=hidden) + (4 << 30), what="the benchmark stores"
    )
    probe_bytes = (256 << 20) if small else (4 << 30)
    results["disk_write_GBps"] = disk_write_rate(out, probe_bytes) / 1e9
    log(f"disk sequential write + fsync in {out}: {results['disk_write_GBps']:.2f} GB/s")

    def eyas_run(dtype: str, root: Path) -> dict:
        spec = StoreSpec(
            aux_layer_ids=layers,
            hidden_size=hidden,
            dtype=dtype,
            model_dtype=model_dtype,
            producer={"backend": "capture_bench"},
        )
        pipe = CapturePipeline(
            model, layer_ids=layers, dtype=dtype, hidden_size=hidden, max_rows=bsz * seq, queue_depth=args.queue_depth
        )
        warm_dir, dir_ = root / f"eyas-bench-warm-{os.getpid()}", root / f"eyas-bench-{dtype}-{os.getpid()}"
        for d in (warm_dir, dir_):
            shutil.rmtree(d, ignore_errors=True)
        try:
            w = StoreWriter(warm_dir, spec, shard_bytes=args.shard_bytes)
            pipe.run(cpu_batches[:warmup], w)
            w.close(complete=True)
            sync(device)
            w = StoreWriter(dir_, spec, shard_bytes=args.shard_bytes)
            t0 = time.perf_counter()
            stats = pipe.run(cpu_batches[warmup:], w)
            w.close(complete=True)
            dt = time.perf_counter() - t0
            on_disk = store_bytes(dir_)
        finally:
            for d in (warm_dir, dir_):
                shutil.rmtree(d, ignore_errors=True)
        return {
            "tok_s": tokens / dt,
            "seconds": dt,
            "bytes_per_token": on_disk / tokens,
            "waited_for_disk_s": stats.main_wait_s,
            "writer_busy_s": stats.writer_busy_s,
        }

    for dtype in ("bf16", "fp8"):
        r = eyas_run(dtype, out)
        results[f"eyas_{dtype}_tok_s"] = r["tok_s"]
        results[f"eyas_{dtype}_bytes_per_token"] = r["bytes_per_token"]
        results[f"eyas_{dtype}_waited_for_disk_s"] = r["waited_for_disk_s"]
        results[f"eyas_{dtype}_writer_busy_s"] = r["writer_busy_s"]
        log(
            f"eyas capture {dtype} -> {out}: {r['tok_s']:.0f} tok/s, {r['bytes_per_token']:.1f} B/token "
            f"(main waited {r['waited_for_disk_s']:.2f}s for the writer, writer busy {r['writer_busy_s']:.2f}s of {r['seconds']:.2f}s)"
        )
    shm = Path("/dev/shm")
    if (
        device.startswith("cuda")
        and not args.no_shm
        and shm.is_dir()
        and shutil.disk_usage(shm).free > 2 * tokens * slots * hidden * 2
    ):
        r = eyas_run("bf16", shm)
        results["eyas_bf16_shm_tok_s"] = r["tok_s"]
        log(f"eyas capture bf16 -> /dev/shm: {r['tok_s']:.0f} tok/s")

    # -- numbers: batched packed capture vs the unbatched reference verify uses (2 samples) ---------
    try:
        from eyas.store.verify import compare_sample
        from eyas.target import reference_hidden_states

        with torch.no_grad():
            hidden_NLD, _ = forward_capture_packed(model, dev_ids[0], None, None, layer_ids=layers, dtype="bf16")
            worst = 0.0
            for j in range(2):
                aux, final = reference_hidden_states(model, dev_ids[0][j], layer_ids=layers)
                ref = torch.cat([aux, final.unsqueeze(1)], dim=1).float()
                err, _, _ = compare_sample(hidden_NLD[j * seq : (j + 1) * seq].float(), ref)
                worst = max(worst, err)
        results["bf16_store_worst_rel_err_vs_unbatched"] = worst
        log(f"batched bf16 capture vs unbatched reference (2 samples): worst per-token relative error {worst:.4f}")
    except Exception as exc:  # a diagnostic: never lose the throughput figures to it
        log(f"numbers check skipped: {type(exc).__name__}: {exc}")

    results["ideal_bf16_bytes_per_token"] = slots * hidden * 2
    results["ideal_fp8_bytes_per_token"] = slots * hidden * 1
    results["eyas_bf16_vs_plain"] = results["eyas_bf16_tok_s"] / results["plain_tok_s"]
    results["eyas_fp8_vs_plain"] = results["eyas_fp8_tok_s"] / results["plain_tok_s"]
    results["naive_vs_plain"] = results["naive_capture_tok_s"] / results["plain_tok_s"]
    results["target_ratio"] = 0.95

    # -- table ------------------------------------------------------------------------------------
    rows = [
        ("plain forward", results["plain_tok_s"], ""),
        ("packed forward (no copy)", results["packed_forward_tok_s"], ""),
        ("naive capture (.cpu())", results["naive_capture_tok_s"], ""),
        (
            "eyas bf16 -> disk",
            results["eyas_bf16_tok_s"],
            f"{results['eyas_bf16_bytes_per_token']:.1f} B/tok (ideal {slots * hidden * 2})",
        ),
        (
            "eyas fp8 -> disk",
            results["eyas_fp8_tok_s"],
            f"{results['eyas_fp8_bytes_per_token']:.1f} B/tok (ideal {slots * hidden})",
        ),
    ]
    if "eyas_bf16_shm_tok_s" in results:
        rows.append(("eyas bf16 -> /dev/shm", results["eyas_bf16_shm_tok_s"], ""))
    print(
        f"{model_name} on {results['device']}, {n_timed} x {bsz} x {seq} tokens, aux layers {layers}, disk {results['disk_write_GBps']:.2f} GB/s"
    )
    print(f"{'mode':28s} {'tok/s':>10s} {'vs plain':>9s}  bytes")
    for name, rate, extra in rows:
        print(f"{name:28s} {rate:10.0f} {rate / results['plain_tok_s']:9.3f}  {extra}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}, sort_keys=True))


if __name__ == "__main__":
    main()
