"""Small helpers every stage uses: stderr logging, progress bars, atomic files, hashing, and the
checks that guard what eyas reads and writes.

Results go to stdout as one JSON line (printed by the CLI); everything else goes to stderr so a
pipeline can read the summary with `tail -n 1`.

Ownership of outputs: every directory eyas creates as an output holds a marker file
(`.eyas-output`, see `claim_output_dir`). `--overwrite` and resume only ever delete or rewrite a
directory carrying the marker; a non-empty directory without it belongs to the user and is refused
with its path named, so eyas never deletes or clobbers what it did not write. The marker names the
kind of output (the stage), so one stage never replaces another's; and a replace removes only the
entries that stage writes (`OUTPUT_ENTRIES`): a file the user put into an eyas folder is kept.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

glob_escape = glob.escape

MARKER = ".eyas-output"
"""File eyas writes into every output directory it creates; only such directories are replaced."""


def log(msg: str) -> None:
    """One diagnostic line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def built_triton_kernels(state: dict, build: Any) -> Any:
    """`build(triton, triton.language)`'s jitted kernels, made on first use and kept as state["kernels"]; None when
    triton does not import on this machine (the reason is kept as state["error"] for `triton_kernel_unavailable`'s
    sentence). The kernel modules import triton this way only, so machines without it (CPU CI) still import eyas."""
    if "kernels" not in state and "error" not in state:
        try:
            import triton
            import triton.language as tl
        except Exception as exc:  # noqa: BLE001  (any import failure means: no kernel on this machine)
            state["error"] = f"{type(exc).__name__}: {exc}"
        else:
            state["kernels"] = build(triton, tl)
    return state.get("kernels")


def triton_kernel_unavailable(kernel: Any, device: Any, *, import_error: str | None = None) -> str | None:
    """None when the `triton.jit` function `kernel` can run on `device`; else why not, as a sentence
    for a log line. `kernel` None means triton did not import (`import_error` says why). Under
    TRITON_INTERPRET=1 (read when triton is imported) kernels run on the host, never on CUDA."""
    if kernel is None:
        return f"triton is not importable ({import_error})"
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if device.type != "cuda" and not interpreted:
        return f"device {device.type}: the Triton kernel needs CUDA (or TRITON_INTERPRET=1 when triton is imported)"
    if device.type == "cuda" and interpreted:
        return "TRITON_INTERPRET=1 runs the kernel on the host, not on CUDA"
    return None


def fmt_duration(s: float) -> str:
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 else f"{s:.0f}s"


class LineProgress:
    """progress() where stderr is not a terminal (a log file, a pipe): a line with the count, rate and ETA
    every `every` seconds, and a last one at close when any was written (a short job stays quiet)."""

    def __init__(self, total: int | None, desc: str, unit: str, *, every: float = 30.0, clock=time.monotonic):
        self.total, self.desc, self.unit, self.every, self.clock = total, desc, unit, every, clock
        self.n, self.postfix, self.lines = 0, "", 0
        self.t0 = self.last = clock()

    def line(self) -> str:
        dt = max(self.clock() - self.t0, 1e-9)
        rate = self.n / dt
        text = f"{self.desc}: {self.n:,}" + (f"/{self.total:,}" if self.total else "") + f" {self.unit}"
        text += f" | {rate:,.3g} {self.unit}/s | {fmt_duration(dt)} elapsed"
        if self.total and 0 < self.n < self.total:
            text += f" | eta {fmt_duration((self.total - self.n) / rate)}"
        return text + (f" | {self.postfix}" if self.postfix else "")

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every:
            self.last = self.clock()
            self.lines += 1
            log(self.line())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.lines:
            log(self.line())
            self.lines = 0


def progress(total: int | None, desc: str, unit: str = "it", *, disable: bool | None = None, lines: bool = True):
    """A tqdm bar on stderr where stderr is a terminal (or EYAS_PROGRESS=1), else a LineProgress (lines=False:
    nothing, for a caller that logs its own lines): either way a long job says how far it is, how fast it goes
    and when it ends. disable=True: neither."""
    from tqdm.auto import tqdm

    if disable is None and not (sys.stderr.isatty() or os.environ.get("EYAS_PROGRESS") == "1"):
        if lines:
            return LineProgress(total, desc, unit)
        disable = True
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=bool(disable), dynamic_ncols=True)


