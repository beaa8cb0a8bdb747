"""Write a random-weight copy of a model directory (same config and tokenizer, new weights).

Throughput benchmarks need a model's shapes, not its weights: this lets the GPU benchmarks run on a
SmolLM2-shaped target from its config and tokenizer alone (a few MB) when the real weights are not
on the machine.

    python benchmarks/make_random_target.py SKELETON_DIR OUT_DIR [--dtype bf16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("skeleton", type=Path, help="directory with config.json and tokenizer files")
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.skeleton)
    model = AutoModelForCausalLM.from_config(config)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for f in args.skeleton.iterdir():
        if f.is_file() and (
            f.name.startswith("tokenizer")
            or f.name in ("special_tokens_map.json", "chat_template.jinja", "generation_config.json")
        ):
            shutil.copy(f, args.out / f.name)
    print(args.out)


if __name__ == "__main__":
    main()
