"""The regenerated chat dataset on disk, committed in chunks so a killed run resumes exactly.

Layout of the output directory (schema "eyas.chats/1", read by `eyas prepare`):
    chats.jsonl  one conversation per line: {"id", "messages": [{"role", "content",
                 "truncated": true (assistant turns cut at the token limit only)}]}
    done.jsonl   one line per source conversation decided (written or skipped), with its source
                 index, id, status, reason and answer tokens: what resume skips, and what the counts
                 in meta.json are rebuilt from
    meta.json    target identity, sampling settings, source, counts, `complete`, and `committed`:
                 the byte lengths of chats.jsonl and done.jsonl at the last commit

A commit appends whole lines to both files, fsyncs them, then atomically replaces meta.json. On
resume both files are cut back to the committed lengths, so a record written after the last commit
(possibly torn by a kill) is dropped and its conversation redone: nothing is duplicated and no
partial record survives. Settings that change the answers (target, sampling, limits, source) must
match the run being resumed; otherwise the error says to pick a new --out or pass --overwrite.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eyas.common import atomic_write_json, claim_output_dir, fsync_dir, remove_owned_dir
from eyas.errors import EyasError

SCHEMA = "eyas.chats/1"
CHATS, DONE, META = "chats.jsonl", "done.jsonl", "meta.json"


def settings_differ(old: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings keys whose values differ between a recorded run and this one (empty: it resumes)."""
    now = dict(now)
    if isinstance(old.get("target"), dict) and isinstance(now.get("target"), dict):
        # identity fields added by a newer eyas (e.g. sampled weight hashes) do not block a resume
        now["target"] = {k: v for k, v in now["target"].items() if k in old["target"]}
    return sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))


def check_out_before_load(out: Path, settings: dict[str, Any], *, overwrite: bool) -> dict[str, Any] | None:
    """Refuse an existing --out that is not a regenerate output, or (without `overwrite`) holds a run with
    other settings, reading meta.json only, so that `eyas regenerate` can refuse it before any model loads
    (ChatsWriter checks the same way). Returns the recorded meta of a run that resumes, else None."""
    from eyas.locks import hold

    out = Path(out)
    if not out.is_dir() or not any(out.iterdir()):
        hold(out)
        return None
    if not (out / META).is_file():
        if overwrite:
            raise EyasError(f"--overwrite: {out} is not a regenerate output (no meta.json); refusing to delete it")
        raise EyasError(f"--out {out} exists and is not a regenerate output (no meta.json); choose a new directory")
    hold(out, option="--overwrite" if overwrite else "--out")  # one writer: two would append the same chats twice
    if overwrite:
        return None
    meta = _read_meta(out)
    _check_meta(out, meta, settings)
    return meta


