#!/usr/bin/env bash
# The GPU work of one session on a 2- or 4-GPU H200 machine (`nvidia-h200-x2` / `-x4`): three calls of
# under 10 minutes while the machine stays warm. The quality trainings run detached (setsid) from call 2
# into call 3, one per GPU, so each gets ~15 minutes although no call may last more than 10.
# Staged files (not in git), as for benchmarks/h200x2_session.sh:
#   .stage/a2: smol.gguf.aa (first half of the SmolLM2 GGUF: `split -n 2`), wheels (gguf, specforge, pydantic),
#              question.jsonl (MT-bench), chats_all.jsonl.xz (17,293 ShareGPT chats)
#   .stage/b:  smol.gguf.ab        .stage/r: regen.tgz (the regeneration of all 17,293 records, 17,282 chats)
# Build them with `bash benchmarks/stage.sh` (no .stage/r: call 2 then regenerates, ~2 minutes on GPU 0).
# Usage: bash benchmarks/quality_session.sh 1|2|3, each call issued within 30 s of the last one's end.
# On one GPU (`nvidia-h200`): call 1 stages and measures the 8B rate against SpecForge; call 2 starts one detached chain
# (the recipe, then speculative decoding with its drafter, then the side by side); call 3 is repeated, each
# collecting what the chain wrote, until it has ended.
#   1 (carry .stage/a2): staging (1/2); training speed: the 8B shape on 1 and 2 GPUs (DDP, fp32 and bf16
#     all-reduce), then 8B vs SpecForge (GPU 0) beside the 8B profile (GPU 1)
#   2 (carry .stage/b, and .stage/r when it exists): staging (2/2); starts, detached, STEPS steps:
#     2 GPUs: the recipe on all 17,293 records (GPU 0) | eyas vs SpecForge side by side on the same
#     regenerated data (GPU 1, once the recipe's prepared data exists)
#     4 GPUs: the scaling study's 2,000 / 6,000 / 17,293 records (GPUs 0-2) | the side by side (GPU 3)
#   3: waits for them (up to WAIT_S), then speculative decoding with the recipe's drafter at batch 1, 4
#     and 16 (GPU 0) and the SmolLM2 training rate with and without the state cache (GPU 1); brings the
#     regeneration back as $OUT/regen.tgz (keep it as .stage/r/regen.tgz for the next session)
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
    for e in /root/sbs/eval-*; do [ -f $e/report.json ] && cp $e/report.json "$L/sbs-$(basename $e).json"; done
    for r in /root/scaling; do
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

prep=/root/scaling/n$ALL-s$STEPS/prepared
sbs_cmd="python benchmarks/specforge_side_by_side.py --prepared $prep --target /root/smol --root /root/sbs \
    --eval-prompts $S/question.jsonl"
spec_cmd="python benchmarks/specdec_bench.py --drafter /root/scaling/n$ALL-s$STEPS/train/drafter --target /root/smol \
    --limit 10 --engine static --predict --batch-sizes 1,4,16 --prompts $S/question.jsonl"

