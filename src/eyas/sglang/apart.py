"""The SGLang capture's transformers work, in a child process of its own (`Apart`).

Importing transformers, loading the target's tokenizer and the calibration's reference model are seconds of Python
holding the GIL: beside the capture's loop in its process, every row the loop stores would wait behind them. The
child runs them one request at a time, in order, and keeps the reference model loaded between requests, so the
calibration needs no load of its own.

`Apart()` spawns the child (a forked copy of a threaded process can deadlock); `call(name, **kw)` gives a Future of
`OPS[name](state, **kw)` run there (its exception is the Future's); `close()` ends it. `started_in_thread` runs the
same loop on a thread of this process instead (tests: a child's start costs seconds, and stand-ins a test sets in
this process reach no child).
"""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = None


def tokenizer_hash(state: dict, *, target: str) -> str:
    """The target's tokenizer hash (load_tokenizer resolves the target: its model type is checked)."""
    from eyas.target import load_tokenizer, tokenizer_hash

    return tokenizer_hash(load_tokenizer(target))


def check_model_type(state: dict, *, target: str) -> None:
    """Only the model-type check of the target (data prepared without a tokenizer hash)."""
    from eyas.defaults import resolve_target

    resolve_target(target)


def load_reference(state: dict, *, manifest: dict[str, Any], target: str, device: str) -> None:
    """Load verify's reference model for the store of `manifest`; it stays here for `calibrate`."""
    from eyas.store.verify import _load_reference_target

    state["reference"] = _load_reference_target(manifest, target, device)


def calibrate(
    state: dict, *, store: str, prepared: str, split: str, target: str, device: str, samples: int, engine: dict
) -> dict[str, Any]:
    """The store's `engine_numerics` record (eyas.store.numerics.calibrate_store), with the loaded reference."""
    from eyas.data.prepared import PreparedDataset
    from eyas.store.numerics import calibrate_store

    split_ = PreparedDataset(prepared).split(split)
    model = state.get("reference")
    return calibrate_store(store, split_, target, device=device, samples=samples, engine=engine, model=model)


OPS: dict[str, Callable[..., Any]] = {
    "tokenizer_hash": tokenizer_hash,
    "check_model_type": check_model_type,
    "load_reference": load_reference,
    "calibrate": calibrate,
}


def serve(tasks, results) -> None:
    """The child's loop: each (name, kwargs) from `tasks` answered on `results` with ("ok", value) or ("error",
    exception), until None."""
    state: dict[str, Any] = {}
    while (task := tasks.get()) is not _STOP:
        name, kw = task
        try:
            answer = ("ok", OPS[name](state, **kw))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, who raises it)
            answer = ("error", exc)
        try:
            pickle.dumps(answer)  # as the queue will, on a thread of its own that would drop it silently
        except Exception as exc:  # an answer that does not pickle: its kind and text still reach the caller
            answer = ("error", RuntimeError(f"{name}: {type(answer[1]).__name__}: {answer[1]} ({exc})"))
        results.put(answer)


def started_in_process():
    """A spawned child running `serve`: (tasks, results, the process)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.SimpleQueue(), ctx.Queue()
    proc = ctx.Process(target=serve, args=(tasks, results), daemon=True, name="eyas-capture-apart")
    proc.start()
    return tasks, results, proc


def started_in_thread():
    """`serve` on a thread of this process: (tasks, results, the thread)."""
    tasks, results = queue.Queue(), queue.Queue()
    thread = threading.Thread(target=serve, args=(tasks, results), daemon=True, name="eyas-capture-apart")
    thread.start()
    return tasks, results, thread


class Apart:
    """The child that runs OPS for the capture (module docstring). Calls run one at a time, in the order made."""

    def __init__(self, start: Callable[[], tuple] | None = None):
        self._tasks, self._results, self._worker = (start or started_in_process)()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-capture-apart-calls")

    def call(self, name: str, **kw) -> cf.Future:
        return self._pool.submit(self._call, name, kw)

    def _call(self, name: str, kw: dict):
        self._tasks.put((name, kw))
        while True:
            try:
                status, value = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._worker.is_alive():
                    code = getattr(self._worker, "exitcode", None)
                    raise RuntimeError(
                        f"the capture's child process for {name} ended (exit {code}; its error is in the log above; "
                        "a script that captures must run under `if __name__ == '__main__':`, since the spawned child "
                        "imports that script)"
                    ) from None
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        """End the child without waiting for it: calls not begun are dropped; it ends after the one running, if any
        (a daemon: never after this process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._tasks.put(_STOP)
