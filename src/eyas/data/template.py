"""Render a conversation with the target's own chat template into (token ids, loss mask).

The mask is True on the tokens the assistant must produce: each assistant turn's content and the
end-of-turn token that closes it (e.g. `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3). It is
False on system/user turns, on the assistant header (`<|im_start|>assistant\\n`) and on template
glue such as the newline after `<|im_end|>`, which the template adds, not the model.

How spans are found, without separators hard-coded for one model: render the whole conversation
once with the template, then locate every message's content in the rendered text in order (a
cursor moves forward, so repeated texts are matched to the right turn; a template that trims
content is matched on the trimmed text; matches inside special tokens are refused). Before each
assistant turn the cursor jumps to the end of the template's rendering of the history with the
generation prompt, i.e. right after the assistant header, whenever that rendering is a prefix of
the full text. One tokenisation of the rendered text with character
offsets maps content spans to tokens. After an assistant content span, the end-of-turn token is
the first special token that follows, if only whitespace lies between.

Worked example (SmolLM2 / ChatML):
    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    mask: 0 ... 0                    0 ... 0 0 0             1 1     1        0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.errors import EyasError


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[bool]
    text: str


def check_template(tokenizer, where: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise EyasError(
            f"{where}: the tokenizer has no chat template (tokenizer_config.json `chat_template` or "
            "chat_template.jinja); eyas renders conversations with the target's own template"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise EyasError(
            f"{where}: a fast (Rust) tokenizer is needed for character offsets; found {type(tokenizer).__name__}"
        )


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(idx))
    return ids


def _locate(text: str, content: str, cursor: int, special_spans: list[tuple[int, int]]) -> tuple[int, int] | None:
    """First occurrence of content (or its trimmed form) at or after cursor that does not cut
    through a special token's text: `d` must not match inside `<|im_end|>`."""
    for candidate in (content, content.strip()):
        if not candidate:
            continue
        start = text.find(candidate, cursor)
        while start >= 0:
            end = start + len(candidate)
            # A match may contain whole special tokens (content can hold `<|endoftext|>`) but must
            # not start or end inside one.
            if not any(a < start < b or a < end < b for a, b in special_spans):
                return start, end
            start = text.find(candidate, start + 1)
    return None


def render(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    truncated_answers: str = "keep",
    special_ids: set[int] | None = None,
    max_tokens: int | None = None,
) -> Rendered:
    """Render `messages` (roles system/user/assistant) to ids and the assistant-only loss mask.

    truncated_answers: for assistant turns marked {"truncated": true} (cut at a token limit by
    `eyas regenerate`): "keep" supervises the content but not the end-of-turn token (the answer
    did not end there), "mask" supervises none of the turn. ("drop" is handled by the caller.)
    max_tokens: the caller keeps at most this many tokens; very long texts are then tokenised only
    up to a character prefix that provably yields more than that many whole tokens (the result may
    be longer than max_tokens, never shorter than the full text's first max_tokens tokens).
    """
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False)
    enc = None
    if max_tokens is not None and len(text) > 16 * max_tokens:
        # Only the word that the cut splits can tokenise differently; 64 tokens of margin keep it
        # well past max_tokens.
        enc = tokenizer(text[: 16 * max_tokens], add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) <= max_tokens + 64:
            enc = None
    if enc is None:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    specials = special_ids if special_ids is not None else _special_ids(tokenizer)

    special_spans = [offsets[i] for i, t in enumerate(ids) if t in specials]
    spans: list[tuple[int, int, dict]] = []
    cursor = 0
    for k, msg in enumerate(messages):
        if max_tokens is not None and offsets and cursor >= offsets[-1][1]:
            break  # past the tokenised text: later turns lie beyond max_tokens (and rendering each one's history is quadratic)
        if msg["role"] == "assistant" and k > 0:
            # The template's own rendering of the history plus the generation prompt ends exactly
            # where the answer starts (when earlier turns render stably, which almost all do):
            # searching from there cannot match inside the header (`a` in `assistant`).
            try:
                prefix = tokenizer.apply_chat_template(plain[:k], tokenize=False, add_generation_prompt=True)
            except Exception:  # a template that refuses partial conversations: keep the cursor
                prefix = None
            if prefix is not None and text.startswith(prefix) and len(prefix) >= cursor:
                cursor = len(prefix)
        found = _locate(text, msg["content"], cursor, special_spans)
        if found is None and offsets and cursor >= offsets[-1][1]:
            break  # past the tokenised prefix: later turns fall beyond max_tokens anyway
        if found is None:
            raise EyasError(
                f"the chat template does not reproduce turn {k} ({msg['role']}) verbatim; "
                "cannot locate the assistant spans for the loss mask"
            )
        spans.append((found[0], found[1], msg))
        cursor = found[1]

    mask = [False] * len(ids)
    tok = 0
    for start, end, msg in spans:
        if msg["role"] != "assistant":
            continue
        if msg.get("truncated") and truncated_answers == "mask":
            continue
        while tok < len(ids) and offsets[tok][1] <= start:
            tok += 1
        while tok < len(ids) and offsets[tok][0] < end:
            if offsets[tok][1] > offsets[tok][0]:  # zero-width tokens carry no text
                mask[tok] = True
            tok += 1
        if msg.get("truncated"):
            continue  # the answer was cut: its end-of-turn token is not what the model said
        # The end-of-turn token: the first special token after the content, across whitespace only.
        j = tok
        while j < len(ids) and ids[j] not in specials and not text[offsets[j][0] : offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in specials:
            mask[j] = True
            tok = j + 1
    return Rendered(ids, mask, text)


_pool_tokenizers: dict[str, Any] = {}
"""In a prepare worker process: the tokenizer of each target directory, loaded on its first chunk."""


def render_chunk(task: tuple[str, list[list[dict[str, Any]]], str, int | None]) -> list[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each chat of `task` = (target directory, chats, truncated_answers, max_tokens): `render`
    in a worker process of `eyas prepare`, with the target's tokenizer loaded once per process."""
    target_dir, chats, truncated_answers, max_tokens = task
    if target_dir not in _pool_tokenizers:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target_dir)
        _pool_tokenizers[target_dir] = (tok, _special_ids(tok))
    tok, specials = _pool_tokenizers[target_dir]
    return render_many(tok, specials, chats, truncated_answers=truncated_answers, max_tokens=max_tokens)


def render_many(
    tokenizer, special_ids, chats: list[list[dict[str, Any]]], *, truncated_answers: str, max_tokens: int | None
) -> list[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each chat, rendered by `render` in order."""
    out = []
    for messages in chats:
        r = render(
            tokenizer, messages, truncated_answers=truncated_answers, special_ids=special_ids, max_tokens=max_tokens
        )
        out.append((r.input_ids, r.loss_mask))
    return out