def _read_meta(out: Path) -> dict[str, Any]:
    try:
        meta = json.loads((out / META).read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise EyasError(
            f"{out / META}: unreadable ({exc}); pass --overwrite to start over, or choose a new --out"
        ) from None
    if not isinstance(meta, dict):
        raise EyasError(f"{out / META}: expected a JSON object; pass --overwrite to start over, or choose a new --out")
    return meta


def _check_meta(out: Path, meta: dict[str, Any], settings: dict[str, Any]) -> None:
    """A recorded run resumes only with the same schema and settings."""
    if meta.get("schema") != SCHEMA:
        raise EyasError(f"{out / META}: schema {meta.get('schema')!r}, expected {SCHEMA!r}; choose a new --out")
    diff = settings_differ(meta.get("settings", {}), settings)
    if diff:
        raise EyasError(
            f"--out {out} holds a run with different settings ({', '.join(diff)}); "
            "rerun with the same settings to resume, pass --overwrite to start over, or choose a new --out"
        )


def _cut(path: Path, size: int) -> None:
    if not path.exists():
        if size:
            raise EyasError(
                f"{path} is missing but meta.json says {size} bytes were committed; start over with --overwrite"
            )
        path.touch()
        return
    actual = path.stat().st_size
    if actual < size:
        raise EyasError(
            f"{path} has {actual} bytes but {size} were committed (file damaged); start over with --overwrite"
        )
    if actual > size:
        with open(path, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())


class ChatsWriter:
    """Append-only chats + decisions with chunked, atomic commits; resumable."""

    def __init__(self, out: Path, *, settings: dict[str, Any], extra_meta: dict[str, Any], overwrite: bool = False):
        self.out = Path(out)
        self.settings = settings
        self.extra_meta = dict(extra_meta)
        self.done: dict[int, str] = {}  # source index -> id
        self.decisions: list[dict[str, Any]] = []  # every done.jsonl line (for the counts)
        self.elapsed_before = 0.0
        self.resumed = False
        meta = check_out_before_load(self.out, settings, overwrite=overwrite)  # never a directory that is not ours
        if overwrite and self.out.is_dir() and any(self.out.iterdir()):
            remove_owned_dir(self.out, kind="regenerate")  # only what regenerate wrote there; the user's files stay
        if meta is not None:
            self._resume(meta)
        else:
            claim_output_dir(self.out, kind="regenerate")
            for name in (CHATS, DONE):
                (self.out / name).touch()
            self.committed = {"chats_bytes": 0, "done_bytes": 0}
            self.created = time.time()
            self._write_meta(complete=False)
        self._chats_buf: list[str] = []
        self._done_buf: list[str] = []

    def _resume(self, meta: dict[str, Any]) -> None:
        self.committed = dict(meta["committed"])
        self.created = meta.get("created", time.time())
        self.elapsed_before = float(meta.get("elapsed_s", 0.0))
        _cut(self.out / CHATS, self.committed["chats_bytes"])
        _cut(self.out / DONE, self.committed["done_bytes"])
        with open(self.out / DONE, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                self.done[int(rec["index"])] = rec["id"]
                self.decisions.append(rec)
        self.resumed = True

    # -- recording -------------------------------------------------------------------------------
    def check_source(self, index: int, conv_id: str) -> bool:
        """True when this source conversation was already decided (and it is the same one)."""
        seen = self.done.get(index)
        if seen is None:
            return False
        if seen != conv_id:
            raise EyasError(
                f"resume: source conversation {index} is now `{conv_id}` but the run being resumed recorded `{seen}`; "
                "the source changed. Pass --overwrite to start over or choose a new --out"
            )
        return True

    def add(
        self,
        index: int,
        conv_id: str,
        record: dict[str, Any] | None,
        *,
        reason: str | None = None,
        failures: list[str] = (),
        tokens: int = 0,
        turns: int = 0,
        truncated: int = 0,
    ) -> None:
        """Buffer one decided conversation: `record` to write, or None (skipped for `reason`)."""
        decision = {
            "index": index,
            "id": conv_id,
            "status": "written" if record is not None else "skipped",
            "reason": reason,
            "failures": list(failures),
            "tokens": tokens,
            "turns": turns,
            "truncated": truncated,
        }
        if record is not None:
            self._chats_buf.append(json.dumps(record, ensure_ascii=False) + "\n")
        self._done_buf.append(json.dumps(decision) + "\n")
        self.decisions.append(decision)
        self.done[index] = conv_id

    @property
    def buffered(self) -> int:
        return len(self._done_buf)

    def commit(self, *, elapsed_s: float, complete: bool = False) -> None:
        for name, buf, key in ((CHATS, self._chats_buf, "chats_bytes"), (DONE, self._done_buf, "done_bytes")):
            if buf:
                data = "".join(buf).encode("utf-8")
                with open(self.out / name, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self.committed[key] += len(data)
            buf.clear()
        self._write_meta(complete=complete, elapsed_s=elapsed_s)
        fsync_dir(self.out)

    # -- meta ------------------------------------------------------------------------------------
    def counts(self) -> dict[str, Any]:
        skipped = Counter(d["reason"] for d in self.decisions if d["status"] == "skipped")
        failures = Counter(f for d in self.decisions for f in d.get("failures", []))
        written = [d for d in self.decisions if d["status"] == "written"]
        return {
            "conversations": len(self.decisions),
            "written": len(written),
            "skipped": dict(sorted(skipped.items())),
            "failed_turns": dict(sorted(failures.items())),
            "assistant_turns": sum(d["turns"] for d in written),
            "truncated_turns": sum(d["truncated"] for d in written),
            "answer_tokens": sum(d["tokens"] for d in self.decisions),
        }

    def _write_meta(self, *, complete: bool, elapsed_s: float = 0.0) -> None:
        meta = {
            "schema": SCHEMA,
            "complete": complete,
            "settings": self.settings,
            **self.extra_meta,
            "counts": self.counts(),
            "committed": self.committed,
            "created": self.created,
            "updated": time.time(),
            "elapsed_s": round(self.elapsed_before + elapsed_s, 3),
        }
        atomic_write_json(self.out / META, meta)


def read_chats(out: Path) -> list[dict[str, Any]]:
    """The committed records of an output directory (for tests and tools)."""
    meta = json.loads((Path(out) / META).read_text())
    data = (Path(out) / CHATS).read_bytes()[: meta["committed"]["chats_bytes"]]
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line]  # not splitlines(): U+2028
