"""How a training run stops early: a clean stop between steps on SIGINT/SIGTERM (StopRequest), compile workers that
outlive such a stop, and what an interrupted or failed run tells the user and frees (used by train/loop.py `run`)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any


class StopRequest:
    """SIGINT/SIGTERM during the loop: the current step finishes, a checkpoint is saved, and the run
    stops (`signum` is set; the loop reads it between steps). A second signal (SIGINT or SIGTERM)
    stops at once, without that checkpoint. Handlers can only be installed from the main thread;
    elsewhere signals keep their default behaviour."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._old.clear()

    def _handle(self, signum, frame):
        # no logging here: the handler may run in the middle of the loop's own write to stderr
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = self.signum or signum


def start_compile_workers_shielded() -> None:
    """Start torch inductor's compile workers now, with SIGINT and SIGTERM ignored (a disposition they
    inherit), instead of at the first compile inside the loop.

    A SIGTERM sent to the whole process group (`timeout`, a batch scheduler's preemption) otherwise
    kills those workers while the run itself, asked to stop, finishes its step; a compile after that
    (the final evaluation's first) sends its jobs to the dead workers, whose replies never come: the
    parent keeps both ends of their pipes open, so no end of file is read (read from torch's code). On
    an H200 a SmolLM2 run under `timeout 120` hung 20 minutes at its final evaluation, until killed,
    with the workers' process dead and unreaped and a thread blocked reading its pipe. Shielded, the
    workers live until the run exits (they end when their parent's pipe closes). Uses torch's own
    warm-up (`maybe_warm_pool`), so nothing starts where torch would not start a pool
    (TORCH_WARM_POOL=0, no Triton); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # (a torch without inductor's pool: nothing to shield)
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        maybe_warm_pool()
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def continue_hint(cfg) -> str:
    return "rerun the same command" if cfg.resume == "auto" else "rerun the same command with --resume auto"


def interrupted_message(cfg) -> str:
    """What an interrupt outside the loop's clean stop leaves: the latest checkpoint, if any."""
    from eyas.train.checkpoint import CKPT_RE, latest_checkpoint

    path = latest_checkpoint(Path(cfg.out) / "checkpoints")
    if path is None:
        return "no training step was saved, so a rerun starts from step 0"
    step = int(CKPT_RE.match(path.name).group(1))
    return f"the latest checkpoint is {path} (step {step}); {continue_hint(cfg)} to continue from it"


def peer_stopped(exc: BaseException) -> bool:
    """A collective that failed because another rank left the group (gloo: the peer's connection closed or
    reset; NCCL: the communicator aborted by the peer's teardown), not an error of this rank's own."""
    text = str(exc)  # (by its words: a DistBackendError can also be this rank's own, a CUDA error in NCCL say)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("by peer", "Connection closed", "Connection reset", "communicator was aborted")
    )


def clear_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames in exc's traceback (and those of its cause and
    context): the failed run's model, optimizer and DDP reducer go now, not when the traceback does, so
    the process group they reference can be freed by the teardown. Line numbers stay for printing."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # skips the frames still running (run's own)
        if exc.__cause__ is not None and id(exc.__cause__) not in seen:
            clear_frames(exc.__cause__)
        exc = exc.__context__
