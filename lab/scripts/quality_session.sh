#!/usr/bin/env bash
# The GPU work of one session on H200s, as calls of under 10 minutes issued back to back while the machine
# stays warm (each within 30 s of the last one's end). Long jobs run detached (setsid) as one chain per GPU,
# from a copy of the repository (/root/run: later calls replace the working tree), and outlive their call.
# Staged files (not in git; `bash lab/scripts/stage.sh` builds them):
#   .stage/a2: smol.gguf.aa (first half of the SmolLM2 GGUF: `split -n 2`), wheels (gguf, specforge, pydantic,
#              datasets, ...), question.jsonl (MT-bench), chats_all.jsonl.xz (17,293 ShareGPT chats)
#   .stage/b:  smol.gguf.ab        .stage/r: regen.tgz (the regeneration of all 17,293 records, optional)
# Usage: bash lab/scripts/quality_session.sh 1|2|3 (3 repeated until it reports that the chains ended).
# Two or more GPUs (`nvidia-h200-x2`, `-x4`):
#   1 (carry .stage/a2): staging (1/2); starts the last GPU's chain: the 8B training rate (default options and
#     the other TTTConfig.cast_once setting) against SpecForge in one process; once the target exists, the SmolLM2
#     training rate (500 chats, the target on every batch vs the state cache; weights cast once); once the
#     recipe's prepared data exists, eyas vs SpecForge side by side on it; profiles of the 8B and SmolLM2 steps
#   2 (carry .stage/b, and .stage/r when it exists): staging (2/2); starts GPU 0's chain: the recipe on all
#     17,293 records with STEPS steps (4 GPUs: the scaling study's 2,000 / 6,000 / 17,293 records on GPUs 0-2),
#     then speculative decoding with its drafter at batch 1, 4 and 16; collects until CALL_S
#   3: collects until the chains end or WAIT_S; brings the regeneration back as $OUT/regen.tgz
# One GPU (`nvidia-h200`): call 1 stages and runs the SmolLM2-shaped training step on synthetic states (every
# variant, a few minutes); call 2 starts one chain (the recipe, speculative decoding, the side by side, the SmolLM2 rate
# with the state cache, the 8B rate against SpecForge, the profiles); 3 collects. JOBS="..." picks the chain's jobs
# (functions below, in order), e.g. JOBS="prepare_only side_by_side train_8b profiles" when the recipe's figures
# exist and the regeneration is restaged. Two GPUs: JOBS is GPU 0's chain, SIDE_JOBS the last GPU's, e.g.
# JOBS=points SIDE_JOBS="train_8b wait_target prepare_only side_by_side profiles". One GPU with SIDE_JOBS set:
# call 1 starts that chain instead of the check (jobs needing no target run while call 2 stages it), and call 2
# with JOBS=none only stages: SIDE_JOBS="train_8b wait_target prepare_only side_by_side profiles", then JOBS=none.
# side_by_side_lr repeats the side by side with lr 3e-4 for both trainers, on the first one's captured store (and
# its lr3e-4 variant's drafter when sbs_ablations ran it); sbs_ablations runs the side by side with eyas method
# variants (SBS_VARIANTS, default three: the head from the target's, lr 3e-4, TTT decay 1.0), sbs_ablations_lr the
# same at lr 3e-4 for both trainers (default variants: align_topk off, the default again, and the default with
# ttt.PRUNE_UNREACHED); sbs_at_lr runs it with both trainers at SBS_LR (default 1e-3) and eyas variants
# SBS_LR_VARIANTS (default lr 2e-3 for eyas alone, and Muon); smol_next runs the SmolLM2 rate with the module
# settings of SMOL_FLAGS (train_bench.py --flag) against the default, the target on every batch and the state cache;
# profile_smol_online profiles two steps of the run with the target on every batch; gpu_tests runs the tests that
# need a GPU (pytest is in the image).
# What a call writes comes back as $OUT/logs.tgz.
set -uo pipefail
part=$1
ROOT=${SESSION_ROOT:-/root}    # where the session works; tests/test_quality_session.py sets another, with stubs
STAGE=${STAGE_DIR:-.stage}      # the staged files carried with the call
POLL_S=${POLL_S:-10}            # how often waits look again
OUT=${OUT:-$ROOT/out}
L=$OUT/logs
mkdir -p "$L" $ROOT/stage $ROOT/q
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$ROOT/site
NG=$(nvidia-smi -L | wc -l)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NG ))}  # one job per GPU side by side: its share of the cores
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$ROOT/stage
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L/session.log"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"; }
trap pack EXIT
collect() {  # what the chains wrote, into $L (the machine may go back before the next call)
    cp $ROOT/q/*.log $ROOT/q/*.json "$L/" 2>/dev/null
    for e in $ROOT/sbs*/eval-*; do [ -f $e/report.json ] && cp $e/report.json "$L/$(basename $(dirname $e))-$(basename $e).json"; done
    for r in $ROOT/scaling; do
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
summary() {  # the last lines of each chain's logs
    for f in $ROOT/q/*.log; do
        [ -f "$f" ] || continue
        echo "== $(basename $f)"; grep -v "Loading weights\|warmup\|^  \[" "$f" | tail -${1:-4} | cut -c1-300
    done
}
newest() {  # the chains' newest log and how long ago it was written: a job that hangs shows here, not in its tail
    local f; f=$(ls -t $ROOT/q/*.log 2>/dev/null | head -1); [ -n "$f" ] || return 0
    local age=$(( $(date +%s) - $(stat -c %Y "$f") ))
    note "newest log $(basename $f), written ${age}s ago$([ $age -gt 240 ] && echo ': a job may hang')"
}
need() { for f in "$@"; do [ -e "$f" ] || { note "fresh machine: $f is missing (staging lost)"; exit 1; }; done; }
stage1() {
    cp $STAGE/a2/* $S/ && python -m pip install -q --no-index --no-deps --target $ROOT/site $S/*.whl
    python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$S/chats_all.jsonl.xz'), open('$S/chats_all.jsonl', 'wb'))"
    head -n 6000 $S/chats_all.jsonl > $S/chats6k.jsonl
    note "staged (1/2)"
}
snapshot() { rm -rf $ROOT/run && mkdir -p $ROOT/run && cp -r src benchmarks lab recipes tests pyproject.toml $ROOT/run/; }

ALL=17293
STEPS=${STEPS:-2400}  # the recipe points' step budget (the scaling study at 1,600 steps: STEPS=1600 with the points job,
# whose 17,293-record points at 1,600 and 2,400 steps come from lab/scripts/scaling_points.jsonl)
R=$ROOT/run  # the chains run from this copy: PYTHONPATH and the scripts
SCALE="--recipe recipes/smollm2-gpu.toml --steps $STEPS --set target=$ROOT/smol --set regenerate.source=$S/chats_all.jsonl
       --set eval.prompts=$S/question.jsonl --max-minutes 28"
prep=$ROOT/scaling/n$ALL-s$STEPS/prepared
# the chains' jobs, each writing $ROOT/q/<name>.log; exported: the chains call them through `bash -c`
waitfor() { while [ ! -e "$1" ]; do sleep $POLL_S; done; }
train_8b() {  # BENCH_VARIANTS (comma-separated train_bench.py labels): only those, else every variant; 10 rounds
    # (5 left a 10% spread of single rounds around medians 2% apart, 2026-12-01)
    timeout -k 30 600 python benchmarks/train_bench.py --no-compile --no-reference --rounds 10 \
        ${BENCH_VARIANTS:+--variants $BENCH_VARIANTS} > $ROOT/q/train_8b.log 2>&1
}
smol_rate() {  # the SmolLM2 training rate on 500 chats; runs named by the arguments (default off on once):
    # off: the target on every batch, on: the state cache, once: the state cache with the weights cast once;
    # next-off, next-on: off and on with the module settings of SMOL_FLAGS (train_bench.py --flag, e.g.
    # "ttt.GROUPED_DIAGONALS packing.COMPILED_LAYERS=0"; none: no next runs), regen-off: off on the recipe's
    # regenerated chats instead (prepare_only before it in the chain makes them), profile: op tables of two steps
    # of the run with the target on every batch (train_bench.py --profile; its rate is not a figure),
    # flag:MODULE.NAME: off with that one setting (train_bench.py --flag), e.g. flag:ttt.FUSED_TOP_RANK=0;
    # opt:NAME: off with `eyas train --optimizer NAME` (adamw or muon; the default is the drafter's width's)
    [ -f $ROOT/prep500/meta.json ] || timeout -k 30 60 python -m eyas prepare --source $S/chats6k.jsonl --target $ROOT/smol --out $ROOT/prep500 --limit 500 \
        --overwrite > $ROOT/q/prep500.log 2>&1
    local common=(--suite smol --target $ROOT/smol --budgets 131072 --steps 30 --skip 10 --work $ROOT/tb)
    local args=("${common[@]}" --data $ROOT/prep500)
    local next=() flag run
    fresh() {  # the log of a run: NAME.log, or NAME.2.log, NAME.3.log, ... when the same run came before (pairs of runs
        # in one chain, e.g. SMOL_RUNS="off flag:X flag:X off", keep every figure)
        local f=$ROOT/q/$1.log i=2; while [ -e "$f" ]; do f=$ROOT/q/$1.$i.log; i=$((i + 1)); done; echo "$f"
    }
    for flag in ${SMOL_FLAGS:-}; do next+=(--flag $flag); done
    for run in ${@:-off on once}; do
        case $run in
        off) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --cache off > $(fresh train_smol_cache_off) 2>&1 ;;
        on) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --cache on > $(fresh train_smol_cache_on) 2>&1 ;;
        once) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --cache on --cast-once on \
            > $(fresh train_smol_cast_once) 2>&1 ;;
        regen-off) if [ ! -f $prep/meta.json ]; then  # a job earlier in the chain makes them: waiting would hang it
                echo "regen-off: $prep is not there (prepare_only or a recipe job before this one makes it)" \
                    > $(fresh train_smol_regen_cache_off); continue; fi
            timeout -k 30 240 python benchmarks/train_bench.py "${common[@]}" --data $prep --cache off \
            > $(fresh train_smol_regen_cache_off) 2>&1 ;;
        profile) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --cache off --steps 14 --profile 40 \
            > $(fresh profile_smol_online) 2>&1 ;;  # op tables of steps 12 and 13 (after 10 skipped, 1 warm)
        next-off|next-on) [ ${#next[@]} -gt 0 ] && timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" "${next[@]}" --cache ${run#next-} \
            > $(fresh train_smol_next_cache_${run#next-}) 2>&1 ;;  # (a first compile of the new pieces)
        flag:*) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --flag ${run#flag:} --cache off \
            > $(fresh train_smol_${run#flag:}) 2>&1 ;;
        opt:*) timeout -k 30 240 python benchmarks/train_bench.py "${args[@]}" --optimizer ${run#opt:} --cache off \
            > $(fresh train_smol_opt_${run#opt:}) 2>&1 ;;
        esac
    done
}
profile_smol_online() { smol_rate profile; }
smol_next() { smol_rate ${SMOL_RUNS:-off on next-off next-on}; }  # the default and SMOL_FLAGS's settings, one after
# another (SMOL_RUNS: some of them, e.g. "off next-off" for the target on every batch alone)
gpu_check() {  # one GPU, call 1 (a few minutes): the SmolLM2-shaped step on synthetic states, every variant of the
    # default path and the ones to measure (train_bench.py) in one process: the GPU kernels run before the chain
    timeout -k 30 300 python benchmarks/train_bench.py --small --seq 2048 --batch 32 --no-compile --no-reference --no-specforge \
        > $ROOT/q/gpu_check.log 2>&1
}
side_by_side() {
    waitfor $prep/meta.json
    python lab/scripts/specforge_side_by_side.py --prepared $prep --target $ROOT/smol --root $ROOT/sbs \
        --eval-prompts $S/question.jsonl > $ROOT/q/sbs.log 2>&1
}
sbs_ablations() {  # the side by side (resumed: reuses what the default root holds) with eyas method variants, each
    # against the same SpecForge drafter (its default lr 1e-4); SBS_VARIANTS, default: the head from the target's,
    # lr 3e-4 (the recipe's) for eyas alone, TTT decay 1.0 instead of 0.8
    sbs_with_variants $ROOT/sbs 1e-4 sbs_ablations "inithead:init_head=true lr3e-4:lr=3e-4 decay1:ttt_decay=1.0"
}
sbs_ablations_lr() {  # the same at lr 3e-4 for both trainers (eyas's default for this drafter on 2026-12-01), in
    # side_by_side_lr's root; SBS_VARIANTS, default: the reachability mask (align_topk, 4 by default since 2026-12-01)
    # off; the default again, trained warm (its rate without the compile, and the run-to-run spread of tau); the
    # default with the unreachable positions pruned (ttt.PRUNE_UNREACHED: the same loss, its training rate)
    sbs_with_variants $ROOT/sbs-lr3e-4 3e-4 sbs_ablations_lr \
        "noalign:align_topk=0 a4:align_topk=4 a4prune:align_topk=4,ttt.PRUNE_UNREACHED=true"
}
sbs_at_lr() {  # the side by side with both trainers at SBS_LR (default 1e-3, eyas's default for this drafter since
    # 2026-12-02) in a root of its own; eyas variants SBS_LR_VARIANTS (default: lr 2e-3 for eyas alone, and Muon)
    local lr=${SBS_LR:-1e-3}
    SBS_VARIANTS=${SBS_LR_VARIANTS:-lr2e-3:lr=2e-3 muon:optimizer=muon} sbs_with_variants $ROOT/sbs-lr$lr $lr sbs_lr$lr ""
}
sbs_with_variants() {  # sbs_with_variants ROOT LR LOG DEFAULT_VARIANTS
    waitfor $prep/meta.json
    local v; local -a vs=()
    for v in ${SBS_VARIANTS:-$4}; do vs+=(--eyas-variant "$v"); done
    python lab/scripts/specforge_side_by_side.py --prepared $prep --target $ROOT/smol --root $1 --lr $2 \
        --eval-prompts $S/question.jsonl "${vs[@]}" > $ROOT/q/$3.log 2>&1
}
side_by_side_lr() {  # the side by side again with lr 3e-4 for both trainers (the recipe's), on the first one's store
    # and SpecForge files; the eyas drafter, its export and eval are sbs_ablations' lr3e-4 variant where it ran
    waitfor $prep/meta.json
    local r=$ROOT/sbs-lr3e-4 d
    mkdir -p $r
    for d in store specforge-features; do [ -d $ROOT/sbs/$d ] && ln -sfn $ROOT/sbs/$d $r/$d; done
    if [ -f $ROOT/sbs/eyas-lr3e-4-train/drafter/config.json ]; then
        ln -sfn $ROOT/sbs/eyas-lr3e-4-train $r/eyas-train && ln -sfn $ROOT/sbs/eyas-lr3e-4-sglang $r/eyas-sglang
        [ -d $ROOT/sbs/eval-eyas-lr3e-4 ] && ln -sfn $ROOT/sbs/eval-eyas-lr3e-4 $r/eval-eyas
    fi
    python lab/scripts/specforge_side_by_side.py --prepared $prep --target $ROOT/smol --root $r --lr 3e-4 \
        --eval-prompts $S/question.jsonl > $ROOT/q/sbs_lr3e-4.log 2>&1
}
profiles() { profile_8b; profile_small; }  # where the step time goes (synthetic states): op tables, copies by shape
profile_8b() { timeout -k 30 150 python benchmarks/train_bench.py --profile 40 --no-specforge > $ROOT/q/profile_8b.log 2>&1; }
profile_small() {
    timeout -k 30 150 python benchmarks/train_bench.py --small --seq 2048 --batch 32 --profile 40 --no-specforge \
        > $ROOT/q/profile_small.log 2>&1
}
recipe() {  # recipe CONVERSATIONS GPUS [ARGS...]: scaling-study points with the recipe (ARGS: more scaling_study.py options)
    python lab/scripts/scaling_study.py $SCALE --root $ROOT/scaling --conversations $1 --gpus $2 "${@:3}" \
        > $ROOT/q/scaling-${1//,/-}.log 2>&1
}
recipe_all() { recipe $ALL 0; }
points() {  # the study's smaller points (POINTS: some of them, e.g. 2000), one after another on this chain's GPU, with
    # the settings of its 17,293-record point (lab/scripts/scaling_points.jsonl, measured at 8f7af01, before the
    # reachability mask existed: align_topk 0), which joins their table, trend and plot
    recipe ${POINTS:-2000,6000} 0 --add-points lab/scripts/scaling_points.jsonl --set train.align_topk=0
}
wait_target() { waitfor $ROOT/smol/config.json; }  # a chain started in call 1 waits for call 2's target
prepare_only() {  # the recipe point's regenerate and prepare stages alone, in its workdir with its settings (a later
    # recipe run skips them): the side by side's data without the recipe's training (.stage/r restages the regeneration)
    python -m eyas pipeline recipes/smollm2-gpu.toml --workdir $ROOT/scaling/n$ALL-s$STEPS --until prepare \
        --set regenerate.out=$ROOT/scaling/regen --set regenerate.limit=$ALL --set train.steps=$STEPS \
        --set target=$ROOT/smol --set regenerate.source=$S/chats_all.jsonl --set eval.prompts=$S/question.jsonl \
        > $ROOT/q/prepare.log 2>&1
}
smol_rate_cached() { smol_rate on; }
gpu_tests() {  # the product's tests marked gpu (they run only on a GPU; pytest is in the device's image)
    [ "${GPU_TESTS:-}" = none ] || timeout -k 30 900 python -m pytest -q -p no:cacheprovider -rs -m gpu tests \
        > $ROOT/q/gpu_tests.log 2>&1
}
specdec() {  # 16 questions: batch 16 gets 16 rows
    python benchmarks/specdec_bench.py --drafter $ROOT/scaling/n$ALL-s$STEPS/train/drafter --target $ROOT/smol \
        --limit 16 --engine static --predict --batch-sizes 1,4,16 --prompts $S/question.jsonl > $ROOT/q/specdec.log 2>&1
}
export ROOT POLL_S S ALL STEPS SCALE prep SBS_VARIANTS SBS_LR SBS_LR_VARIANTS BENCH_VARIANTS SMOL_RUNS GPU_TESTS POINTS
export -f waitfor train_8b smol_rate smol_rate_cached smol_next gpu_check gpu_tests side_by_side sbs_ablations sbs_ablations_lr sbs_at_lr \
    sbs_with_variants side_by_side_lr profiles profile_8b profile_small profile_smol_online recipe recipe_all points wait_target \
    prepare_only specdec
chain() {  # chain GPU NAME 'commands': detached (a new process session), from the copy; $ROOT/q/NAME.done at its end
    local gpu=$1 name=$2; shift 2
    # `cd $R || exit;` and not `cd $R && ...&`: an &&-list sent to the background is a subshell that keeps this
    # script's stdout open until the chain ends (a call piping this script into `tail` then hangs)
    (cd $R || exit; CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$R/src:$ROOT/site setsid nohup bash -c "$*; touch $ROOT/q/$name.done" \
        < /dev/null > $ROOT/q/$name.chain.log 2>&1 &)
    note "chain $name started on GPU $gpu"
}
jobs_chain() {  # jobs_chain GPU NAME VAR DEFAULT: the chain of the jobs listed in $VAR (else DEFAULT), names checked first
    local gpu=$1 name=$2 var=$3 j; local -a jobs=(${!var:-$4})
    for j in "${jobs[@]}"; do declare -F "$j" > /dev/null || { note "$var: no job named $j"; exit 2; }; done
    chain $gpu $name "$(IFS=';'; echo "${jobs[*]}")"
}
running() { local n=0; for c in $ROOT/q/*.chain.log; do [ -e "$c" ] && [ ! -e "${c%.chain.log}.done" ] && n=$((n + 1)); done; echo $n; }

case "$part" in
0)  # staging (1/2) alone
    stage1
    ;;
1)
    nvidia-smi -L | tee -a "$L/session.log"
    stage1
    if [ "$NG" -eq 1 ] && [ -z "${SIDE_JOBS:-}" ]; then  # one GPU: a check of the step's kernels, a few minutes (the chain
        # comes in call 2)
        gpu_check; cp $ROOT/q/gpu_check.log "$L/"
        echo "== gpu_check"; grep -v warmup $ROOT/q/gpu_check.log | tail -8 | cut -c1-300; note "call 1 finished"; exit 0
    fi
    snapshot
    last=$(( NG - 1 ))
    jobs_chain $last side SIDE_JOBS "train_8b wait_target smol_rate side_by_side profiles"
    sleep ${SETTLE_S:-20}; summary
    ;;
2)
    need $S/smol.gguf.aa $S/chats_all.jsonl $S/question.jsonl
    cp $STAGE/b/* $S/ && cat $S/smol.gguf.aa $S/smol.gguf.ab > $S/smol.gguf.part && md5sum $S/smol.gguf.part
    python -c "from pathlib import Path; from eyas.defaults import convert_gguf; convert_gguf(Path('$S/smol.gguf.part'), Path('$ROOT/smol.part'))" 2>&1 | tail -1
    mkdir -p $ROOT/scaling  # the regeneration before the target: a side chain waiting for the target may read it next
    [ -f $STAGE/r/regen.tgz ] && tar xzf $STAGE/r/regen.tgz -C $ROOT/scaling && note "regeneration restaged"
    [ -d $ROOT/smol ] || mv $ROOT/smol.part $ROOT/smol  # the side chain waits for $ROOT/smol/config.json: only once it is whole
    note "staged (2/2)"
    [ -d $R/src ] || snapshot
    if [ "${JOBS:-}" = none ]; then  # the chain of call 1 (SIDE_JOBS) goes on alone
        note "JOBS=none: no chain started"
    elif [ "$NG" -eq 1 ]; then  # one job at a time (sharing the GPU, the recipe ran 2.7x slower on 2026-12-01);
        # the issues' open figures first: the recipe's tau, speculative decoding, the side by side
        jobs_chain 0 main JOBS "recipe_all specdec side_by_side smol_rate_cached train_8b profiles"
    elif [ "$NG" -ge 4 ]; then
        chain 0 main "recipe 2000,6000,$ALL 0,1,2; specdec"
    else
        jobs_chain 0 main JOBS "recipe_all specdec"
    fi
    while [ $(( $(date +%s) - T0 )) -lt ${CALL_S:-555} ] && [ "$(running)" -gt 0 ]; do sleep $POLL_S; done
    collect; summary; newest
    ;;
3)
    need $ROOT/smol
    while [ $(( $(date +%s) - T0 )) -lt ${WAIT_S:-540} ] && [ "$(running)" -gt 0 ]; do sleep $POLL_S; done
    collect; tar czf "$OUT/regen.tgz" -C $ROOT/scaling regen 2>/dev/null
    summary 8; newest
    n=$(running); note "chains still running: $n"; [ "$n" -gt 0 ] && note "call 3 again"
    ;;
esac
note "call $part finished"
