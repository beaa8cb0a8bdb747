"""Data-parallel capture scaling: `eyas capture` on 1 process vs `torchrun --nproc_per_node P` on the same data.

Measures `capture_2gpu_scaling` = tokens/s of P processes (one per GPU, one store) over tokens/s of one
process, through the real command lines, on one prepared dataset of random token ids:

    1 process   python -m eyas capture --device cuda ...                         -> store A (deleted after)
    P processes python -m torch.distributed.run --nproc_per_node P -m eyas capture --device cuda ...
                                                                                  -> store B, `eyas verify` on it

The rate of a run is the one its summary reports: captured tokens / seconds of the capture pipeline
(model loading excluded; with P processes, all tokens / the slowest process's seconds). The wall time
of each whole command (loading included) and the rate it implies are reported too. Stores go to
/dev/shm when it has room (so the figure is the GPUs' scaling, not one disk's), else under --work.

Targets (--models, comma-separated): `8b`, a Llama-3.1-8B-shaped model with random bf16 weights (built
on the GPU, saved once under --work, about 16 GB) with the SmolLM2 tokenizer; `smol`, the embedded
SmolLM2-135M. On a 2-GPU machine (each model about 3-6 minutes):

    PYTHONPATH=src python benchmarks/capture_dp_bench.py --models 8b --work /tmp/eyas_dp
    PYTHONPATH=src python benchmarks/capture_dp_bench.py --models smol --work /tmp/eyas_dp

A CPU smoke run (gloo; the figure means nothing on a shared CPU):

    PYTHONPATH=src python benchmarks/capture_dp_bench.py --models smol --device cpu --samples 8 --max-len 64

Progress goes to stderr; a table and, as the LAST stdout line, one JSON document of the figures.
A failure of one model is printed and recorded; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # NVLink multicast stays off on the lent multi-GPU machines
    env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ensure_target(name: str, work: Path, device: str) -> Path:
    from eyas.defaults import default_target_dir

    smol = default_target_dir()
    if name == "smol":
        return smol
    if name != "8b":
        raise ValueError(f"--models: `{name}`; choose 8b or smol")
    out = work / "llama8b_random"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    import transformers

    log(f"building the 8B-shaped random target into {out} (once)")
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
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    dev = "cuda" if device.startswith("cuda") else "cpu"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of 8B weights
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(smol).save_pretrained(tmp)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def ensure_prepared(target: Path, work: Path, *, samples: int, min_len: int, max_len: int, seed: int) -> Path:
    import torch

    from eyas.data.prepared import write_prepared
    from eyas.target import load_tokenizer, tokenizer_hash

    tok = load_tokenizer(target)
    tok_hash = tokenizer_hash(tok)
    out = work / f"prepared_{tok_hash[:8]}_{samples}_{min_len}_{max_len}_{seed}"
    if (out / "meta.json").is_file() or (out.is_dir() and any(out.iterdir())):
        return out
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    rows = []
    for i in range(samples):
        t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (t,), generator=g).tolist()
        rows.append((f"b{i:06d}", ids, [k >= t // 4 for k in range(t)]))
    write_prepared(out, {"train": rows}, {"tokenizer_hash": tok_hash}, overwrite=True)
    return out


def store_root(work: Path, need_bytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes * 1.3 + (4 << 30):
        return shm / "eyas_capture_dp"
    return work / "stores"


def run_cmd(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[dict, float]:
    log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {res.stderr.strip()[-1500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1]), wall


def bench_model(name: str, args, env: dict[str, str]) -> dict:
    target = ensure_target(name, args.work, args.device)
    data = ensure_prepared(
        target, args.work, samples=args.samples, min_len=args.min_len, max_len=args.max_len, seed=args.seed
    )
    from transformers import AutoConfig

    from eyas.target import hidden_size_of

    d = hidden_size_of(AutoConfig.from_pretrained(target))
    tokens_est = args.samples * (args.min_len + args.max_len) // 2
    per_token = 4 * d * {"bf16": 2, "fp8": 1, "fp32": 4}[args.dtype]
    root = store_root(args.work, tokens_est * per_token)
    root.mkdir(parents=True, exist_ok=True)
    log(f"[{name}] target {target}, data {data} (~{tokens_est} tokens), stores under {root}")
    common = [
        "capture",
        "--target",
        str(target),
        "--data",
        str(data),
        "--store-dtype",
        args.dtype,
        "--device",
        args.device,
        "--token-budget",
        str(args.token_budget),
    ]
    row: dict = {"model": name, "device": args.device, "processes": args.procs, "store_root": str(root)}
    one, many = root / f"{name}_1proc", root / f"{name}_{args.procs}proc"
    for p in (one, many):
        shutil.rmtree(p, ignore_errors=True)
    try:
        s1, w1 = run_cmd([sys.executable, "-m", "eyas", *common, "--out", str(one)], env, args.timeout)
        shutil.rmtree(one, ignore_errors=True)
        log(f"[{name}] 1 process: {s1.get('tokens_per_s')} tok/s ({s1['captured_tokens']} tokens, wall {w1:.1f} s)")
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.procs),
            "-m",
            "eyas",
        ]
        s2, w2 = run_cmd([*launcher, *common, "--out", str(many)], env, args.timeout)
        log(
            f"[{name}] {args.procs} processes: {s2.get('tokens_per_s')} tok/s (wall {w2:.1f} s), per rank {s2.get('per_rank')}"
        )
        row.update(
            {
                "tokens": s1["captured_tokens"],
                "samples": s1["captured_samples"],
                "tokens_per_s_1": s1.get("tokens_per_s"),
                f"tokens_per_s_{args.procs}": s2.get("tokens_per_s"),
                "scaling": round(s2["tokens_per_s"] / s1["tokens_per_s"], 3)
                if s1.get("tokens_per_s") and s2.get("tokens_per_s")
                else None,
                "wall_s_1": round(w1, 1),
                f"wall_s_{args.procs}": round(w2, 1),
                "wall_scaling": round(w1 / w2, 3),
                "per_rank": s2.get("per_rank"),
                "same_samples": s2["samples"] == s1["samples"],
            }
        )
        if args.verify != "none":
            vcmd = [
                sys.executable,
                "-m",
                "eyas",
                "verify",
                "--store",
                str(many),
                "--device",
                args.device,
                "--numbers",
                "4" if args.verify == "quick" else "8",
            ]
            if args.verify == "quick":
                vcmd.append("--no-invariants")
            try:
                v, wv = run_cmd(vcmd, env, args.timeout)
                row["verify"] = {
                    "ok": v.get("ok"),
                    "mode": args.verify,
                    "seconds": round(wv, 1),
                    "samples": (v.get("coverage") or {}).get("expected_samples"),
                }
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:  # exit 1 = a failed check
                row["verify"] = {"ok": False, "mode": args.verify, "error": str(exc)[-600:]}
    finally:
        for p in (one, many):
            shutil.rmtree(p, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="8b,smol", help="comma-separated: 8b, smol")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (gloo)")
    ap.add_argument("--procs", type=int, default=2, help="processes of the data-parallel run (one per GPU)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/eyas_capture_dp"), help="target and prepared data (kept)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", help="stored dtype: bf16, fp8, fp32")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument(
        "--verify",
        choices=("quick", "full", "none"),
        default="quick",
        help="eyas verify on the P-process store: quick = coverage + checksums + 4 recomputed samples; full = with invariants",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    args = ap.parse_args()
    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < args.procs:
            log(f"only {torch.cuda.device_count()} GPUs for --procs {args.procs}; the figure needs one GPU per process")
    args.work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.device)
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            rows.append(bench_model(name, args, env))
        except Exception as exc:  # one model failing must not lose the others' figures
            log(f"[{name}] FAILED: {type(exc).__name__}: {exc}")
            rows.append({"model": name, "error": f"{type(exc).__name__}: {str(exc)[-800:]}"})
    print(
        f"{'model':6} {'tokens':>9} {'tok/s 1':>10} {'tok/s ' + str(args.procs):>10} {'scaling':>8} {'wall x':>7} {'verify':>7}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['model']:6} error: {r['error'][:100]}")
            continue
        print(
            f"{r['model']:6} {r['tokens']:>9} {r['tokens_per_s_1']!s:>10} {r[f'tokens_per_s_{args.procs}']!s:>10} "
            f"{r['scaling']!s:>8} {r['wall_scaling']!s:>7} {str((r.get('verify') or {}).get('ok')):>7}"
        )
    result = {
        "bench": "capture_2gpu_scaling" if args.procs == 2 else f"capture_{args.procs}proc_scaling",
        "device": args.device,
        "dtype": args.dtype,
        "samples": args.samples,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    try:
        import torch

        if args.device.startswith("cuda"):
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
