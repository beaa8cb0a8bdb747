"""Evaluation prompts and the target's batched greedy continuation of them.

Prompts: MT-bench's 80 questions by default, both turns; the second turn is rendered after the
target's OWN first answer, so each question yields two sequences. A prompts file is JSONL, one record
per line: {"id": ..., "turns": ["first user message", "follow-up", ...]} (turns answered in order,
like MT-bench) or {"id": ..., "prompt": "one user message"}.

Generation is greedy through the regeneration's static-cache engine (eyas/regen/local.py: a full batch
kept full, CUDA graphs on a GPU) where it supports the target, else Hugging Face `generate` on
left-padded batches sorted by length. A continuation ends after the first EOS token (kept) or at
max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.common import log, progress
from eyas.errors import EyasError


@dataclass
class Conversation:
    id: str
    turns: list[str]  # user messages, answered in order
    category: str | None = None  # MT-bench's category (writing, math, ...), if the record has one


@dataclass
class Sequence:
    """One evaluated continuation: prompt ids + the target's greedy answer."""

    id: str
    turn: int  # 1-based
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    category: str | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids


def load_prompts(source: str, *, limit: int | None = None) -> list[Conversation]:
    """'mtbench' (the embedded MT-bench questions) or a JSONL file path."""
    if source == "mtbench":
        from eyas.defaults import mtbench_path

        path = mtbench_path()
    else:
        path = Path(source)
        if not path.is_file():
            raise EyasError(f"--prompts {source}: not a file and not 'mtbench'")
    from eyas.common import iter_text_lines
    from eyas.data.sources import parse_jsonl

    convs = []
    records = list(parse_jsonl(iter_text_lines(path, what="--prompts"), f"--prompts {path}"))
    for n, rec in records:
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if turns is None and isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            turns = [rec["prompt"]]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise EyasError(f'--prompts {path}:{n}: needs "turns": [str, ...] or "prompt": str')
        cid = rec.get("question_id", rec.get("id", n))
        category = rec.get("category")
        convs.append(Conversation(id=str(cid), turns=list(turns), category=str(category) if category else None))
    if not convs:
        raise EyasError(f"--prompts {path}: no prompts found")
    return convs[:limit] if limit else convs


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template ids of `messages` plus the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise EyasError("the target's tokenizer has no chat template; eval renders prompts with it")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def eos_ids_of(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update([int(e)] if isinstance(e, int) else [int(x) for x in e])
    return ids


def context_length(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 1 << 30))


def check_fits(seq: Sequence, *, max_new_tokens: int, context: int) -> None:
    need = len(seq.prompt_ids) + max_new_tokens
    if need > context:
        raise EyasError(
            f"prompt {seq.id} turn {seq.turn}: {len(seq.prompt_ids)} prompt tokens + --max-new-tokens {max_new_tokens} "
            f"= {need} exceeds the target's context of {context} tokens; shorten the prompt, lower "
            "--max-new-tokens, or drop it from --prompts"
        )


@torch.no_grad()
def greedy_generate(
    model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int, batch_size: int
) -> list[list[int]]:
    """Greedy continuations (EOS kept, nothing after it) for each prompt, in input order: the static-cache
    engine where it supports the target (per-step cost of `generate` is host time), else `generate`."""
    from eyas.regen.local import StaticEngine
    from eyas.regen.sampling import Sampling
    from eyas.regen.static_lm import unsupported_reason

    if not prompts:
        return []
    max_len = max(map(len, prompts)) + max_new_tokens
    if unsupported_reason(model, max_len) is not None:
        return hf_greedy_generate(
            model, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, batch_size=batch_size
        )
    bar = progress(len(prompts) * max_new_tokens, "generate", "tok")  # an upper bound, as below
    engine = StaticEngine(
        model,
        None,
        sampling=Sampling(),
        max_len=max_len,
        batch=min(batch_size, len(prompts)),
        max_new_tokens=max_new_tokens,
        stop=sorted(eos_ids),
    )
    try:
        return engine.answer_ids(prompts, max_new_tokens, answered=lambda res: bar.update(max_new_tokens))
    finally:
        bar.close()


