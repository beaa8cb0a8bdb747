"""What the SGLang capture plugin costs per token, on the shapes of a real target.

SGLang itself cannot run on our GPU image, so this measures the plugin's own work on packed
forwards shaped like SGLang's (several requests per EXTEND forward, long prompts chunked across
forwards, padding rows), with tensors on the GPU as the plugin sees them:

  observe   CaptureCore.observe: per-request row slicing, device-to-host copies, stitching
  write     + DumpWriter on its thread: safetensors + meta.json per sample, atomic rename
  client    read_dump + check_sample + delete, as capture_from_sglang does per sample

Compare the tokens/s with the target's plain forward rate (34.7K tokens/s for the 8B shape on one
H200 in lab/archive/RESULTS.md, from benchmarks/capture_bench.py): a stage much faster costs little.

GPU:  PYTHONPATH=src python benchmarks/sglang_plugin_overhead.py            (8B shape, ~1 min)
CPU:  PYTHONPATH=src python benchmarks/sglang_plugin_overhead.py --small
The last stdout line is one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from eyas.sglang.core import CaptureCore, DumpWriter, ForwardInfo, make_rid, read_dump
from eyas.sglang.request import check_sample


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def schedule(lengths: list[int], chunk: int, budget: int) -> list[list[tuple[int, int, int]]]:
    """SGLang-like prefill schedule: forwards of (request, start, n) under a token budget and chunk size."""
    done = [0] * len(lengths)
    forwards = []
    while any(d < n for d, n in zip(done, lengths)):
        left, fwd = budget, []
        for r, n in enumerate(lengths):
            if done[r] >= n or left <= 0:
                continue
            k = min(n - done[r], chunk, left)
            fwd.append((r, done[r], k))
            done[r] += k
            left -= k
        forwards.append(fwd)
    return forwards


def make_forwards(plan, rids, *, aux: int, hidden: int, dtype, device, pad_to: int):
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for fwd in plan:
        T = sum(n for *_, n in fwd)
        Tp = T + (-T) % pad_to
        out.append(
            ForwardInfo(
                rids=[rids[r] for r, _, _ in fwd],
                extend_prefix_lens=[s for _, s, _ in fwd],
                extend_seq_lens=[n for *_, n in fwd],
                aux=[torch.randn(Tp, hidden, generator=g, device=device, dtype=dtype) for _ in range(aux)],
                final_TD=torch.randn(Tp, hidden, generator=g, device=device, dtype=dtype),
                positions_T=torch.cat(
                    [torch.arange(s, s + n, device=device) for _, s, n in fwd]
                    + [torch.zeros(Tp - T, dtype=torch.long, device=device)]
                ),
                input_ids_T=torch.cat(
                    [torch.arange(s, s + n, device=device) % 1000 for _, s, n in fwd]
                    + [torch.zeros(Tp - T, dtype=torch.long, device=device)]
                ),
            )
        )
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--aux", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=2048, help="mean prompt length (lengths vary +-50%%)")
    ap.add_argument("--chunk", type=int, default=8192, help="SGLang --chunked-prefill-size")
    ap.add_argument("--forward-tokens", type=int, default=16384, help="tokens per EXTEND forward")
    ap.add_argument("--dump-dir", default="/dev/shm/eyas-bench-dumps")
    ap.add_argument("--writer-threads", type=int, default=4, help="DumpWriter threads (the plugin uses 4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="CPU-sized run")
    a = ap.parse_args()
    if a.small:
        a.hidden, a.requests, a.prompt_len, a.chunk, a.forward_tokens = 256, 12, 256, 300, 1024
    device = torch.device(a.device)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    lengths = [max(8, int(a.prompt_len * (0.5 + torch.rand(1, generator=g).item()))) for _ in range(a.requests)]
    # a few long prompts so that chunked prefill stitches several pieces
    lengths[0] = lengths[1] = 2 * a.chunk + 17
    tokens = sum(lengths)
    bytes_per_token = (a.aux + 1) * a.hidden * 2
    plan = schedule(lengths, a.chunk, a.forward_tokens)
    log(
        f"{a.requests} prompts, {tokens} tokens, {len(plan)} forwards, H={a.hidden}, A={a.aux}, bf16 "
        f"({bytes_per_token} B/token), device {device}"
    )
    dump_dir = Path(a.dump_dir)
    results = {}

    def run_stage(name, write: bool):
        shutil.rmtree(dump_dir, ignore_errors=True)
        rids = [make_rid(n, f"{name}-{i}") for i, n in enumerate(lengths)]
        fwds = make_forwards(plan, rids, aux=a.aux, hidden=a.hidden, dtype=dtype, device=device, pad_to=64)
        core = CaptureCore()
        writer = DumpWriter(dump_dir, layer_ids=list(range(2, 2 + a.aux)), threads=a.writer_threads) if write else None
        sync(device)
        t0 = time.perf_counter()
        done = 0
        for info in fwds:
            out = core.observe(info)
            done += sum(s.status == "complete" for s in out)
            if writer:
                writer.submit(out)
        if writer:
            writer.close()
        sync(device)
        dt = time.perf_counter() - t0
        assert done == a.requests, f"{done} of {a.requests} samples completed"
        if writer:
            assert not writer.errors, writer.errors[:3]
        results[name] = {
            "seconds": round(dt, 4),
            "tokens_per_s": round(tokens / dt, 1),
            "GB_per_s": round(tokens * bytes_per_token / dt / 1e9, 3),
        }
        log(f"{name:8s} {dt:8.3f} s  {tokens / dt:12,.0f} tok/s  {tokens * bytes_per_token / dt / 1e9:6.2f} GB/s")
        return rids

    run_stage("warmup", write=False)
    del results["warmup"]
    run_stage("observe", write=False)
    rids = run_stage("write", write=True)

    t0 = time.perf_counter()
    for rid, n in zip(rids, lengths):
        d = read_dump(dump_dir / rid)
        ids = torch.arange(n) % 1000
        meta = {"prompt_tokens": n, "cached_tokens": 0}
        reason = check_sample(ids, meta, d, layer_ids=list(range(2, 2 + a.aux)), hidden_size=a.hidden)
        assert reason is None, reason
        shutil.rmtree(dump_dir / rid)
    dt = time.perf_counter() - t0
    results["client"] = {
        "seconds": round(dt, 4),
        "tokens_per_s": round(tokens / dt, 1),
        "GB_per_s": round(tokens * bytes_per_token / dt / 1e9, 3),
    }
    log(f"{'client':8s} {dt:8.3f} s  {tokens / dt:12,.0f} tok/s  {tokens * bytes_per_token / dt / 1e9:6.2f} GB/s")
    shutil.rmtree(dump_dir, ignore_errors=True)

    print(f"{'stage':8s} {'tok/s':>12s} {'GB/s':>7s}")
    for k, v in results.items():
        print(f"{k:8s} {v['tokens_per_s']:12,.0f} {v['GB_per_s']:7.2f}")
    print(
        json.dumps(
            {
                "benchmark": "sglang_plugin_overhead",
                "device": str(device),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "hidden": a.hidden,
                "aux": a.aux,
                "requests": a.requests,
                "tokens": tokens,
                "forwards": len(plan),
                "bytes_per_token": bytes_per_token,
                "writer_threads": a.writer_threads,
                "stages": results,
            }
        )
    )


if __name__ == "__main__":
    main()
