#!/usr/bin/env bash
# The GPU benchmarks of one session on a 2-GPU H200 machine (`nvidia-h200-x2`), as four calls of under
# 10 minutes each while the machine stays warm: independent jobs run side by side, one per GPU, and
# the two-GPU jobs run when both are free. Run from the repository root with the staged files (not in
# git) under .stage/:
#   .stage/a2: smol.gguf.aa (first half of the SmolLM2 GGUF: `split -n 2`), gguf and specforge wheels,
#              question.jsonl (MT-bench), chats_all.jsonl.xz (lab/scripts/stage_chats.py --n 20000: 17,293
#              chats, xz -9 so that the half of the GGUF and the chats fit one call's 64 MiB)
#   .stage/b:  smol.gguf.ab
#   .stage/r:  regen.tgz, the regeneration of all staged chats that call 2 brings back ($OUT/regen.tgz.*)
# Usage: bash lab/scripts/h200x2_session.sh 1|2|3|4, each call within 30 s of the last one's end
#   (call 1 carries .stage/a2, call 2 .stage/b and, when it exists, .stage/r: then nothing is regenerated).
#   With a regeneration already brought back: 0 (carry .stage/a2), then 3b (carry .stage/b and .stage/r)
#   runs the quality points at once; 4 then adds the smaller points and speculative decoding.
# Everything a call writes goes under $OUT/logs and comes back as one logs.tgz (plus the regenerated
# chats, split in 15 MB parts, from call 2): every job has its own time limit, so the packing runs.
set -uo pipefail
part=$1
OUT=${OUT:-/root/out}
L=$OUT/logs
mkdir -p "$L" /root/stage
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:/root/site
# jobs run two at a time: each gets half the cores (two full OpenMP pools made a training step 2.7x slower)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 2 ))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=/root/stage
T0=$(date +%s)
on() { local gpu=$1; shift; CUDA_VISIBLE_DEVICES=$gpu "$@"; }  # run on one GPU
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/session.log"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"; }
trap pack EXIT
# A machine idle for more than 30 s between calls is given back, and the next call gets a fresh one:
# say so at once instead of running jobs on missing files (then: part 0, then part 3b).
need() { for f in "$@"; do [ -e "$f" ] || { note "fresh machine: $f is missing; run part 0 then 3b"; exit 1; }; done; }

# the device has no package index: ShareGPT (17,293 whole chats) and MT-bench come as staged files
ALL=17293
SCALE="--recipe recipes/smollm2-gpu.toml --steps ${STEPS:-400} --set target=/root/smol --set regenerate.source=$S/chats_all.jsonl
       --set eval.prompts=$S/question.jsonl"

case "$part" in
1)  # staging (1/2); training speed, 8B shape (eyas + SpecForge, GPU 0) | SmolLM2-shape profile (GPU 1); then 8B on 2 GPUs
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    nvidia-smi -L | tee -a "$L/session.log"
    ( on 0 timeout 60 python benchmarks/ce_kernel_bench.py > "$L/ce_kernel.log" 2>&1
      note "ce kernel bench done"
      on 0 timeout 280 python benchmarks/train_bench.py --no-compile > "$L/train_8b.log" 2>&1
      note "8b train bench done" ) &
    on 1 timeout 200 python benchmarks/train_bench.py --small --device cuda --seq 2048 --batch 32 --profile 40 \
        > "$L/profile_smol.log" 2>&1
    note "smol profile done"
    wait
    timeout 200 python lab/scripts/two_gpu_bench.py --parts 8b --budget-s 190 --work /root/tg > "$L/two_gpu_8b.log" 2>&1
    note "2-GPU 8b done"
    for f in ce_kernel train_8b profile_smol two_gpu_8b; do echo "== $f"; grep -v warmup "$L/$f.log" | tail -14; done
    ;;
