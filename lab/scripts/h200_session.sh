#!/usr/bin/env bash
# The GPU benchmarks of one H200 session, as calls of under 10 minutes each while the machine stays
# warm (how the figures in lab/archive/RESULTS.md of 2026-11-30 were taken). Run from the repository
# root with the staged files under .stage/ (not in git):
#   .stage/a: smol.gguf.aa (first half of the SmolLM2 GGUF: `split -n 2`), gguf and specforge wheels,
#             chats6k.jsonl.gz (lab/scripts/stage_chats.py --n 6000), question.jsonl (MT-bench)
#   .stage/b: smol.gguf.ab          .stage/c: chats_all.jsonl.gz (stage_chats.py --n 20000)
# Usage: bash lab/scripts/h200_session.sh a|b|c|d     (logs and JSON under $OUT)
set -uo pipefail
part=$1
OUT=${OUT:-/root/out}
mkdir -p "$OUT" /root/stage
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:/root/site
S=/root/stage
case "$part" in
a)  # staging (1/2) + drafter training, 8B shape, with SpecForge in the same process
    cp .stage/a/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python benchmarks/train_bench.py --no-compile 2>&1 | tee $OUT/train_8b.log | grep -v warmup | tail -12
    ;;
b)  # staging (2/2): SmolLM2 from its GGUF, prepared chats; regeneration with default options; training
    cp .stage/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum $S/*.gguf
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/SmolLM2-135M-Instruct.Q4_1.gguf'), Path('/root/smol'))" 2>&1 | tail -1
    gunzip -c $S/chats6k.jsonl.gz > $S/chats6k.jsonl
    python -m eyas prepare --source $S/chats6k.jsonl --target /root/smol --out /root/prep_orig --overwrite 2>&1 | tail -1 | cut -c1-300
    python benchmarks/regen_bench.py --target /root/smol --chats $S/chats6k.jsonl.gz --parts 2turn --keep /root/regen6k 2>&1 \
        | tee $OUT/regen.log | grep -v "^regen [0-9]" | tail -4 | cut -c1-1500
    python -m eyas prepare --source /root/regen6k --target /root/smol --out /root/prep_regen --overwrite 2>&1 | tail -1 | cut -c1-300
    ;;
c)  # drafter training on the real target, online (`eyas train` itself): original and regenerated answers
    python benchmarks/train_bench.py --suite smol --target /root/smol --data /root/prep_orig \
        --budgets ${BUDGETS:-131072,32768,4096} --work /root/tb 2>&1 | tee $OUT/train_smol_orig.log | grep -v "^step\|^eval\|Loading" | tail -8
    python benchmarks/train_bench.py --suite smol --target /root/smol --data /root/prep_regen \
        --budgets 131072 --work /root/tb2 2>&1 | tee $OUT/train_smol_regen.log | grep -v "^step\|^eval\|Loading" | tail -4
    ;;
d)  # quality: the GPU recipe end to end (resumable: repeat the call until the summary line appears)
    cp .stage/c/* $S/ 2>/dev/null; gunzip -c $S/chats_all.jsonl.gz > $S/chats_all.jsonl; shift
    timeout -s TERM ${LIMIT:-540} python -m eyas pipeline recipes/smollm2-gpu.toml --workdir /root/recipe \
        --set target=/root/smol --set regenerate.source=$S/chats_all.jsonl "$@" 2>&1 | tee $OUT/recipe.log | grep -v "^step\|Loading" | tail -40
    ;;
esac
