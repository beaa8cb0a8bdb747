"""`eyas eval --answers DIR`: evaluate on the target answers an earlier `eyas eval` recorded, not on new ones.

Why: drafters compared on one set of answers differ only by the drafters (greedy answers in bf16 can differ
between processes: batch composition and kernels change near-ties), and the evaluation skips the target's
generation. The answers are the continuation the replay accepts against, so they carry over to another device
or dtype. They must come from the same target (config, weights, tokenizer), at the same --max-new-tokens, for
the same prompts: every prompt is rendered again and must equal the recorded prompt ids (later turns are
rendered after the recorded earlier answers, so another prompts file or chat template is caught). A --limit
below the recorded run's takes the first conversations' answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.specdec.generate import Sequence

FILES = ("report.json", "sequences.jsonl")


@dataclass
class RecordedAnswers:
    """An earlier evaluation's answers, by (conversation id, turn)."""

    source: Path
    report: dict[str, Any]
    answers: dict[tuple[str, int], Sequence]

    def provenance(self) -> dict[str, Any]:
        """What the new report records of them: where from and how they were made."""
        settings = self.report.get("settings", {})
        return {"source": str(self.source.resolve()), "device": settings.get("device"), "dtype": settings.get("dtype")}


def read_answers(directory: str | Path, *, max_new_tokens: int) -> RecordedAnswers:
    """The answers of the `eyas eval` report directory `directory`, checked for what needs no model."""
    from eyas.specdec.run import SCHEMA

    where = f"--answers {directory}"
    directory = Path(directory)
    for name in FILES:
        if not (directory / name).is_file():
            raise EyasError(f"{where}: no {name} (expected an `eyas eval` --out directory)")
    try:
        report = json.loads((directory / "report.json").read_text())
    except (OSError, ValueError) as exc:
        raise EyasError(f"{where}: report.json is not readable JSON ({exc})") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise EyasError(f"{where}: report.json is not an `eyas eval` report (schema {SCHEMA})")
    recorded = report.get("settings", {}).get("max_new_tokens")
    if recorded != max_new_tokens:
        raise EyasError(
            f"{where}: its answers were generated with --max-new-tokens {recorded}, this evaluation asks for "
            f"{max_new_tokens}: pass the same, or drop --answers to generate them"
        )
    raw = (directory / "sequences.jsonl").read_bytes()
    answers: dict[tuple[str, int], Sequence] = {}
    for n, line in enumerate(raw.decode().splitlines(), 1):
        seq = _sequence(line, max_new_tokens=max_new_tokens, where=f"{where}: sequences.jsonl:{n}")
        answers[(seq.id, seq.turn)] = seq
    expected = report.get("generation", {}).get("sequences")
    if len(answers) != expected:
        raise EyasError(
            f"{where}: sequences.jsonl holds {len(answers)} distinct answers, its report.json {expected}: "
            "the file was cut or edited; run that evaluation again"
        )
    return RecordedAnswers(directory, report, answers)


def digest(seqs) -> str:
    """sha256 of the prompts and answers of `seqs` (whatever their order): equal for the same answer set."""
    rows = sorted([s.id, s.turn, s.prompt_ids, s.generated_ids] for s in seqs)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def answers_digest(directory: Path) -> str | None:
    """sha256 of the prompts and answers in `directory`/sequences.jsonl (not of the drafter's acceptance the file
    also holds), for the pipeline's fingerprint; None where it cannot be read (evaluating says why)."""
    try:
        lines = (Path(directory) / "sequences.jsonl").read_text().splitlines()
        seqs = (_sequence(line, max_new_tokens=1 << 30, where="") for line in lines)
        return digest({(s.id, s.turn): s for s in seqs}.values())
    except (OSError, ValueError, EyasError):
        return None


def _sequence(line: str, *, max_new_tokens: int, where: str) -> Sequence:
    try:
        rec = json.loads(line)
        ids = {k: [int(i) for i in rec[k]] for k in ("prompt_ids", "generated_ids")}
        seq = Sequence(id=str(rec["id"]), turn=int(rec["turn"]), category=rec.get("category"), **ids)
    except (ValueError, TypeError, KeyError) as exc:
        raise EyasError(f"{where}: not an answer record (id, turn, prompt_ids, generated_ids): {exc}") from None
    if not seq.prompt_ids or len(seq.generated_ids) > max_new_tokens:
        raise EyasError(f"{where}: an empty prompt, or more than --max-new-tokens {max_new_tokens} answer tokens")
    return seq


def check_same_target(rec: RecordedAnswers, now: dict[str, Any], *, target_path: Path) -> None:
    """Refuse answers another target gave: `now` is the target's model_identity with its tokenizer_hash."""
    from eyas.target import identity_differences

    then = {**rec.report.get("target", {}), "tokenizer_hash": rec.report.get("tokenizer_sha256")}
    differ = identity_differences(then, now)
    if differ:
        raise EyasError(
            f"--answers {rec.source}: answered by target {then.get('path')}, not --target {target_path} (their "
            f"{', '.join(differ)} differ): evaluate with the target that gave them, or drop --answers"
        )


def answer_from(rec: RecordedAnswers) -> Callable[[list[Sequence]], list[list[int]]]:
    """generate_conversations' answer step, served from the recorded answers (prompts checked id for id)."""

    def answer(batch: list[Sequence]) -> list[list[int]]:
        out = []
        for seq in batch:
            got = rec.answers.get((seq.id, seq.turn))
            if got is None:
                raise EyasError(
                    f"--answers {rec.source}: no answer to prompt {seq.id} turn {seq.turn} (it answered other "
                    "prompts: pass its --prompts and at most its --limit)"
                )
            if got.prompt_ids != seq.prompt_ids:
                raise EyasError(
                    f"--answers {rec.source}: prompt {seq.id} turn {seq.turn} renders to other ids than the answered "
                    "one (another prompts file, or another chat template)"
                )
            out.append(list(got.generated_ids))
        return out

    return answer
