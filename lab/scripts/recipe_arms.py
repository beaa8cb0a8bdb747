"""Run the recipe N times per arm on one H200 and tabulate MT-bench tau per run and per arm (issue 45).

Arms (each a full `eyas pipeline recipes/smollm2-gpu.toml` from the same prepared data, `--set train.seed=N`):
  default   the recipe as it is
  muon      --set train.optimizer="muon" --set train.lr=2e-3
  eagle31   the recipe through lab/variants/eagle31.py (EAGLE-3.1: fc_norm + norm_output, trained, evaluated and
            exported as SGLang serves it)
  steps     --set train.steps=<--more-steps> (more training, where the session's time allows)
  lk        the recipe through lab/variants/lk.py (trained on the LK loss -log(acceptance rate), not soft CE)
  muon31    eagle31 with muon's --set values
  lk31      eagle31 and lk at once (lab/variants/run.py --variant eagle31 --variant lk --)
  sampled   the default arm's options on more diverse data: the greedy answers plus --samples (1) answers per prompt
            sampled from the target at --sample-temperature 0.7, --sample-top-p 0.95 (seeds 1..K), from its own base
            (arms/base-sampled, made once a session after arms/base: sampled_data.py says how and why)

One device session, calls chained BACK TO BACK: the machine is given back about 30 s after a call ends, and
everything on it (the staged target, every run) goes with it. A call runs at most 10 minutes, so the runs go
detached (setsid) and `wait` polls. The device commands use `python3` from the repository root; the driver and
its pipelines run from a copy of src, lab and recipes (ROOT/q/repo), as every call rewrites the working tree.

  here:    python lab/scripts/serve_live.py stage       (.stage/serve-a and -b: the target's GGUF in halves, MT-bench,
                                                         the chats; each call carries at most 64 MiB)
  device:  serve_live.py a               carry .stage/serve-a
           serve_live.py b --no-recipe   carry .stage/serve-b   (the target converted, the chats unpacked)
           recipe_arms.py start --seeds 1 --arms default,eagle31 [--set section.key=value ...] [--parallel P] [--gpus N|IDS]
                                         [--base-archive /root/eyas-stage/arms-base]
                                         (detached: regenerate + prepare once into arms/base, then every run in its
                                         own workdir seeded with base's regenerate/ and prepared/, seed-major: all
                                         arms of one seed before the next seed)
           recipe_arms.py wait --timeout 540              (polls, prints the table; repeat, back to back)
           recipe_arms.py wait --timeout 480 --collect [--with-base]   ($OUT: arms.json, arms.txt, arms.tgz of logs
                                                          and reports; the last call of the session)
  here:    python lab/scripts/recipe_arms.py table FILE [FILE ...]   (one table over several sessions' arms.json)
  device:  recipe_arms.py stop           (ends the driver's process group, by the id `start` recorded)

Plan the device minutes: a session's machine goes back after 30 minutes held, its start included. Staging (two
calls), the recipe's base and one full run (the ledger's `recipe_wall_s` row gives its stages) leave too little
for a second run, so a session holds one full run, or two where the base's regeneration is carried instead of
redone and the first run evaluates beside the second's training:
- `--overlap` (the default): a run's pipeline goes in two parts, `--until train` and then the rest, and the next
  run trains on the GPU while the last one evaluates (the target's answers at a small batch and the replay: a
  minute or so, little of the GPU). `--no-overlap` runs each pipeline alone, for a run's own wall time: an overlapped
  run's eval, and the next run's training rate, share the GPU for that minute.
- `wait --collect --with-base` also packs the base's regeneration (regenerate/ without run/: the chats it
  selected and its stage record), the session's answers (below) and the compile caches (torch.compile's and
  Triton's, which the driver keeps under ROOT/cache: a fresh machine's first training spends its first step
  compiling) into $OUT as base-regenerate.tar.xz.NN, eval-answers.tar.xz.NN and compile-caches.tar.xz.NN (at
  most 15 MiB each). Copy them here into
  .stage/arms-base and carry that folder with a later session's call `a` (64 MiB in all with serve-a; copy it to
  /root/eyas-stage there, as the tree's copy may not outlast the call); `start --base-archive
  /root/eyas-stage/arms-base` puts them back before the driver starts, and the base's pipeline skips the
  regeneration (same options, same fingerprint: the target and chats staged at the same paths) and prepares
  again. The driver's log says whether it skipped. A run on warm caches is not a fresh machine's wall time.
- `--answers` (the default): every run's eval replays on one set of the target's MT-bench answers (`eyas eval
  --answers`), so runs, and sessions that carry the set (eval-answers.tar.xz, packed with the base), differ by
  their drafters alone (bf16 answers can differ between processes) and later runs skip the generation. The first
  planned run generates them; the others' evals wait for it. The table's note names each run's answers by digest.
  `--no-answers`: each run generates its own.
Three seeds of two arms take three sessions that way (seed 1, then `--seeds 2`, then `--seeds 3`), or shorten
every arm alike with `--set train.steps=...` (a proxy: the learning rate's schedule is compressed with it).
`--parallel 2` trains two runs at once on the one GPU (the table's tok/s shows whether they slow each other
down; GPU memory must hold each online run's state cache, which on one H100 it does not for the recipe).
On a machine of several GPUs (the nvidia-h200-x2, -x4, -x8 kinds), `--gpus N` gives each run a GPU of its own
(CUDA_VISIBLE_DEVICES; the base's regeneration runs on the first), N runs at once: three seeds of two arms in one
session on x8 (`--arms default,lk31 --seeds 1,2,3 --gpus 6`), at the staging cost of one. GPU ids (`--gpus 1,`)
leave the others to another job: on x2, serve_live's capture (issue 41) on GPU 0 (CUDA_VISIBLE_DEVICES=0) beside
a recipe run on GPU 1 (the two share the CPUs: the capture's rate is then read against its own call's prefill).
Runs still going when the session ends are lost; `wait --collect` reports the finished ones.
The sampled arm adds, once a session before the first run, about 4 minutes (estimated: a sampled regeneration as
long as the greedy one, about 2 minutes with the target's load; prepare of twice the chats, about 1.5), and about
half a minute a run (the first epoch, with the target in the loop, is twice as long). Its state cache is twice the
default's (4.6 KB a token in bf16: about 98 GB for about 21M tokens), estimated to fit on an H200 while the first
step's memory peak stays under about 43 GB (train/builders.py start_state_cache); --samples 2 would not. Where it
does not fit, training turns it off and runs the target every step (minutes slower; the table notes "state cache
did not fit"); `--parallel 2` is refused with this arm. With staging and the greedy base that leaves one full run a
session: `--arms sampled --seeds N`, compared with other sessions' default runs by `table`.

Reusing one regeneration: `eyas pipeline` skips a stage whose stage.json records `complete` with the same
fingerprint (the stage's options, paths the pipeline fills excluded, plus its input's fingerprint) and whose
output is there. Every run gets the same options for regenerate and prepare, so the copies of base's stage
folders (regenerate/ without its run/ folder, which only a rerun would read; prepared/ whole) are SKIPPED and
each run starts at train. An arm may only change train, eval or export options; the sampled arm changes the
data instead, through its own base whose regenerate/ record has base's options (so the same fingerprint) and the
merged chats' checksum as its output, so its runs skip both stages too.

The exports of the arms with eagle31 (arms/eagle31-sN/export/sglang, muon31, lk31) carry the variant's config keys
and norms; the unpatched eyas refuses them, so anything that evaluates them goes through the variant too
(`python3 lab/variants/eagle31.py eval --drafter DIR ...`); SGLang itself reads them as they are. The lk arm's
drafters are plain EAGLE-3 ones (config.json marks the loss as `lab_loss`); its logged training loss is the LK value.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampled_data  # noqa: E402 (the script beside this one: the sampled arm's merge)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smollm2-gpu.toml"
VARIANTS_DIR = REPO / "lab" / "variants"
DEFAULT_ROOT = Path(os.environ.get("EYAS_DEVICE_STAGE", "/root/eyas-stage"))  # serve_live.py's ROOT
MUON = ['train.optimizer="muon"', "train.lr=2e-3"]
ARMS = {  # arm -> (lab variants patched in, in order; --set values); `steps` gets train.steps from --more-steps
    "default": ((), []),
    "muon": ((), MUON),
    "eagle31": (("eagle31",), []),
    "steps": ((), []),
    "lk": (("lk",), []),
    "muon31": (("eagle31",), MUON),
    "lk31": (("eagle31", "lk"), []),
    "sampled": ((), []),  # trains on its own base: greedy + sampled answers (sampled_base, sampled_data.py)
}
MORE_STEPS = 3600
# the sampled arm: answers sampled per prompt beside the greedy one; T 0.7 branches wherever the target hesitates,
# top_p 0.95 cuts the tail where a 135M target derails into text that greedy decoding (MT-bench eval) never reaches
SAMPLES, SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 1, 0.7, 0.95
SHARED_STAGES = ("regenerate", "prepared")
TRAIN_PART = "pipeline-train.json"  # an --overlap run's first part (regenerate .. train)


def log(msg: str) -> None:
    print(f"[recipe_arms {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def paths(root: Path) -> dict[str, Path]:
    """serve_live.py's staging (s: chats and MT-bench, smol: the target) and this script's folders."""
    return {"s": root / "s", "smol": root / "smol", "q": root / "q", "w": root / "arms"}


def env(gpu: int | None = None, *, repo: Path = REPO) -> dict[str, str]:
    """`repo`'s eyas first on the path; with `gpu`, that GPU alone visible (it is the run's cuda:0)."""
    pp = os.environ.get("PYTHONPATH")
    out = {**os.environ, "PYTHONPATH": f"{repo / 'src'}{os.pathsep + pp if pp else ''}", "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        out["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return out


# ----------------------------------------------------------------------------- what a run is


def arm_sets(arm: str, *, more_steps: int = MORE_STEPS) -> list[str]:
    if arm not in ARMS:
        raise SystemExit(f"arm {arm!r}: expected some of {', '.join(ARMS)}")
    sets = list(ARMS[arm][1])
    if arm == "steps":
        sets.append(f"train.steps={more_steps}")
    bad = [s for s in sets if not s.startswith(("train.", "eval.", "export."))]
    if bad:
        raise SystemExit(f"arm {arm}: {bad} would rerun the shared regeneration or prepare")
    return sets


def common_sets(a) -> list[str]:
    """The --set values every pipeline of the session gets (the base's too: they decide its fingerprints)."""
    out = []
    if a.target:
        out.append(f"target={json.dumps(str(a.target))}")
    if a.source:
        out.append(f"regenerate.source={json.dumps(str(a.source))}")
    if a.prompts:
        out.append(f"eval.prompts={json.dumps(str(a.prompts))}")
    return out + list(a.set or [])


def runner(variants: tuple[str, ...]) -> list[str]:
    """The command that runs eyas's CLI patched with `variants`: eyas itself, one variant's entry point, or run.py."""
    if not variants:
        return [sys.executable, "-m", "eyas"]
    if len(variants) == 1:
        return [sys.executable, str(VARIANTS_DIR / f"{variants[0]}.py")]
    return [sys.executable, str(VARIANTS_DIR / "run.py"), *(x for v in variants for x in ("--variant", v)), "--"]


def pipeline_command(
    variants: tuple[str, ...], recipe: Path, workdir: Path, sets: list[str], *, until: str | None = None
) -> list[str]:
    head = runner(variants)
    cmd = [*head, "pipeline", str(recipe), "--workdir", str(workdir)]
    if until:
        cmd += ["--until", until]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def plan(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Seed-major: every arm of one seed before any arm of the next (a session cut short still pairs the arms)."""
    return [(arm, seed) for seed in seeds for arm in arms]


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def seed_workdir(base: Path, run: Path) -> None:
    """Copy base's finished regenerate/ and prepared/ stage folders into the run's workdir (once): the run's
    pipeline then skips both. regenerate/run (the whole regeneration) stays behind: a skipped stage never reads it."""
    run.mkdir(parents=True, exist_ok=True)
    for stage in SHARED_STAGES:
        src, dst = base / stage, run / stage
        if not (src / "stage.json").is_file():
            raise SystemExit(f"{src}: no stage.json; run the base pipeline (--until prepare) first")
        if (dst / "stage.json").is_file():
            continue
        shutil.copytree(
            src, dst, ignore=shutil.ignore_patterns("run") if stage == "regenerate" else None, dirs_exist_ok=True
        )


# ----------------------------------------------------------------------------- the driver (detached)


def run_logged(cmd: list[str], log_file: Path, *, gpu: int | None = None, append: bool = False) -> int:
    log(f"$ {' '.join(cmd)}  (log {log_file}{'' if gpu is None else f', GPU {gpu}'})")
    with open(log_file, "a" if append else "w") as f:
        return subprocess.run(
            cmd, env=env(gpu), cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False
        ).returncode


def sampled_base(a, w: Path, base: Path) -> Path | None:
    """The sampled arm's own base, made once from `base` (its greedy regeneration is not redone): --samples
    regenerations at --sample-temperature / --sample-top-p (seeds 1..K), merged with base's greedy chats
    (sampled_data.py) and prepared; None when a step failed (its log says why)."""
    sets, done = common_sets(a), []
    for k in range(1, a.samples + 1):
        gen = w / f"sampled-gen-s{k}"
        sampling = [
            f"regenerate.temperature={a.sample_temperature}",
            f"regenerate.top_p={a.sample_top_p}",
            f"regenerate.seed={k}",
        ]
        cmd = pipeline_command((), Path(a.recipe), gen, [*sets, *sampling], until="regenerate")
        if run_logged(cmd, w / f"{gen.name}.log", gpu=first_gpu(a.gpus)):
            log(f"the sampled regeneration {k} failed: {w / f'{gen.name}.log'}")
            return None
        done.append(gen / "regenerate")
    out = w / "base-sampled"
    try:
        summary = sampled_data.merge(base / "regenerate", done, out / "regenerate", split_from=base / "prepared")
    except ValueError as exc:
        log(f"merging the sampled arm's chats failed: {exc}")
        return None
    log(f"sampled arm's chats: {json.dumps(summary)}")
    cmd = pipeline_command((), Path(a.recipe), out, sets, until="prepare")
    if run_logged(cmd, w / "base-sampled.log", gpu=first_gpu(a.gpus)):
        log(f"preparing the sampled arm's chats failed: {w / 'base-sampled.log'}")
        return None
    return out


ANSWERS = "answers"  # under ROOT/arms: the session's one set of the target's MT-bench answers (an eval report)
ANSWERS_LOCK = threading.Lock()


def shared_answers(a, w: Path, name: str) -> list[str]:
    """`eval.answers` for a run's eval with `a.answers`: every run replays on the same target answers, so runs
    differ by their drafters alone. Where the session has none yet (none carried), the first planned run makes
    them: the others' evals wait until it has ended (drive sets `a.answers_made`); if it failed, each of them
    generates its own and the first to finish provides the rest."""
    if not getattr(a, "answers", False):
        return []
    made = getattr(a, "answers_made", None)
    if made is not None and not made.is_set() and name != a.answers_maker and not _ready("eval-answers.tar.xz", w):
        log(f"{name}: its eval waits for {a.answers_maker}'s answers")
        made.wait()
    if _ready("eval-answers.tar.xz", w):
        return [f"eval.answers={json.dumps(str(w / ANSWERS))}"]
    return []


def keep_answers(a, w: Path, run: Path) -> None:
    """The first finished run's eval report becomes the session's answers (written whole, then renamed)."""
    with ANSWERS_LOCK:
        if not getattr(a, "answers", False) or _ready("eval-answers.tar.xz", w):
            return
        if not all((run / "eval" / f).is_file() for f in CARRIED["eval-answers.tar.xz"][3]):
            return
        tmp = w / f".{ANSWERS}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in CARRIED["eval-answers.tar.xz"][3]:
            shutil.copy2(run / "eval" / f, tmp / f)
        tmp.rename(w / ANSWERS)
        log(f"{run.name}'s answers are the session's: later runs replay on them ({w / ANSWERS})")


def one_run(
    a, arm: str, seed: int, base: Path, w: Path, *, gpu: int | None = None, trained: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """One run's pipeline. With `a.overlap` it goes in two parts, `--until train` and then the rest (eval and
    export, the training skipped as complete): `trained()` is called between them, so the next run may train on the
    GPU while this one evaluates (its first part's pipeline.json is kept as pipeline-train.json). Its eval replays
    on the session's answers where they are there when it starts (shared_answers)."""
    name = run_name(arm, seed)
    run = w / name
    seed_workdir(base, run)
    sets = [*common_sets(a), f"train.seed={seed}", *arm_sets(arm, more_steps=a.more_steps)]
    rec = {"name": name, "arm": arm, "seed": seed, "gpu": gpu, "started": time.time()}
    rec["command"] = pipeline_command(ARMS[arm][0], Path(a.recipe), run, sets)  # eval's answers decided later
    (run / "arm.json").write_text(json.dumps(rec, indent=1) + "\n")
    log_file = w / f"{name}.log"
    if getattr(a, "overlap", False):
        cut = pipeline_command(ARMS[arm][0], Path(a.recipe), run, sets, until="train")
        rc = run_logged(cut, log_file, gpu=gpu)
        if (run / "pipeline.json").is_file():
            (run / "pipeline.json").replace(run / TRAIN_PART)
        trained()
        if rc == 0:  # a failed training waits for no answers
            rec["command"] = pipeline_command(ARMS[arm][0], Path(a.recipe), run, [*sets, *shared_answers(a, w, name)])
            rc = run_logged(rec["command"], log_file, gpu=gpu, append=True)
    else:
        rec["command"] = pipeline_command(ARMS[arm][0], Path(a.recipe), run, [*sets, *shared_answers(a, w, name)])
        rc = run_logged(rec["command"], log_file, gpu=gpu)
    if rc == 0:
        keep_answers(a, w, run)
    rec.update(rc=rc, seconds=round(time.time() - rec["started"], 1))
    (run / "arm.json").write_text(json.dumps(rec, indent=1) + "\n")
    log(f"{name}: exit {rc} after {rec['seconds']} s")
    return rec


def parse_gpus(text: str) -> list[int] | None:
    """--gpus: a count N (GPUs 0..N-1; 1 = the device as the environment gives it, None) or a comma list of GPU ids
    (`1,2,3`, or `1,` for GPU 1 alone: the others left to another job, e.g. serve_live's capture server)."""
    try:
        ids = [int(x) for x in text.split(",") if x] if "," in text else list(range(int(text)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count (3) or GPU ids (1,2,3)") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one GPU, ids >= 0, each once")
    return None if ids == [0] and "," not in text else ids


def first_gpu(gpus: list[int] | None) -> int | None:
    """Where the base's regeneration and prepare run: the first of the run's GPUs."""
    return gpus[0] if gpus else None


def gpu_slots(gpus: list[int] | None, parallel: int) -> queue.Queue:
    """One slot per run that may train at once: each GPU `parallel` times, every GPU once before any twice (so 2 runs
    on 2 GPUs take one each). None: one GPU, the device as the environment gives it."""
    slots = queue.Queue()
    for _ in range(max(1, parallel)):
        for g in gpus or [None]:
            slots.put(g)
    return slots


def drive(a) -> int:
    w = paths(Path(a.root))["w"]
    w.mkdir(parents=True, exist_ok=True)
    base = w / "base"
    cmd = pipeline_command((), Path(a.recipe), base, common_sets(a), until="prepare")
    rc = run_logged(cmd, w / "base.log", gpu=first_gpu(a.gpus))
    if rc:
        log(f"the base pipeline (regenerate + prepare) failed with exit {rc}: {w / 'base.log'}")
        return rc
    try:
        done = json.loads((base / "pipeline.json").read_text())["stages"]
        log("base: " + ", ".join(f"{k} {v.get('status')} ({v.get('seconds')} s)" for k, v in done.items()))
    except (OSError, ValueError, KeyError):
        pass
    bases = dict.fromkeys(a.arms, base)
    if "sampled" in bases:  # before any run: its regenerations would share the GPU with a training
        bases["sampled"] = sampled_base(a, w, base)
    runs = [r for r in plan(a.arms, a.seeds) if bases[r[0]] is not None]
    slots = gpu_slots(a.gpus, a.parallel)
    a.answers_made, a.answers_maker = threading.Event(), run_name(*runs[0]) if runs else None

    def placed(r, gpu):  # the slot's GPU until the run has trained (--overlap) or ended, then the slot goes back
        given = threading.Event()

        def give_back():
            if not given.is_set():
                given.set()
                slots.put(gpu)

        try:
            return one_run(a, r[0], r[1], bases[r[0]], w, gpu=gpu, trained=give_back)
        finally:
            give_back()
            if r == runs[0]:  # the session's answers are made, or will not be by this run (shared_answers)
                a.answers_made.set()

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(runs))) as pool:
        futures = [pool.submit(placed, r, slots.get()) for r in runs]  # slots taken here: runs start in plan order
        recs = [f.result() for f in futures]
    print(format_table(gather(w)))
    return int(any(r["rc"] for r in recs) or None in bases.values())


# ----------------------------------------------------------------------------- results


def variant_check(run: Path, variants: tuple[str, ...] = ("eagle31",)) -> str | None:
    """For an arm with variants: whether the trained drafter (and for eagle31 the SGLang export) carry each."""
    try:
        drafter = json.loads((run / "train" / "drafter" / "config.json").read_text())
        export = json.loads((run / "export" / "sglang" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    ok = True
    if "eagle31" in variants:
        ok &= (
            (drafter.get("lab_variant") or {}).get("name") == "eagle31"
            and export.get("fc_norm") is True
            and export.get("norm_output") is True
        )
    if "lk" in variants:
        ok &= (drafter.get("lab_loss") or {}).get("name") == "lk"
    return "ok" if ok else "MISSING"


def progress(run: Path) -> str:
    """Where an unfinished run is: the last stage record that says running, or the training's last step."""
    metrics = run / "train" / "metrics.jsonl"
    if metrics.is_file():
        lines = metrics.read_text().strip().splitlines()
        for line in reversed(lines):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "step" in rec:
                return f"train step {rec['step']}"
    return "started"


def state_cache(log_file: Path) -> str | None:
    """What the run's training decided: "on", "off", or "did not fit" (off for want of GPU memory: the target
    then runs every step, a slower run than its arm's others)."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return None
    at = text.rfind("state cache: ")
    if at < 0:
        return None
    line = text[at:].split("\n", 1)[0]
    return "on" if line.startswith("state cache: on") else "did not fit" if "do not fit" in line else "off"


def gather(w: Path) -> list[dict[str, Any]]:
    """Every run under `w` that the driver started: its arm, seed, exit and figures (None until it finished)."""
    out = []
    for arm_file in sorted(w.glob("*/arm.json")):
        run = arm_file.parent
        rec = json.loads(arm_file.read_text())
        row = {k: rec.get(k) for k in ("name", "arm", "seed", "rc", "seconds")}
        pj = run / "pipeline.json"
        if pj.is_file() and rec.get("rc") == 0:
            p = json.loads(pj.read_text())
            if (run / TRAIN_PART).is_file():  # an --overlap run: the stages its first part ran, as they ran there
                first = json.loads((run / TRAIN_PART).read_text())["stages"]
                p["stages"].update({k: v for k, v in first.items() if v.get("status") != "skipped"})
            tr, ev = p["stages"].get("train", {}), p["stages"].get("eval", {})
            row.update(
                tau_chain=p.get("tau_chain"),
                tau_tree=p.get("tau_tree"),
                train_s=tr.get("seconds"),
                steps=tr.get("steps"),
                tokens_per_s=tr.get("tokens_per_s"),
                heldout_tau=tr.get("heldout_tau_simulated"),
                eval_s=ev.get("seconds"),
                train_samples=p["stages"].get("prepare", {}).get("train_samples"),
                state_cache=state_cache(w / f"{rec['name']}.log"),
                answers=answers_of(run),
                skipped=[s for s, r in p["stages"].items() if r.get("status") == "skipped"],
            )
            variants = ARMS.get(rec["arm"], ((), []))[0]
            if variants:
                row["variant"] = variant_check(run, variants)
        else:
            row["progress"] = "failed" if rec.get("rc") else progress(run)
        out.append(row)
    return out


def answers_of(run: Path) -> str | None:
    """The answers the run's eval replayed on, by the first 12 characters of the digest its report records (runs
    that show the same replayed on the same answers), with " own" where the run generated them."""
    try:
        gen = json.loads((run / "eval" / "report.json").read_text())["generation"]
        return gen["answers_digest"][:12] + ("" if gen.get("answers") else " own")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _num(x, digits=4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def arm_stats(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: n finished runs, mean, sample standard deviation and range of tau chain and tree."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        done = [r for r in runs if r["arm"] == arm and r.get("tau_chain") is not None]
        st: dict[str, Any] = {"n": len(done)}
        for key in ("tau_chain", "tau_tree"):
            xs = [float(r[key]) for r in done]
            st[key] = {
                "mean": statistics.fmean(xs) if xs else None,
                "sd": statistics.stdev(xs) if len(xs) > 1 else None,
                "min": min(xs) if xs else None,
                "max": max(xs) if xs else None,
            }
        out[arm] = st
    return out


def format_table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'run':<16} {'tau chain':>9} {'tau tree':>9} {'steps':>6} {'train s':>8} {'tok/s':>9} {'held-out':>8}  note"
    ]
    for r in runs:
        note = r.get("progress") or ("variant " + r["variant"] if r.get("variant") else "")
        if r.get("state_cache") == "did not fit":
            note += " state cache did not fit"
        if r.get("skipped") and set(r["skipped"]) != {"regenerate", "prepare"}:
            note += f" skipped {r['skipped']}"
        if r.get("answers"):
            note += f" answers {r['answers']}"
        lines.append(
            f"{r['name']:<16} {_num(r.get('tau_chain')):>9} {_num(r.get('tau_tree')):>9} "
            f"{r.get('steps') or '-':>6} {_num(r.get('train_s'), 0):>8} {_num(r.get('tokens_per_s'), 0):>9} "
            f"{_num(r.get('heldout_tau'), 3):>8}  {note}"
        )
    stats = arm_stats(runs)
    ref = stats.get("default", {})
    lines.append("")
    lines.append(
        f"{'arm':<10} {'n':>2}  {'chain mean':>10} {'sd':>7} {'range':>15}  {'tree mean':>10} {'sd':>7} "
        f"{'range':>15}  vs default (chain / tree)"
    )
    for arm, st in stats.items():
        cells = []
        for key in ("tau_chain", "tau_tree"):
            s = st[key]
            rng = f"{_num(s['min'])}..{_num(s['max'])}" if s["min"] is not None else "-"
            cells.append(f"{_num(s['mean']):>10} {_num(s['sd']):>7} {rng:>15}")
        diff = "-"
        if arm != "default" and st["n"] and ref.get("n"):
            diff = " / ".join(f"{st[k]['mean'] - ref[k]['mean']:+.4f}" for k in ("tau_chain", "tau_tree"))
        lines.append(f"{arm:<10} {st['n']:>2}  {cells[0]}  {cells[1]}  {diff}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands


def cache_env(root: Path) -> dict[str, str]:
    """torch.compile's and Triton's caches under ROOT (the driver's environment, so every run's), where
    `wait --with-base` packs them from; a path the environment sets already is kept."""
    cache = root / CARRIED["compile-caches.tar.xz"][1]
    pairs = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
    return {var: os.environ.get(var) or str(cache / sub) for var, sub in pairs}


def copy_tree(dest: Path) -> Path:
    """A copy of what the driver and its pipelines import and read (src, lab, recipes), made afresh: a device call
    rewrites the repository's working tree, and a process starting to import from it at that moment fails."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("src", "lab", "recipes", "pyproject.toml"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def start(a) -> None:
    p = paths(Path(a.root))
    q = p["q"]
    q.mkdir(parents=True, exist_ok=True)
    pid_file, rc_file = q / "arms.pid", q / "arms.rc"
    if pid_file.exists() and not rc_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), 0)
            raise SystemExit(f"a driver is running (process group {pid_file.read_text().strip()}): wait or stop it")
        except ProcessLookupError:
            pass
    rc_file.unlink(missing_ok=True)
    if a.base_archive is not None:
        used = [name for name in CARRIED if unpack(a.base_archive, Path(a.root), name)]
        if not used and not any(a.base_archive.glob("*.[0-9][0-9]")):
            raise SystemExit(f"--base-archive {a.base_archive}: none of {', '.join(CARRIED)} (as NAME.NN) there")
    copy = copy_tree(q / "repo")
    recipe = Path(a.recipe).resolve()
    if recipe.is_relative_to(REPO):
        recipe = copy / recipe.relative_to(REPO)
    cmd = [
        sys.executable,
        str(copy / Path(__file__).resolve().relative_to(REPO)),
        "drive",
        "--overlap" if a.overlap else "--no-overlap",
        "--answers" if a.answers else "--no-answers",
        "--root",
        str(a.root),
        "--recipe",
        str(recipe),
        "--arms",
        ",".join(a.arms),
        "--seeds",
        ",".join(map(str, a.seeds)),
        "--parallel",
        str(a.parallel),
        "--gpus",
        ",".join(map(str, a.gpus)) + "," if a.gpus else "1",
        "--more-steps",
        str(a.more_steps),
        "--samples",
        str(a.samples),
        "--sample-temperature",
        str(a.sample_temperature),
        "--sample-top-p",
        str(a.sample_top_p),
    ]
    for opt in ("target", "source", "prompts"):
        cmd += [f"--{opt}", str(getattr(a, opt) or "")]
    for s in a.set or []:
        cmd += ["--set", s]
    line = " ".join(f"'{c}'" for c in cmd)
    proc = subprocess.Popen(
        ["bash", "-c", f"{line} > {q}/arms.log 2>&1; echo $? > {rc_file}"],
        env={**env(repo=copy), **cache_env(Path(a.root))},
        cwd=copy,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # setsid: outlives this call
    pid_file.write_text(str(proc.pid))
    log(f"driver started detached (process group {proc.pid}): {line}")
    print(json.dumps({"phase": "start", "runs": [run_name(x, s) for x, s in plan(a.arms, a.seeds)], "pgid": proc.pid}))


def wait(a) -> None:
    p = paths(Path(a.root))
    rc_file, t0 = p["q"] / "arms.rc", time.time()
    while time.time() - t0 < a.timeout and not rc_file.exists():
        time.sleep(10)
    log_file = p["q"] / "arms.log"
    print(log_file.read_text()[-a.tail :] if log_file.exists() else "(no driver log)")
    runs = gather(p["w"])
    table = format_table(runs)
    print(table)
    done = rc_file.exists()
    print(
        json.dumps(
            {
                "phase": "wait",
                "done": done,
                "rc": rc_file.read_text().strip() if done else None,
                "waited_s": round(time.time() - t0),
                "finished": sum(r.get("tau_chain") is not None for r in runs),
                "runs": len(runs),
            }
        )
    )
    if a.collect:
        collect(p, runs, table)
    if a.with_base:
        for name in CARRIED:
            pack(Path(a.root), name, Path(os.environ.get("OUT", "/tmp/out")))


PART_BYTES = 15 << 20  # a file that comes back from a device call holds at most 16 MiB
OUT_BYTES = 60 << 20  # and all of them together at most 64 MiB (arms.tgz and the table beside the parts)
CARRIED = {  # archive -> (its folder under ROOT, the one member it holds there, a path under it left out, the files
    # that make the member finished: none = any file)
    "base-regenerate.tar.xz": ("arms/base", "regenerate", "regenerate/run", ("stage.json", "chats.jsonl")),
    "eval-answers.tar.xz": ("arms", ANSWERS, None, ("report.json", "sequences.jsonl")),  # keep_answers's copy
    "compile-caches.tar.xz": (".", "cache", None, ()),  # torch.compile's and Triton's caches (cache_env's paths)
}  # packed in this order: the largest, the caches, last (left out where $OUT would pass what comes back)


def _ready(name: str, where: Path) -> bool:
    member, needs = where / CARRIED[name][1], CARRIED[name][3]
    if needs:
        return all((member / f).is_file() for f in needs)
    return member.is_dir() and any(member.iterdir())


def pack(root: Path, name: str, out: Path) -> list[Path]:
    """CARRIED[name] from `root` as NAME.00, NAME.01, ... under `out`, each at most PART_BYTES: carried to a later
    session's device, `start --base-archive` puts it back there (the base's regeneration is then not redone, and
    the first training's compilation finds its kernels)."""
    folder, member, left_out, _ = CARRIED[name]
    where = root / folder
    if not _ready(name, where):
        log(f"{where / member}: nothing to pack into {name}")
        return []
    out.mkdir(parents=True, exist_ok=True)
    whole = out / name
    exclude = f"--exclude='{left_out}' " if left_out else ""
    subprocess.run(["bash", "-c", f"tar -C '{where}' {exclude}-cf - '{member}' | xz -T0 -6 > '{whole}'"], check=True)
    already = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f != whole)
    if already + whole.stat().st_size > OUT_BYTES:  # it would not come back: leave it out, say so
        log(
            f"{name}: {whole.stat().st_size >> 20} MiB beside {already >> 20} MiB in {out} would pass what a call "
            "brings back; not packed"
        )
        whole.unlink()
        return []
    parts = []
    with open(whole, "rb") as f:
        while chunk := f.read(PART_BYTES):
            parts.append(out / f"{name}.{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    whole.unlink()
    log(f"packed {where / member} into {', '.join(x.name for x in parts)}")
    return parts


def unpack(folder: Path, root: Path, name: str) -> bool:
    """Put CARRIED[name] back under `root` from its parts in `folder`, unless a finished one is there already;
    True when it did. An archive holding anything but its member is refused."""
    where, member = root / CARRIED[name][0], CARRIED[name][1]
    if _ready(name, where):
        log(f"{where / member} is there already: the carried {name} is not used")
        return False
    parts = sorted(folder.glob(f"{name}.[0-9][0-9]"))
    if not parts:
        return False
    where.mkdir(parents=True, exist_ok=True)
    joined = where / f".{name}"
    with open(joined, "wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    try:
        with tarfile.open(joined, "r:xz") as tar:
            if any(m.name != member and not m.name.startswith(member + "/") for m in tar.getmembers()):
                raise SystemExit(f"--base-archive {folder}: {name} holds more than {member}/")
            tar.extractall(where, filter="data")
    finally:
        joined.unlink()
    log(f"unpacked {len(parts)} part(s) of {name} into {where / member}")
    return True


def collect(p: dict[str, Path], runs: list[dict[str, Any]], table: str) -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    try:  # (the device's copy of the tree may have no .git)
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    doc = {
        "schema": "lab.recipe_arms/1",
        "commit": commit or None,
        "device": gpu_name(),
        "runs": runs,
        "arms": arm_stats(runs),
    }
    (out / "arms.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "arms.txt").write_text(table + "\n")
    w = p["w"]
    keep = (
        "pipeline.json",
        TRAIN_PART,
        "arm.json",
        "stage.json",
        "report.json",
        "metrics.jsonl",
        "config.json",
        "eyas_export.json",
    )
    with tarfile.open(out / "arms.tgz", "w:gz") as tar:
        for f in sorted(w.rglob("*")):
            rel = f.relative_to(w)
            if (
                f.is_file()
                and (f.suffix == ".log" or f.name in keep)
                and not set(rel.parts) & {"regenerate", "prepared", "checkpoints"}
            ):
                tar.add(f, arcname=str(rel))
        if (p["q"] / "arms.log").is_file():
            tar.add(p["q"] / "arms.log", arcname="arms.log")
    log(f"collected into {out}: " + ", ".join(sorted(x.name for x in out.iterdir())))


def gpu_name() -> str | None:
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() or None


def stop(a) -> None:
    pid_file = paths(Path(a.root))["q"] / "arms.pid"
    if not pid_file.exists():
        raise SystemExit("no driver was started here")
    pgid = int(pid_file.read_text())
    try:
        os.killpg(pgid, signal.SIGTERM)
        log(f"sent SIGTERM to the driver's process group {pgid}")
    except ProcessLookupError:
        log(f"process group {pgid} has already ended")


def table(a) -> None:
    runs = []
    for i, f in enumerate(a.files):
        doc = json.loads(Path(f).read_text())
        for r in doc["runs"]:
            runs.append({**r, "name": f"{r['name']}" if len(a.files) == 1 else f"{i + 1}:{r['name']}"})
    print(format_table(runs))
    print(json.dumps({"arms": arm_stats(runs)}))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _arms(text: str) -> list[str]:
    arms = [x for x in text.split(",") if x]
    for arm in arms:
        arm_sets(arm)
    return arms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("start", "drive"):
        s = sub.add_parser(name, help="run the arms detached" if name == "start" else "(what start runs detached)")
        if name == "start":
            s.add_argument(
                "--base-archive",
                type=Path,
                default=None,
                help="a folder holding the parts of an earlier session's `wait --collect --with-base`: the base's "
                "regeneration (not redone), the compile caches and the session's answers are put back from it",
            )
        s.add_argument("--arms", type=_arms, default=["default", "eagle31"], help="comma-separated: " + ", ".join(ARMS))
        s.add_argument("--seeds", type=_ints, default=[1], help="train.seed of each run, comma-separated")
        s.add_argument("--parallel", type=int, default=1, help="runs training at once on each GPU")
        s.add_argument(
            "--gpus",
            type=parse_gpus,
            default=None,
            help="GPUs to spread the runs over, one run each at a time: a count (x2/x4/x8) or ids (1,2,3)",
        )
        s.add_argument("--more-steps", type=int, default=MORE_STEPS, help="train.steps of the `steps` arm")
        s.add_argument("--samples", type=int, default=SAMPLES, help="the sampled arm's sampled answers per prompt")
        s.add_argument("--sample-temperature", type=float, default=SAMPLE_TEMPERATURE, help="of the sampled answers")
        s.add_argument("--sample-top-p", type=float, default=SAMPLE_TOP_P, help="of the sampled answers")
        s.add_argument("--set", action="append", default=[], help="section.key=value for every run (repeatable)")
        s.add_argument(
            "--overlap",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="a run's eval and export beside the next run's training (--no-overlap: each run alone, for its wall "
            "time)",
        )
        s.add_argument(
            "--answers",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="every run's eval replays on the session's one set of target answers (carried by --base-archive, or "
            "the first finished run's; --no-answers: each run generates its own)",
        )
        s.add_argument("--recipe", default=str(RECIPE))
        s.add_argument("--root", default=str(DEFAULT_ROOT))
        s.add_argument(
            "--target", default=None, help="default: serve_live's converted target (ROOT/smol); '' = the recipe's own"
        )
        s.add_argument(
            "--source",
            default=None,
            help="regenerate.source; default: serve_live's staged chats "
            "(ROOT/s/chats_all.jsonl); '' = the recipe's own",
        )
        s.add_argument(
            "--prompts",
            default=None,
            help="eval.prompts; default: serve_live's staged MT-bench (ROOT/s/question.jsonl); '' = the recipe's own",
        )
    w = sub.add_parser("wait")
    w.add_argument("--timeout", type=float, default=540)
    w.add_argument("--tail", type=int, default=2000)
    w.add_argument("--collect", action="store_true")
    w.add_argument(
        "--with-base",
        action="store_true",
        help="also pack the base's regeneration, the compile caches and the session's answers into $OUT ("
        + ", ".join(CARRIED)
        + ", as NAME.NN) for a later session's --base-archive",
    )
    w.add_argument("--root", default=str(DEFAULT_ROOT))
    st = sub.add_parser("stop")
    st.add_argument("--root", default=str(DEFAULT_ROOT))
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.command in ("start", "drive"):
        p = paths(Path(a.root))
        a.target = a.target if a.target is not None else p["smol"]
        a.source = a.source if a.source is not None else p["s"] / "chats_all.jsonl"
        a.prompts = a.prompts if a.prompts is not None else p["s"] / "question.jsonl"
    if a.command in ("start", "drive") and a.parallel < 1:
        raise SystemExit(f"--parallel {a.parallel}: expected at least 1")
    if a.command in ("start", "drive") and "sampled" in a.arms:
        if a.samples < 1 or a.sample_temperature <= 0:
            raise SystemExit(
                f"--samples {a.samples}, --sample-temperature {a.sample_temperature}: the sampled arm needs at least "
                "one sampled answer per prompt at a temperature above 0"
            )
        if a.parallel > 1:  # a run sizes its state cache by its own memory peak, blind to the other run's
            raise SystemExit(
                f"--parallel {a.parallel}: the sampled arm's state cache (twice the default's) leaves no room for "
                "a second run on the GPU; drop --parallel"
            )
    if a.command == "drive":
        raise SystemExit(drive(a))
    {"start": start, "wait": wait, "stop": stop, "table": table}[a.command](a)


if __name__ == "__main__":
    main()