def warn_gpu_sized(cfg: Any, device: Any, *, command: str, shorter: dict[str, Any]) -> list[str]:
    """On a CPU, one warning line naming the options in `shorter` (field -> a CPU-sized value) that `cfg` leaves
    at their defaults, which are sized for a GPU; returns those options (empty: no warning)."""
    import dataclasses

    if str(device).split(":")[0] != "cpu":
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    left = [
        f"--{name.replace('_', '-')} {value}"
        for name, value in shorter.items()
        if getattr(cfg, name) == defaults.get(name)
    ]
    if left:
        log(
            f"{command}: warning: its defaults are sized for a GPU and this runs on the CPU, where they take a long "
            f"time; a CPU-sized run: {' '.join(left)}"
        )
    return left


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it where the kernel reports it (/proc/self/status on
    Linux: setting and restoring it races with other threads creating files); elsewhere set and put back."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o077)
    os.umask(old)
    return old


def umask_mode(*, directory: bool = False) -> int:
    """The mode a plain open()/mkdir() would give a new file or folder: tempfile's mkstemp/mkdtemp make them
    owner-only (0600/0700), which would keep an export or a report from anyone the user meant to share it with."""
    return (0o777 if directory else 0o666) & ~current_umask()


def honour_umask(path: Path) -> None:
    """Give a file written by a library that makes it owner-only (safetensors' save_file) the umask's mode."""
    os.chmod(path, umask_mode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one (its mode as the
    umask gives any new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False, kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to `final`.

    A crash leaves only a `.tmp` sibling, never a half-written `final` that a later stage would
    take as complete. With overwrite=False an existing `final` is an error raised by the caller.
    """
    final = Path(final)
    if final.is_symlink():  # a link to an earlier output: replace what it points to, and keep the link
        final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{glob_escape(final.name)}.*.tmp"):  # left by a killed earlier run
        if stale.is_dir() and (stale / MARKER).is_file():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        os.chmod(tmp, umask_mode(directory=True))
        write_marker(tmp, kind=kind)
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            require_owned(final, option="--overwrite", kind=kind)
            old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
            os.replace(final, old)
            os.replace(tmp, final)
            _carry_over(old, final, kind)  # a crash before the rmtree leaves the user's files in `old`, not lost
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class HTTPFailure(Exception):
    """One HTTP request that failed: `code` is the HTTP status, None when the server was not reached (`reason`)."""

    def __init__(self, url: str, *, code: int | None = None, detail: str = "", reason: str = ""):
        self.url, self.code, self.detail, self.reason = url, code, detail, reason
        super().__init__(
            f"HTTP {code} from {url}" + (f": {detail}" if detail else "") if code is not None else f"{url}: {reason}"
        )


def http_request(method: str, url: str, body: Any = None, *, timeout: float) -> bytes:
    """One request with a JSON body (or none); the answer's raw bytes. Failures are HTTPFailure: an HTTP error with
    its status and a one-line excerpt of its body, or a connection failure with its reason."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        raise HTTPFailure(url, code=exc.code, detail=http_body_excerpt(exc.read(4096))) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise HTTPFailure(url, reason=f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from None


def save_figure(fig, path: Path, *, dpi: int = 110) -> None:
    """A matplotlib figure written atomically as PNG, then closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def http_body_excerpt(body: bytes | str, *, limit: int = 120) -> str:
    """A short one-line excerpt of an HTTP error body for a message: HTML tags dropped, whitespace folded, cut."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if re.search(r"<(!doctype|html|head|body)\b", text[:500], re.IGNORECASE):
        text = re.sub(r"(?is)<(script|style|title)\b.*?</\1>", " ", text)
        text = re.sub(r"<[^>]*>", " ", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, *, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


# ----------------------------------------------------------------------------------------------
# outputs: ownership marker, --out checks


def write_marker(directory: Path, *, kind: str | None = None) -> None:
    """Mark `directory` as created by eyas (idempotent)."""
    path = Path(directory) / MARKER
    if not path.exists():
        path.write_text(json.dumps({"created_by": "eyas", "kind": kind}) + "\n")


def marker_kind(directory: Path) -> str | None:
    try:
        return json.loads((Path(directory) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


STAGE_KINDS = {"regenerate": None, "prepare": "prepare", "train": "train", "eval": "eval", "export": "exports"}
"""Kind of output of each `eyas pipeline` stage directory (regenerate's holds a selection and `run/`)."""


def output_kind(directory: Path) -> str | None:
    """The kind of eyas output `directory` is: its marker's, else what its files show (directories
    written before the marker named training runs and exports), else None (any stage may take it)."""
    d = Path(directory)
    kind = marker_kind(d)
    if kind is not None or not (d / MARKER).is_file():
        return kind
    return files_kind(d)


def files_kind(directory: Path) -> str | None:
    """The kind of eyas output the files of `directory` show, marker or not: a pipeline stage record's,
    a training run's (metrics.jsonl, checkpoints/), an export's (eyas_export.json), else None. Whether
    eyas may replace the directory is the marker's to say (is_owned), not this."""
    d = Path(directory)
    try:
        stage = json.loads((d / "stage.json").read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        stage = None
    if stage in STAGE_KINDS:
        return STAGE_KINDS[stage]
    if (d / "metrics.jsonl").is_file() or (d / "checkpoints").is_dir():
        return "train"
    return "export" if (d / "eyas_export.json").is_file() else None


# What eyas writes into an output of each kind: glob patterns on entry names; `NAME/KIND` is a directory
# holding a KIND output. Replacing or clearing an output deletes these entries (and COMMON_ENTRIES) and
# keeps every other one, so a file the user put into an eyas folder survives an --overwrite.
OUTPUT_ENTRIES: dict[str, tuple[str, ...]] = {
    "prepare": ("meta.json", "*.safetensors", "*.ids.json"),
    "store": ("manifest.json", "shard-*.safetensors", ".lock", ".ranks/ranks"),
    "ranks": ("rank-*/store",),
    "train": ("metrics.jsonl", "curves.png", "checkpoints/checkpoints", "drafter/drafter"),
    "checkpoints": ("step-*.safetensors",),
    "drafter": ("config.json", "model.safetensors"),
    "eval": ("report.json", "report.md", "acceptance.png", "sequences.jsonl"),
    "bench-serve": ("summary.json", "report.md", "throughput.png", "turns.jsonl", "results.jsonl"),
    "export": ("config.json", "model.safetensors", "eyas_export.json"),
    "exports": ("sglang/export", "vllm/export"),
    "regenerate": ("chats.jsonl", "done.jsonl", "meta.json"),
    "demo": ("prepared/prepare", "store/store", "train/train", "eval/eval", "export/exports"),
}
COMMON_ENTRIES = ("stage.json", ".*.tmp", ".*.eyas-lock")
"""In every output: the pipeline's stage record, eyas's temporary files (atomic writes, killed runs) and the lock
files of outputs inside it (eyas.locks)."""


def _eyas_entry(name: str, kind: str | None) -> tuple[bool, str | None]:
    """(whether eyas writes an entry `name` into a `kind` output, the kind of its contents if it is a directory
    of outputs)."""
    for pattern in COMMON_ENTRIES + OUTPUT_ENTRIES.get(kind or "", ()):
        pattern, _, sub = pattern.partition("/")
        if fnmatch.fnmatchcase(name, pattern):
            return True, sub or None
    return False, None


def _delete(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def remove_outputs(directory: Path, kind: str | None) -> list[str]:
    """Delete what eyas writes into the `kind` output `directory`, and the directory once nothing else is left;
    returns the entries kept (paths relative to it): the user's, which stay with the directory and its marker.
    Ownership is the caller's check (require_owned)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    kept = []
    for p in sorted(d.iterdir()):
        if p.name == MARKER:
            continue
        ours, sub = _eyas_entry(p.name, kind)
        if ours and sub and p.is_dir() and not p.is_symlink():
            kept += [f"{p.name}/{k}" for k in remove_outputs(p, sub)]
        elif ours:
            _delete(p)
        else:
            kept.append(p.name)
    if not kept:
        (d / MARKER).unlink(missing_ok=True)
        d.rmdir()
    return kept


def _carry_over(old: Path, new: Path, kind: str | None) -> None:
    """Move the entries of the replaced output `old` that eyas did not write into its replacement `new`."""
    kept = remove_outputs(old, kind)  # eyas's entries of `old` deleted; the user's listed
    for name in dict.fromkeys(k.split("/")[0] for k in kept):
        if not os.path.lexists(new / name):  # the new output's own entry replaces it
            os.replace(old / name, new / name)
    _log_kept(kept, new)


def _log_kept(kept: list[str], where: Path) -> None:
    if kept:
        log(
            f"eyas: kept {', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''} in {where}: eyas did not write "
            f"{'it' if len(kept) == 1 else 'them'}"
        )


def is_owned(directory: Path) -> bool:
    """True when `directory` carries eyas's marker (or is empty: nothing of the user's to lose)."""
    d = Path(directory)
    return (d / MARKER).is_file() or (d.is_dir() and not any(d.iterdir()))


def _output_holding(directory: Path) -> tuple[Path, str] | None:
    """(the eyas output, its kind) that `directory` is one of eyas's own entries of (a training run's drafter/),
    else None: such a folder carries no marker of its own, yet eyas wrote it."""
    kind = output_kind(Path(directory).absolute().parent)  # None without a marker
    if kind is None or not _eyas_entry(Path(directory).name, kind)[0]:
        return None
    return Path(directory).parent, kind


def require_owned(directory: Path, *, option: str = "--out", kind: str | None = None) -> None:
    """Refuse to replace or write into a non-empty directory eyas did not create (or, with `kind`,
    one eyas created for another stage: `regenerate --overwrite` must not delete a prepared dataset)."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise EyasError(f"{option} {d} is an existing file, not a directory: choose another path")
    act = "replace it" if option == "--overwrite" else "write into it"
    if d.is_dir() and not is_owned(d) and (host := _output_holding(d)) is not None:
        raise EyasError(
            f"{option}: {d} is the `{d.name}` folder of the eyas `{host[1]}` output {host[0]}, not an "
            f"output of its own; refusing to {act}: choose another --out"
        )
    if d.is_dir() and not is_owned(d):
        raise EyasError(
            f"{option}: {d} holds files eyas did not create (no {MARKER} marker); eyas never deletes or "
            "overwrites those: choose another --out, or move the directory away yourself"
        )
    found = output_kind(d) if d.is_dir() else None
    if kind is not None and found is not None and found != kind:
        raise EyasError(
            f"{option}: {d} is an eyas `{found}` output, not a `{kind}` output; refusing to {act}: choose another --out"
        )


def check_out_dir(path: Path, *, kind: str, overwrite: bool, empty_ok: bool = False) -> None:
    """Refuse, before anything is read or written, an --out directory a `kind` output cannot go to: one that
    cannot become a directory (check_out_path), one eyas did not create or created for another stage
    (require_owned, naming --overwrite when it is given), and without `overwrite` one that exists
    (`empty_ok`: unless it is empty), so --overwrite is suggested only where it would work."""
    from eyas.locks import hold

    p = Path(path)
    check_out_path(p)
    require_owned(p, option="--overwrite" if overwrite else "--out", kind=kind)
    hold(p)  # one writer at a time, from here to the end of the command
    if p.exists() and not overwrite and not (empty_ok and not any(p.iterdir())):
        raise EyasError(
            f"--out {p} already exists{' and is not empty' if empty_ok else ''}: pass --overwrite to "
            "replace it, or choose another --out"
        )


def check_out_path(path: Path | None, *, option: str = "--out") -> None:
    """Fail early (before any model loads) when `path` cannot become an output directory.

    Refused: an existing file, a path under an existing file, and a location that is not writable
    (permissions or a read-only filesystem).
    """
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise EyasError(f"{option} {p} is an existing file, not a directory: choose another path")
    _check_creatable(p, option=option)


def check_out_file(path: Path, *, option: str = "--out") -> None:
    """Fail early when `path` cannot become an output file: a directory, a path under an existing file, or
    a location that is not writable. Whether an existing file may be replaced is the caller's decision."""
    p = Path(path)
    if p.is_dir():
        raise EyasError(f"{option} {p} is a directory; give a file path")
    _check_creatable(p.parent, option=option, shown=p)


def _check_creatable(p: Path, *, option: str, shown: Path | None = None) -> None:
    """Refuse a directory `p` that cannot be created: under a file, or in a location that is not writable."""
    shown = p if shown is None else shown
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise EyasError(f"{option} {shown}: {probe} is a file, so no directory can be created under it")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only_fs(probe) else "not writable by this user"
        raise EyasError(f"{option} {shown}: {probe} is {why}; choose a writable location")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def claim_output_dir(path: Path, *, kind: str | None = None, option: str = "--out") -> Path:
    """Check `path` (check_out_path + require_owned: eyas's, and not another stage's), create it and write the
    eyas marker of `kind`."""
    from eyas.locks import hold

    p = Path(path)
    check_out_path(p, option=option)
    require_owned(p, option=option, kind=kind)
    hold(p, option=option)  # one writer at a time, from here to the end of the command
    try:
        p.mkdir(parents=True, exist_ok=True)
        write_marker(p, kind=kind)
    except OSError as exc:
        raise EyasError(f"{option} {p}: cannot create the output directory ({exc.strerror or exc})") from exc
    return p


def remove_owned_dir(path: Path, *, option: str = "--overwrite", kind: str | None = None) -> None:
    """Delete what eyas wrote into the output directory `path` of stage `kind` (default: the kind it is), and
    the directory unless files of the user's are left in it (kept); a directory eyas did not create, or
    created for another stage, is refused with its path named."""
    from eyas.locks import hold

    p = Path(path)
    if not p.exists():
        return
    require_owned(p, option=option, kind=kind)
    hold(p, option=option)  # never delete what another eyas process is writing
    _log_kept(remove_outputs(p, kind or output_kind(p)), p)


# ----------------------------------------------------------------------------------------------
# inputs


def read_text_file(path: Path, *, what: str, expected: str = "UTF-8 JSON/JSONL") -> str:
    """A text input file read as UTF-8; binary or mis-encoded files are refused naming the byte offset
    (`expected`: what the file should be, for the message)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise EyasError(f"{what} {p} is a directory, expected a file") from None
    except FileNotFoundError:
        raise EyasError(f"{what} {p} does not exist") from None
    except OSError as exc:
        raise EyasError(f"{what} {p}: cannot read it ({exc.strerror or exc})") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EyasError(
            f"{what} {p} is not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"convert it to {expected}"
        ) from None
    if "\x00" in text:
        raise EyasError(
            f"{what} {p} contains NUL bytes at offset {text.index(chr(0))}: it looks like a binary file, "
            f"expected {expected} text"
        )
    return text.removeprefix("\ufeff")


def iter_text_lines(path: Path, *, what: str) -> Iterator[str]:
    """Lines of a UTF-8 text file, streamed and split on "\\n" only (never inside content holding
    U+2028); a line that is not UTF-8 is refused naming the file and the line."""
    p = Path(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 (the `with f:` below closes it; open errors named first)
    except OSError as exc:
        raise EyasError(f"{what} {p}: cannot read it ({exc.strerror or exc})") from exc
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EyasError(
                    f"{what} {p}: line {lineno} is not UTF-8 text (invalid byte 0x{raw[exc.start]:02x}); "
                    "convert the file to UTF-8 JSONL"
                ) from None
            if "\x00" in line:
                raise EyasError(
                    f"{what} {p}: line {lineno} holds NUL bytes: it looks like a binary file, expected UTF-8 JSONL text"
                )
            yield line.removeprefix("\ufeff") if lineno == 1 else line


def check_safetensors_dir(directory: Path, *, what: str) -> None:
    """Every *.safetensors file in `directory` has a well-formed header whose tensors fit in the file,
    and config.json (when present) is a JSON object; refused naming the file otherwise. Reads headers
    only, so a garbage or truncated weights file fails before any model loads."""
    d = Path(directory)
    cfg = d / "config.json"
    if cfg.is_file():
        try:
            obj = json.loads(read_text_file(cfg, what=f"{what} config"))
        except json.JSONDecodeError as exc:
            raise EyasError(f"{what} {cfg}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(obj, dict):
            raise EyasError(f"{what} {cfg}: expected a JSON object, got {type(obj).__name__}")
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 or n <= 1 or 8 + n > size or n > 100 << 20:
                    raise ValueError("bad header length")
                header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError(f"tensors need {8 + n + end} bytes, the file has {size} (truncated)")
        except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
            raise EyasError(
                f"{what} {f} is not a valid safetensors file ({exc}); it is damaged or not a weights "
                "file: write it again (train/export)"
            ) from None


def require_finite(tensors: dict[str, Any], *, what: str, hint: str | None = None) -> None:
    """Raise EyasError naming the first tensors holding NaN/Inf (floating tensors only)."""
    import torch

    bad = [
        k
        for k, t in tensors.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        hint = hint or (
            "nothing was saved. Training diverged or its input is corrupt: run `eyas verify` on the "
            "store, lower --lr, or resume from an earlier checkpoint"
        )
        raise EyasError(f"{what}: {len(bad)} tensor(s) hold NaN/Inf ({', '.join(bad[:4])}); {hint}")


def disk_margin(job_bytes: int) -> int:
    """Free space kept beyond a job's estimated size: 5% of the job, between 1 MiB and 1 GiB."""
    return int(min(1 << 30, max(1 << 20, 0.05 * max(0, job_bytes))))