2)  # staging (2/2): SmolLM2 from its GGUF; regenerate all ShareGPT (GPU 1) | training speed on the real target + verify cost (GPU 0)
    need $S/smol.gguf.aa $S/chats_all.jsonl
    need $S/smol.gguf.aa $S/question.jsonl
    cp .stage/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/smol.gguf && md5sum $S/smol.gguf
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('/root/smol'))" 2>&1 | tail -1
    note "staged"
    if [ -f .stage/r/regen.tgz ]; then  # brought back by an earlier session: no regeneration
        mkdir -p /root/scaling && tar xzf .stage/r/regen.tgz -C /root/scaling && note "regeneration restaged"
    else
    ( on 1 timeout 420 python lab/scripts/scaling_study.py $SCALE --root /root/scaling --conversations $ALL --regen-only \
        > "$L/regen.log" 2>&1
      note "regeneration done" ) &
    fi
    on 0 timeout 90 python -m eyas prepare --source $S/chats6k.jsonl --target /root/smol --out /root/prep_orig --overwrite \
        > "$L/prep_orig.log" 2>&1
    on 0 timeout 330 python benchmarks/train_bench.py --suite smol --target /root/smol --data /root/prep_orig \
        --budgets 131072,32768,4096 --work /root/tb > "$L/train_smol.log" 2>&1
    note "smol train bench done"
    on 0 timeout 120 python benchmarks/verify_invariants_bench.py --target /root/smol --device cuda --model-dtype bf16 \
        --samples 400 --max-length 1024 --work /root/vib --source $S/chats6k.jsonl --numbers-too > "$L/verify_cost.log" 2>&1
    note "verify cost done"
    wait
    [ -f .stage/r/regen.tgz ] || { [ -d /root/scaling/regen ] && tar czf - -C /root/scaling regen | split -b 15M - "$OUT/regen.tgz."; }
    left=$(( 560 - ($(date +%s) - T0) ))
    if [ "$left" -gt 150 ]; then
        timeout $left python lab/scripts/two_gpu_bench.py --parts smol,loss,ckpt --budget-s $(( left - 15 )) \
            --target /root/smol --data /root/prep_orig --work /root/tg > "$L/two_gpu_smol.log" 2>&1
        cp /root/tg/loss_curves.* "$L/" 2>/dev/null
        note "2-GPU smol done"
    fi
    for f in regen train_smol verify_cost two_gpu_smol; do echo "== $f"; tail -12 "$L/$f.log" 2>/dev/null | cut -c1-400; done
    ;;
0)  # after a fresh start: staging (1/2) only
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    ;;
3b) # after a fresh start: staging (2/2) with the regeneration call 2 brought back (.stage/r/regen.tgz), then call 3
    need $S/smol.gguf.aa $S/question.jsonl
    cp .stage/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/smol.gguf && md5sum $S/smol.gguf
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('/root/smol'))" 2>&1 | tail -1
    mkdir -p /root/scaling && tar xzf .stage/r/regen.tgz -C /root/scaling && note "staged"
    exec bash "$0" 3
    ;;
3)  # quality: all ShareGPT, the recipe's drafter (GPU 1) | the same with a 4x wider draft MLP (GPU 0), same data and steps
    need /root/smol $S/question.jsonl $S/chats_all.jsonl /root/scaling/regen/chats.jsonl
    mkdir -p /root/ablate && ln -sfn /root/scaling/regen /root/ablate/regen
    ( on 1 python lab/scripts/scaling_study.py $SCALE --root /root/scaling --conversations $ALL --max-minutes ${MINUTES:-9} \
        > "$L/point_all.log" 2>&1; note "point 17671 stopped" ) &
    on 0 python lab/scripts/scaling_study.py $SCALE --root /root/ablate --conversations $ALL --max-minutes ${MINUTES:-9} \
        --set train.draft_intermediate_size=6144 > "$L/point_all_wide.log" 2>&1
    note "wide point stopped"
    wait
    for f in point_all point_all_wide; do echo "== $f"; tail -8 "$L/$f.log" | cut -c1-600; done
    cp /root/scaling/scaling.md "$L/" 2>/dev/null; cp /root/ablate/scaling.md "$L/ablate.md" 2>/dev/null
    ;;
4)  # quality: the smaller points of the scaling study on both GPUs; then speculative decoding with the best drafter
    need /root/smol $S/question.jsonl $S/chats_all.jsonl /root/scaling/regen/chats.jsonl
    python lab/scripts/scaling_study.py $SCALE --root /root/scaling --conversations 2000,6000,$ALL --gpus 0,1 \
        --max-minutes ${MINUTES:-7} > "$L/scaling.log" 2>&1
    note "scaling study stopped"
    cp /root/scaling/scaling.md /root/scaling/scaling.png /root/scaling/points.jsonl "$L/" 2>/dev/null
    D=${DRAFTER:-/root/scaling/n$ALL-s${STEPS:-400}/train/drafter}
    on 0 timeout 150 python benchmarks/specdec_bench.py --drafter $D --target /root/smol --limit 20 --predict --prompts $S/question.jsonl \
        > "$L/specdec.log" 2>&1
    note "specdec done"
    for f in scaling specdec; do echo "== $f"; tail -14 "$L/$f.log" | cut -c1-600; done
    ;;
esac
note "call $part finished"