case "$part" in
0)  # staging (1/2) alone
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    ;;
1)
    nvidia-smi -L | tee -a "$L/session.log"
    cp .stage/a2/* $S/ && python -m pip install -q --no-index --no-deps --target /root/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    note "staged (1/2)"
    if [ "$NG" -eq 1 ]; then  # one GPU: the 8B rate (default options, cast_once) against SpecForge in one process
        timeout 300 python benchmarks/train_bench.py --no-compile --no-reference > "$L/train_8b.log" 2>&1
        echo "== train_8b"; grep -v warmup "$L/train_8b.log" | tail -8 | cut -c1-300; note "call 1 finished"; exit 0
    fi
    if [ "$NG" -ge 2 ]; then
        OMP_NUM_THREADS=$(( $(nproc) / 2 )) timeout 330 python benchmarks/two_gpu_bench.py --parts 8b --bf16-reduce \
            --work /root/tgb --budget-s 320 > "$L/two_gpu_8b.log" 2>&1
        note "two-GPU 8B scaling done"
    fi
    on 0 timeout 220 python benchmarks/train_bench.py --no-compile > "$L/train_8b.log" 2>&1 &
    [ "$NG" -ge 2 ] && on 1 timeout 150 python benchmarks/train_bench.py --profile 60 --no-specforge > "$L/profile_8b.log" 2>&1 &
    wait
    note "speed jobs done"
    grep -v "^  \[" "$L/two_gpu_8b.log" 2>/dev/null | tail -8 | cut -c1-300
    for f in train_8b profile_8b; do echo "== $f"; grep -v warmup "$L/$f.log" | tail -14 | cut -c1-300; done
    ;;
2)
    need $S/smol.gguf.aa $S/chats_all.jsonl $S/question.jsonl
    cp .stage/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/smol.gguf && md5sum $S/smol.gguf
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('/root/smol'))" 2>&1 | tail -1
    mkdir -p /root/scaling
    [ -f .stage/r/regen.tgz ] && tar xzf .stage/r/regen.tgz -C /root/scaling && note "regeneration restaged"
    note "staged"
    # detached: they outlive this call (a new process session) and run on into call 3
    if [ "$NG" -ge 4 ]; then points=2000,6000,$ALL; gpus=0,1,2; sbs=3; else points=$ALL; gpus=0; sbs=$(( NG - 1 )); fi
    if [ "$NG" -eq 1 ]; then
        # one GPU: one job at a time (sharing it, the recipe ran 2.7x slower on 2026-12-01), in one detached chain:
        # the recipe, speculative decoding with its drafter on the idle GPU, then the side by side
        setsid nohup bash -c "python benchmarks/scaling_study.py $SCALE --root /root/scaling --conversations $ALL \
            --gpus 0 > /root/q/scaling.log 2>&1; $spec_cmd > /root/q/specdec.log 2>&1; $sbs_cmd > /root/q/sbs.log 2>&1" \
            < /dev/null > /dev/null 2>&1 &
    else
        setsid nohup python benchmarks/scaling_study.py $SCALE --root /root/scaling --conversations $points \
            --gpus $gpus > /root/q/scaling.log 2>&1 < /dev/null &
        # the side by side trains on the recipe's own prepared (regenerated) data: it waits for it
        CUDA_VISIBLE_DEVICES=$sbs setsid nohup bash -c "while [ ! -f $prep/meta.json ]; do sleep 10; done; $sbs_cmd" \
            > /root/q/sbs.log 2>&1 < /dev/null &
    fi
    note "recipe and side by side started"
    while [ $(( $(date +%s) - T0 )) -lt ${CALL_S:-555} ]; do sleep 15; done
    collect
    for f in scaling sbs; do echo "== $f"; grep -v "Loading weights" /root/q/$f.log | grep -E "state cache|eval |step [0-9]+0/|== side|Error|error" | tail -8 | cut -c1-300; done
    ;;
3)
    need /root/smol /root/scaling/regen/chats.jsonl
    while pgrep -f "scaling_study.py|specforge_side_by_side.py" > /dev/null && [ $(( $(date +%s) - T0 )) -lt ${WAIT_S:-240} ]; do sleep 10; done
    running=$(pgrep -fc 'scaling_study.py|specforge_side_by_side.py')
    note "still running: $running study processes"
    if [ "$NG" -eq 1 ]; then  # one GPU: the chain of call 2 runs speculative decoding itself; this call collects
        collect; tar czf "$OUT/regen.tgz" -C /root/scaling regen 2>/dev/null
        for f in scaling specdec sbs; do echo "== $f"; grep -v "Loading weights" /root/q/$f.log 2>/dev/null | tail -6 | cut -c1-300; done
        [ "$running" -gt 0 ] && note "call 3 again: the chain still runs"; exit 0
    fi
    cat /root/scaling/points.jsonl 2>/dev/null | tee "$L/points.jsonl"
    tar czf "$OUT/regen.tgz" -C /root/scaling regen 2>/dev/null
    best=$(ls -d /root/scaling/n$ALL-s$STEPS/train/drafter 2>/dev/null)
    note "drafter: ${best:-none}"
    if [ -n "$best" ] && [ -f "$best/config.json" ]; then
        on 0 timeout 290 $spec_cmd > "$L/specdec.log" 2>&1 &
    fi
    [ "$NG" -ge 2 ] && rate_bench 1 &
    wait
    note "speculative decoding and training rates done"
    collect
    for f in specdec train_smol_cache_off train_smol_cache_on; do echo "== $f"; tail -12 "$L/$f.log" 2>/dev/null | cut -c1-400; done
    tail -3 /root/q/sbs.log | cut -c1-600
    ;;
esac
note "call $part finished"
