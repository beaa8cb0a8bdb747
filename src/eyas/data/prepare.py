"""`eyas prepare`: chats -> token ids + assistant-only loss masks, as a prepared dataset on disk.

Reads any chat source (data/sources.py), renders each conversation with the target's own chat
template (data/template.py; a large source in worker processes, one per core: the rendering is
Python and tokenizer work per chat, and the output is the same either way), applies the length
policy, splits train/eval deterministically by a hash of the sample id (stable when records are
added or removed), and writes the dataset atomically (data/prepared.py). Nothing is dropped
silently: every skipped record is counted by reason.

Disk estimate for the capture stage: tokens x (aux layers + 1) x hidden size x bytes per value
(2 for bf16; fp8 stores 1 byte plus a small per-token scale). E.g. a Kimi-K2.5-class target
(H 7168) on 21M tokens: 21e6 x 4 x 7168 x 2 B = 1.2 TB.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.common import check_out_dir, human_bytes, log, progress
from eyas.data.prepared import write_prepared
from eyas.data.sources import Conversation, iter_conversations
from eyas.data.template import _special_ids, check_template, render_chunk, render_many
from eyas.errors import EyasError

TOO_LONG = "too_long"
NO_TOKENS_LEFT = "no_assistant_tokens_left"
TRUNCATED_ANSWER = "truncated_answer"


@dataclass(kw_only=True)
class PrepareConfig:
    source: str = "sharegpt"
    """Chats: `sharegpt` (embedded default), a .json/.jsonl file (OpenAI `messages` or ShareGPT
    `conversations`), a dataset saved with save_to_disk, or an `eyas regenerate` output dir."""
    target: str = "default"
    """Target model directory (Hugging Face layout) whose tokenizer and chat template render the chats;
    `default` = embedded SmolLM2-135M-Instruct."""
    out: Path
    """Output directory of the prepared dataset."""
    max_length: int = 2048
    """Maximum tokens per sample."""
    length_policy: str = "truncate"
    """Samples longer than --max-length: `truncate` (keep the first --max-length tokens) or `drop`."""
    eval_fraction: float = 0.02
    """Fraction of samples put in the eval split (deterministic hash of the sample id)."""
    seed: int = 0
    """Seed mixed into the split hash."""
    limit: int | None = None
    """Read at most this many records (default: all)."""
    truncated_answers: str = "keep"
    """Assistant turns cut at a token limit (from `eyas regenerate`): `keep` (train on the content, not on
    the end-of-turn token), `mask` (no loss on the turn), `drop` (skip the conversation)."""
    hf_split: str | None = None
    """Split to read when --source is a saved DatasetDict."""
    aux_layer_count: int = 3
    """How many aux layers the capture will store (for the disk estimate)."""
    overwrite: bool = False
    """Replace an existing --out directory."""

    def __post_init__(self):
        if self.max_length < 2:
            raise EyasError(f"--max-length must be >= 2, got {self.max_length}")
        if self.length_policy not in ("truncate", "drop"):
            raise EyasError(f"--length-policy must be `truncate` or `drop`, got {self.length_policy!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise EyasError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.truncated_answers not in ("keep", "mask", "drop"):
            raise EyasError(f"--truncated-answers must be keep, mask or drop, got {self.truncated_answers!r}")
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"--limit must be >= 1, got {self.limit}")
        from eyas.common import check_out_path, require_owned
        from eyas.config_checks import check_number

        check_number(self, "eval_fraction", ge=0, lt=1)
        check_number(self, "aux_layer_count", ge=1)
        check_out_path(self.out)
        if self.overwrite:
            require_owned(self.out, option="--overwrite", kind="prepare")
        from eyas.config_checks import input_must_exist

        if self.source != "sharegpt" and input_must_exist() and not Path(self.source).expanduser().exists():
            raise EyasError(
                f"--source {self.source} does not exist (expected `sharegpt`, a .json/.jsonl file or a "
                "dataset directory)"
            )


def is_eval(sample_id: str, fraction: float, seed: int) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def capture_bytes(tokens: int, *, aux_layers: int, hidden_size: int, bytes_per_value: float) -> int:
    return int(tokens * (aux_layers + 1) * hidden_size * bytes_per_value)


POOL_MIN_CHATS = 4096
"""Fewer chats render in this process: starting worker processes (each imports transformers and loads the
tokenizer) would cost more than it saves."""
POOL_CHUNK = 64
"""Chats a worker renders per task: large enough that pickling the task and its result is a small share."""


def pool_workers(n_chats: int) -> int:
    """Processes that render `n_chats` chats: one per core (at most 16) for a large source, else this one (also
    inside a daemonic process, which may not start children)."""
    if n_chats < POOL_MIN_CHATS or multiprocessing.current_process().daemon:
        return 1
    return max(1, min(16, os.cpu_count() or 1))


def _rendered(cfg: PrepareConfig, target_dir: Path, tokenizer, specials, chats: list, bar, *, workers: int, chunk: int):
    """(ids, loss mask) of each chat, in order: rendered here, or by `workers` spawned processes `chunk` chats a task
    (the same `render`, with the same tokenizer loaded from `target_dir` in each; the output is identical)."""
    if workers <= 1:
        for i in range(0, len(chats), chunk):
            out = render_many(
                tokenizer,
                specials,
                [c.messages for c in chats[i : i + chunk]],
                truncated_answers=cfg.truncated_answers,
                max_tokens=cfg.max_length,
            )
            bar.update(len(out))
            yield from out
        return
    tasks = (
        (str(target_dir), [c.messages for c in chats[i : i + chunk]], cfg.truncated_answers, cfg.max_length)
        for i in range(0, len(chats), chunk)
    )
    # spawn, not fork: the parent may hold threads (tokenizers, torch) that a forked child would inherit mid-state
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for out in pool.imap(render_chunk, tasks):
            bar.update(len(out))
            yield from out


def prepare(cfg: PrepareConfig, *, workers: int | None = None, chunk: int = POOL_CHUNK) -> dict[str, Any]:
    """Run `eyas prepare`. `workers`: processes that render the chats (default `pool_workers`); `chunk`: chats per
    worker task."""
    from transformers import AutoConfig

    from eyas.defaults import resolve_target
    from eyas.target import hidden_size_of, load_tokenizer, model_identity, tokenizer_hash

    out = Path(cfg.out)
    check_out_dir(out, kind="prepare", overwrite=cfg.overwrite)
    target_dir = resolve_target(cfg.target)
    tokenizer = load_tokenizer(target_dir)
    check_template(tokenizer, f"target {target_dir}")
    hidden = hidden_size_of(AutoConfig.from_pretrained(target_dir))
    specials = _special_ids(tokenizer)

    skipped: Counter[str] = Counter()
    splits: dict[str, list] = {"train": [], "eval": []}
    infos: list = []
    truncated_samples = 0
    chats = []
    for item in iter_conversations(cfg.source, limit=cfg.limit, hf_split=cfg.hf_split, info_out=infos):
        if not isinstance(item, Conversation):
            skipped[item.reason] += 1
        elif cfg.truncated_answers == "drop" and any(m.get("truncated") for m in item.messages):
            skipped[TRUNCATED_ANSWER] += 1
        else:
            chats.append(item)
    workers = pool_workers(len(chats)) if workers is None else workers
    bar = progress(len(chats), "prepare" + (f" ({workers} processes)" if workers > 1 else ""), "conv")
    for item, (ids, mask) in zip(
        chats, _rendered(cfg, target_dir, tokenizer, specials, chats, bar, workers=workers, chunk=chunk), strict=True
    ):
        if len(ids) > cfg.max_length:
            if cfg.length_policy == "drop":
                skipped[TOO_LONG] += 1
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            truncated_samples += 1
        if not any(mask):
            skipped[NO_TOKENS_LEFT] += 1
            continue
        split = "eval" if is_eval(item.id, cfg.eval_fraction, cfg.seed) else "train"
        splits[split].append((item.id, ids, mask))
    bar.close()
    info = infos[0]
    for note in info.notes:
        log(f"eyas prepare: {note}")

    kept = sum(len(v) for v in splits.values())
    if kept == 0:
        raise EyasError(f"no usable conversations in {info.path} (skipped by reason: {dict(skipped)})")
    tokens = sum(len(s[1]) for v in splits.values() for s in v)
    assistant = sum(sum(s[2]) for v in splits.values() for s in v)
    est = {
        "bf16_bytes": capture_bytes(tokens, aux_layers=cfg.aux_layer_count, hidden_size=hidden, bytes_per_value=2),
        "fp8_bytes": capture_bytes(tokens, aux_layers=cfg.aux_layer_count, hidden_size=hidden, bytes_per_value=1),
        "formula": f"tokens x (aux layers + 1) x hidden size x bytes = {tokens} x {cfg.aux_layer_count + 1} x {hidden} x 2 (bf16)",
    }
    summary = {
        "stage": "prepare",
        "out": str(out),
        "source": info.path,
        "source_format": info.format,
        "source_records": info.records,
        "source_truncated": info.truncated,
        "source_notes": info.notes,
        "samples_kept": kept,
        "train_samples": len(splits["train"]),
        "eval_samples": len(splits["eval"]),
        "skipped": dict(sorted(skipped.items())),
        "skipped_total": sum(skipped.values()),
        "samples_truncated_to_max_length": truncated_samples,
        "tokens": tokens,
        "assistant_tokens": assistant,
        "capture_disk_estimate": est,
    }
    meta = {
        "target": model_identity(target_dir),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "hidden_size": hidden,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "summary": summary,
    }
    write_prepared(out, splits, meta, overwrite=cfg.overwrite)
    log(
        f"eyas prepare: kept {kept} of {info.records} records ({len(splits['train'])} train / "
        f"{len(splits['eval'])} eval), {tokens:,} tokens ({assistant:,} assistant); capture would need "
        f"{human_bytes(est['bf16_bytes'])} in bf16 ({human_bytes(est['fp8_bytes'])} in fp8) -> {out}"
    )
    return summary
