"""The SGLang capture's child process (eyas.sglang.apart) on a device host, without SGLang (issue 41).

  capture  a tiny random Llama with SmolLM2's tokenizer (files in TOKENIZER_DIR), 64 prepared samples, the stand-in
           server (eyas.sglang.standin) in this process, and capture_from_sglang through the child, its reference and
           calibration on DEVICE, in-process client and 2 worker processes: does the child work there, and how long
           do its steps take beside the loop (`beside`, `phases`)
  spawn    the child alone, its first and second tokenizer hash of the tiny target `capture` saved: what a fresh
           process's imports cost on this host

    PYTHONPATH=src python3 lab/scripts/apart_check.py capture TOKENIZER_DIR [--device cuda] [--root /root/gpucheck]
    PYTHONPATH=src python3 lab/scripts/apart_check.py spawn [--root /root/gpucheck]

Both need the `if __name__ == "__main__":` guard below: the spawned child imports this script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LAYERS = [2, 3, 4]


def capture(a) -> None:
    import torch
    import transformers

    from eyas.data.prepared import write_prepared
    from eyas.sglang.client import capture_from_sglang
    from eyas.sglang.standin import StandinConfig, StandinServer
    from eyas.target import tokenizer_hash

    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    tiny = root / "tiny"
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(tiny)
    tok.save_pretrained(tiny)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 12, 23, 40, 9, 31, 17, 26] * 8
    samples = [
        (f"s{i}", torch.randint(100, 40000, (n,), generator=g).tolist(), [True] * n) for i, n in enumerate(lengths)
    ]
    prep = root / "prep"
    write_prepared(prep, {"train": samples, "eval": []}, {"tokenizer_hash": tokenizer_hash(tok)})
    for procs in (0, 2):
        with StandinServer(StandinConfig(target=tiny, dump_dir=root / f"dumps{procs}", layer_ids=LAYERS)) as srv:
            t0 = time.time()
            out = capture_from_sglang(
                [srv.url],
                prep,
                "train",
                root / f"store{procs}",
                LAYERS,
                target=tiny,
                calibrate=3,
                device=a.device,
                procs=procs,
                concurrency=4,
            )
            print(
                json.dumps(
                    {
                        "procs": procs,
                        "wall_s": round(time.time() - t0, 2),
                        "captured": out["captured"],
                        "complete": out["store_complete"],
                        "engine_numerics_n": out["engine_numerics"].get("n_samples"),
                        "beside": out["beside_loop_seconds"],
                        "phases": out["phase_seconds"],
                    }
                ),
                flush=True,
            )


def spawn(a) -> None:
    t0 = time.time()
    from eyas.sglang.apart import Apart

    child = Apart()
    t1 = time.time()
    target = str(Path(a.root) / "tiny")
    child.call("tokenizer_hash", target=target).result()
    t2 = time.time()
    child.call("tokenizer_hash", target=target).result()
    t3 = time.time()
    out = {"spawn_s": round(t1 - t0, 3), "first_hash_s": round(t2 - t1, 3), "second_hash_s": round(t3 - t2, 3)}
    print(json.dumps(out))
    child.close()


def main() -> None:
    sys.path.insert(0, "src")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("capture")
    c.add_argument("tokenizer")
    c.add_argument("--device", default="cuda")
    c.add_argument("--root", default="/root/gpucheck")
    s = sub.add_parser("spawn")
    s.add_argument("--root", default="/root/gpucheck")
    a = ap.parse_args()
    {"capture": capture, "spawn": spawn}[a.mode](a)


if __name__ == "__main__":
    main()
