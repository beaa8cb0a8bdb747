"""The `sampled` arm's training data (issue 45): the recipe's greedy answers plus K answers per prompt sampled
from the target, merged into one regenerate stage folder that `eyas pipeline` prepares and the arm's runs skip.

recipe_arms.py's driver makes it once a session (`sampled_base`), after the shared base (arms/base):
  1. for k = 1..K: `eyas pipeline RECIPE --until regenerate --workdir arms/sampled-gen-sk` with the base's options
     plus regenerate.temperature=T, regenerate.top_p=P, regenerate.seed=k (every other regenerate option as base's);
  2. `merge` here: arms/base-sampled/regenerate/ = base's regenerate folder (its stage.json: the same options, so
     the same fingerprint) with chats.jsonl = base's greedy chats, byte for byte, then each sampled set's copies;
     the record's output fingerprint becomes the merged file's sha256 (what prepare's fingerprint hashes);
  3. `eyas pipeline RECIPE --until prepare --workdir arms/base-sampled`: regenerate SKIPPED, prepare RAN on the
     merged chats. Each run of the arm is seeded with that folder's regenerate/ and prepared/ and skips both.

Ids: source conversation `x`'s copy from the set of seed k is `x~s{k}` (prepare splits and the state cache keys by
id: they must be unique, and the same in every session). Held-out split: prepare puts a sample in held-out by a hash
of its id, so a copy would land there regardless of its prompt. A copy stays on its prompt's side instead: copies of
held-out prompts are left out (the held-out split is then exactly the default arm's, and its figures compare), and a
copy of a training prompt takes the first of `x~s{k}`, `x~s{k}.1`, ... that the hash puts in train.

Lab code, not an eyas option: an experiment stays in lab/ until it is measured (lab/README.md). Test:
python -m pytest -q lab/tests/test_sampled_data.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "seed")


def copy_id(prompt_id: str, seed: int, *, eval_fraction: float, split_seed: int) -> str:
    """The id of prompt `prompt_id`'s sampled copy (set of seed `seed`) that prepare's split puts in train."""
    from eyas.data.prepare import is_eval

    j = 0
    while True:
        cand = f"{prompt_id}~s{seed}" + (f".{j}" if j else "")
        if not is_eval(cand, eval_fraction, split_seed):
            return cand
        j += 1


def _record(stage_dir: Path) -> dict[str, Any]:
    from eyas.pipeline import read_record

    rec = read_record(stage_dir)
    if rec is None or rec.get("status") != "complete" or not (stage_dir / "chats.jsonl").is_file():
        raise ValueError(f"{stage_dir}: no complete regenerate stage (stage.json + chats.jsonl); run its pipeline")
    return rec


def _lines(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().split(b"\n") if line]


def merge(greedy: Path, sampled: list[Path], out: Path, *, split_from: Path) -> dict[str, Any]:
    """Write `out` (a regenerate stage folder): `greedy`'s folder with its chats followed by every sampled set's
    copies of training prompts. `greedy` and `sampled` are regenerate stage folders of pipelines that differ only
    in temperature, top_p and seed; `split_from` is the prepared stage folder whose eval_fraction and seed decide
    the held-out split. Returns the merge's summary (also recorded in out/stage.json under `lab_sampled`)."""
    from eyas.common import MARKER
    from eyas.data.prepare import is_eval
    from eyas.pipeline import NOT_IN_FINGERPRINT

    ignored = {"out", "overwrite", *NOT_IN_FINGERPRINT["regenerate"]}  # options that do not decide the chats
    g_rec = _record(greedy)
    split = json.loads((split_from / "stage.json").read_text()).get("options") or {}
    fraction, split_seed = float(split.get("eval_fraction", 0.0)), int(split.get("seed", 0))
    g_lines = _lines(greedy / "chats.jsonl")
    seen = {json.loads(line)["id"] for line in g_lines}
    if len(seen) != len(g_lines):
        raise ValueError(f"{greedy / 'chats.jsonl'}: repeated ids; expected one line per source conversation")
    g_opts = {k: v for k, v in g_rec.get("options", {}).items() if k not in ignored}
    blob = bytearray(b"\n".join(g_lines) + b"\n")
    sets, seeds = [], set()
    for stage_dir in sampled:
        rec = _record(stage_dir)
        opts = {k: v for k, v in rec.get("options", {}).items() if k not in ignored}
        differ = sorted(k for k in set(opts) | set(g_opts) if k not in SAMPLING_KEYS and opts.get(k) != g_opts.get(k))
        if differ:
            raise ValueError(f"{stage_dir}: regenerate options {differ} differ from {greedy}'s; only sampling may")
        if not opts.get("temperature") or opts.get("seed") in seeds:
            raise ValueError(
                f"{stage_dir}: temperature {opts.get('temperature')}, seed {opts.get('seed')}: expected a sampled "
                f"set (temperature > 0) whose seed no other set has ({sorted(seeds)})"
            )
        seeds.add(opts["seed"])
        added = left_out = 0
        for line in _lines(stage_dir / "chats.jsonl"):
            chat = json.loads(line)
            if is_eval(chat["id"], fraction, split_seed):
                left_out += 1  # its prompt is held out: the copy would be a training sample of a held-out prompt
                continue
            chat["id"] = copy_id(chat["id"], opts["seed"], eval_fraction=fraction, split_seed=split_seed)
            if chat["id"] in seen:
                raise ValueError(f"{stage_dir}: copy id {chat['id']!r} is already taken; the merged ids must be unique")
            seen.add(chat["id"])
            blob += json.dumps(chat, ensure_ascii=False).encode() + b"\n"
            added += 1
        sets.append(
            {
                "folder": str(stage_dir),
                **{k: opts[k] for k in SAMPLING_KEYS},
                "chats": added + left_out,
                "added": added,
                "held_out_prompts_left_out": left_out,
                "answer_tokens": rec.get("summary", {}).get("selected_answer_tokens"),  # the whole set's
            }
        )
    sha = hashlib.sha256(blob).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    if (greedy / MARKER).is_file():  # eyas's mark on a folder it wrote: the pipeline may then clear or rewrite it
        shutil.copy2(greedy / MARKER, out / MARKER)
    tmp = out / "chats.jsonl.tmp"
    tmp.write_bytes(bytes(blob))
    tmp.replace(out / "chats.jsonl")
    summary = {
        "greedy": len(g_lines),
        "greedy_answer_tokens": g_rec.get("summary", {}).get("selected_answer_tokens"),
        "sets": sets,
        "chats": len(g_lines) + sum(s["added"] for s in sets),
    }
    rec = {
        **g_rec,
        "output_fingerprint": sha,
        "summary": {
            **{k: v for k, v in g_rec.get("summary", {}).items() if k not in ("selected", "selected_answer_tokens")},
            "selected": summary["chats"],
            "lab_sampled": summary,
        },
    }
    tmp = out / "stage.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(out / "stage.json")
    return summary
