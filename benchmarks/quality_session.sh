#!/usr/bin/env bash
# The GPU work of one session on a 2- or 4-GPU H200 machine (`nvidia-h200-x2` / `-x4`): three calls of
# under 10 minutes while the machine stays warm. The quality trainings run detached (setsid) from call 2
# into call 3, one per GPU, so each gets ~15 minutes although no call may last more than 10.
# Staged files (not in git), as for benchmarks/h200x2_session.sh:
#   .stage/a2: smol.gguf.aa (first half of the SmolLM2 GGUF: `split -n 2`), gguf and specforge wheels,
#              question.jsonl (MT-bench), chats_all.jsonl.xz (17,293 ShareGPT chats)
#   .stage/b:  smol.gguf.ab        .stage/r: regen.tgz (the regeneration of all 17,293 records, 17,282 chats)
# Usage: bash benchmarks/quality_session.sh 1|2|3, each call issued within 30 s of the last one's end
#   1 (carry .stage/a2): staging (1/2); training speed: 8B shape vs SpecForge (GPU 0); the CE kernel,
#     then profiles of the SmolLM2 and 8B drafter steps (GPU 1)
#   2 (carry .stage/b and .stage/r): staging (2/2); starts the quality trainings (detached), STEPS steps each:
#     2 GPUs: the recipe on all 17,293 regenerated records (GPU 0) | the same with a 4x wider draft MLP (GPU 1)
#     4 GPUs: the scaling study's 2,000 / 6,000 / 17,293 records (GPUs 0-2) | the wide MLP on 17,293 (GPU 3)
#   3: waits for them (up to WAIT_S), then speculative decoding with the best drafter (GPU 0) and the
#     SmolLM2 training rate on the real target with and without the state cache (GPU 1)
# What a call writes comes back as $OUT/logs.tgz.
set -uo pipefail
part=$1
OUT=${OUT:-/root/out}
L=$OUT/logs
mkdir -p "$L" /root/stage /root/q
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:/root/site
NG=$(nvidia-smi -L | wc -l)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NG ))}  # one job per GPU side by side: its share of the cores
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=/root/stage
T0=$(date +%s)
on() { local gpu=$1; shift; CUDA_VISIBLE_DEVICES=$gpu "$@"; }
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/session.log"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"; }
trap pack EXIT
collect() {  # what the quality runs wrote, into $L (the machine may go back before the next call)
    cp /root/q/*.log "$L/" 2>/dev/null
    for r in /root/scaling /root/ablate; do
        for w in $r/n*-s*; do
            [ -d "$w" ] || continue
            n=$(basename $r)-$(basename $w)
            cp $w/train/metrics.jsonl "$L/$n.metrics.jsonl" 2>/dev/null
            cp $w/pipeline.log "$L/$n.pipeline.log" 2>/dev/null
            cp $w/eval/*.json "$L/" 2>/dev/null
        done
        cp $r/points.jsonl "$L/$(basename $r).points.jsonl" 2>/dev/null
        cp $r/scaling.md "$L/$(basename $r).md" 2>/dev/null; cp $r/scaling.png "$L/$(basename $r).png" 2>/dev/null
    done
}
rate_bench() {  # the training rate on 500 chats (about 2 batches an epoch): the target on every batch vs the state cache
    on $1 timeout 40 python -m eyas prepare --source $S/chats6k.jsonl --target /root/smol --out /root/prep500 \
        --limit 500 --overwrite > "$L/prep500.log" 2>&1
    for c in off on; do
        on $1 timeout 95 python benchmarks/train_bench.py --suite smol --target /root/smol --data /root/prep500 \
            --budgets 131072 --steps 30 --skip 10 --cache $c --work /root/tb-$c > "$L/train_smol_cache_$c.log" 2>&1
    done
}
need() { for f in "$@"; do [ -e "$f" ] || { note "fresh machine: $f is missing (staging lost)"; exit 1; }; done; }

ALL=17293
STEPS=${STEPS:-1600}
SCALE="--recipe recipes/smollm2-gpu.toml --steps $STEPS --set target=/root/smol --set regenerate.source=$S/chats_all.jsonl
       --set eval.prompts=$S/question.jsonl --max-minutes 28"

case "$part" in
0)  # staging (1/2) alone
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    ;;
1)
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    nvidia-smi -L | tee -a "$L/session.log"
    on 0 timeout 300 python benchmarks/train_bench.py --no-compile > "$L/train_8b.log" 2>&1 &
    ( on 1 timeout 80 python benchmarks/ce_kernel_bench.py > "$L/ce_kernel.log" 2>&1
      on 1 timeout 120 python benchmarks/train_bench.py --small --device cuda --seq 2048 --batch 32 --profile 40 \
          > "$L/profile_smol.log" 2>&1
      on 1 timeout 100 python benchmarks/train_bench.py --profile 40 --no-specforge > "$L/profile_8b.log" 2>&1 ) &
    wait
    note "speed jobs done"
    for f in ce_kernel train_8b profile_8b profile_smol; do echo "== $f"; grep -v warmup "$L/$f.log" | tail -12 | cut -c1-300; done
    ;;
2)
    need $S/smol.gguf.aa $S/chats_all.jsonl $S/question.jsonl
    cp .stage/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/smol.gguf && md5sum $S/smol.gguf
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('/root/smol'))" 2>&1 | tail -1
    mkdir -p /root/scaling /root/ablate && tar xzf .stage/r/regen.tgz -C /root/scaling && ln -sfn /root/scaling/regen /root/ablate/regen
    note "staged"
    # detached: they outlive this call (a new process session) and run on into call 3
    if [ "$NG" -ge 4 ]; then points=2000,6000,$ALL; gpus=0,1,2; wide=3; else points=$ALL; gpus=0; wide=1; fi
    if [ "${WIDE_ONLY:-0}" = 1 ]; then  # the wide MLP alone (GPU 1); the training rate bench on GPU 0
        rate_bench 0 &
    else
    setsid nohup python benchmarks/scaling_study.py $SCALE --root /root/scaling --conversations $points \
        --gpus $gpus > /root/q/scaling.log 2>&1 < /dev/null &
    fi
    CUDA_VISIBLE_DEVICES=$wide setsid nohup python benchmarks/scaling_study.py $SCALE --root /root/ablate \
        --conversations $ALL --set train.draft_intermediate_size=6144 > /root/q/ablate.log 2>&1 < /dev/null &
    note "points started"
    while [ $(( $(date +%s) - T0 )) -lt ${CALL_S:-555} ]; do sleep 15; done
    collect
    for f in train_smol_cache_off train_smol_cache_on; do echo "== $f"; tail -4 "$L/$f.log" 2>/dev/null | cut -c1-300; done
    for f in scaling ablate; do echo "== $f"; grep -v "Loading weights" /root/q/$f.log | grep -E "state cache|eval |step [0-9]+0/|Error|error" | tail -8 | cut -c1-300; done
    ;;
3)
    need /root/smol /root/scaling/regen/chats.jsonl
    while pgrep -f scaling_study.py > /dev/null && [ $(( $(date +%s) - T0 )) -lt ${WAIT_S:-370} ]; do sleep 10; done
    note "points: $(pgrep -fc scaling_study.py) study processes still running"
    cat /root/scaling/points.jsonl /root/ablate/points.jsonl 2>/dev/null | tee "$L/points.jsonl"
    best=$(python - <<'EOF'
import json, os
files = [f for f in ("/root/scaling/points.jsonl", "/root/ablate/points.jsonl") if os.path.exists(f)]
pts = [p for f in files for p in map(json.loads, filter(str.strip, open(f))) if p.get("tau_tree")]
print(max(pts, key=lambda p: p["tau_tree"])["workdir"] + "/train/drafter" if pts else "")
EOF
)
    note "best drafter: ${best:-none}"
    if [ -n "$best" ]; then
        on 0 timeout 170 python benchmarks/specdec_bench.py --drafter "$best" --target /root/smol --limit 20 --predict \
            --prompts $S/question.jsonl > "$L/specdec.log" 2>&1 &
    fi
    [ "${WIDE_ONLY:-0}" = 1 ] || rate_bench 1 &
    [ "$NG" -ge 4 ] && on 2 timeout 150 python benchmarks/verify_invariants_bench.py --target /root/smol --device cuda \
        --model-dtype bf16 --samples 400 --max-length 1024 --work /root/vib --source $S/chats6k.jsonl --compare-tail-paths \
        --profile > "$L/verify_cost.log" 2>&1 &
    wait
    note "speculative decoding and training rates done"
    collect
    for f in specdec train_smol_cache_off train_smol_cache_on verify_cost; do echo "== $f"; tail -12 "$L/$f.log" 2>/dev/null | cut -c1-400; done
    ;;
esac
note "call $part finished"