@torch.no_grad()
def hf_greedy_generate(
    model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int, batch_size: int
) -> list[list[int]]:
    """greedy_generate through Hugging Face `generate` (targets the static-cache engine does not support)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    # a fresh config: the model's own may carry sampling defaults (temperature, top_p) we must not inherit
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    # progress in decode steps x rows, so a batch that runs for minutes moves the bar every step; an upper
    # bound (a batch whose rows all ended early skips its remaining steps)
    bar = progress(len(prompts) * max_new_tokens, "generate", "tok")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        streamer = StepCounter(bar, rows=len(idx), steps=max_new_tokens)
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: every row's next token is at the same column
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, streamer=streamer
        )[:, width:].tolist()
        for row, i in enumerate(idx):
            toks = gen[row]
            cut = next((j + 1 for j, t in enumerate(toks) if t in eos_ids), len(toks))
            out[i] = toks[:cut]
        streamer.finish()
    bar.close()
    return out


class StepCounter:
    """A generate() streamer that advances `bar` by `rows` for every decode step (the first put() is the
    prompt), and to the batch's full `steps` at finish()."""

    def __init__(self, bar, *, rows: int, steps: int):
        self.bar, self.rows, self.steps, self.seen, self.prompt = bar, rows, steps, 0, True

    def put(self, value) -> None:
        if self.prompt:
            self.prompt = False
            return
        if self.seen < self.steps:
            self.seen += 1
            self.bar.update(self.rows)

    def end(self) -> None:
        pass

    def finish(self) -> None:
        self.bar.update(self.rows * (self.steps - self.seen))
        self.seen = self.steps


def generate_conversations(
    model, tokenizer, convs: list[Conversation], *, max_new_tokens: int, batch_size: int
) -> list[Sequence]:
    """All turns of all conversations; turn n+1 is rendered after the target's own answer to turn n."""
    eos = eos_ids_of(model, tokenizer)
    if not eos:
        raise EyasError("the target defines no eos_token_id; cannot tell where an answer ends")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    context = context_length(model)

    def answer(batch: list[Sequence]) -> list[list[int]]:
        for seq in batch:
            check_fits(seq, max_new_tokens=max_new_tokens, context=context)
        log(f"eval: generating turn {batch[0].turn} for {len(batch)} prompts ({max_new_tokens} new tokens max)")
        return greedy_generate(
            model,
            [s.prompt_ids for s in batch],
            max_new_tokens=max_new_tokens,
            eos_ids=eos,
            pad_id=pad,
            batch_size=batch_size,
        )

    return conversation_turns(tokenizer, convs, answer)


def conversation_turns(
    tokenizer, convs: list[Conversation], answer: Callable[[list[Sequence]], list[list[int]]]
) -> list[Sequence]:
    """Every turn of every conversation, turn by turn: `answer` gets one turn's prompts of all conversations that
    have it and returns their answers; turn n+1 is rendered after the decoded answer to turn n."""
    history: list[list[dict[str, str]]] = [[] for _ in convs]
    seqs: list[Sequence] = []
    for turn in range(max(len(c.turns) for c in convs)):
        live = [i for i, c in enumerate(convs) if turn < len(c.turns)]
        batch = []
        for i in live:
            history[i].append({"role": "user", "content": convs[i].turns[turn]})
            batch.append(
                Sequence(
                    id=convs[i].id, turn=turn + 1, prompt_ids=render(tokenizer, history[i]), category=convs[i].category
                )
            )
        for i, seq, ans in zip(live, batch, answer(batch), strict=True):
            seq.generated_ids = ans
            history[i].append({"role": "assistant", "content": tokenizer.decode(ans, skip_special_tokens=True)})
        seqs += batch
    return seqs
