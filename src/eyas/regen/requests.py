"""What the regeneration driver asks an engine for, and what comes back.

An engine (in-process static-cache engine, Hugging Face `generate`, or an OpenAI-compatible server)
implements `run(pull, deliver)`: it calls `pull(n)` for up to n new requests whenever it has room,
and `deliver(result)` once per request, until `pull` returns nothing and no request is in flight.
`pull` may return fewer than asked (even none) while requests are still in flight: the next turn of
a conversation only exists once its previous answer has been delivered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# Failure reasons (the summary and meta.json count each one).
CONTEXT_OVERFLOW = "context_overflow"
SERVER_ERROR = "server_error"
EMPTY_ANSWER = "empty_answer"


@dataclass
class Request:
    key: tuple[int, int]
    """(conversation index in the source, turn index): unique within a run."""
    messages: list[dict[str, Any]]
    """The conversation so far, ending with the user turn to answer."""
    max_new_tokens: int
    """Answer token limit for this turn."""
    seed: int
    """32-bit stream key of this answer (see sampling.request_seed)."""


@dataclass
class Result:
    key: tuple[int, int]
    text: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    truncated: bool = False
    """True when the answer stopped at the token limit instead of an end-of-turn token."""
    failure: str | None = None
    """None, or one of CONTEXT_OVERFLOW, SERVER_ERROR, EMPTY_ANSWER."""
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    """Generated ids without the end-of-turn token (local engines only; kept for parity checks)."""
    end_id: int | None = None
    """The end-of-turn id that ended the answer (local engines; None when the answer was cut at its limit)."""


Pull = Callable[[int], list[Request]]
Deliver = Callable[[Result], None]


class Engine(Protocol):
    def run(self, pull: Pull, deliver: Deliver) -> None: ...

    def describe(self) -> dict[str, Any]: ...
