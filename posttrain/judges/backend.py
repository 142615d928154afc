"""The chat backend a judge talks to: chat requests in, reply texts out, behind one small protocol.

Two implementations: `LocalChatBackend` (local.py: any HF chat checkpoint through our rollout engine)
and `EndpointBackend` (endpoint.py: an OpenAI-compatible chat-completions server). A judge (pairwise.py,
rubric.py) sees only `ChatBackend.complete`, so the same judge runs offline on SmolLM2 or on a hosted
model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from posttrain.data.records import Message


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion to ask for. Greedy (`temperature=0`) by default: a judge should be repeatable."""

    messages: tuple[Message, ...]
    max_tokens: int = 16
    temperature: float = 0.0

    def as_json(self) -> dict:
        """The request's fields in the chat-completions body form (no model, no credentials)."""
        return {"messages": [m.as_dict() for m in self.messages], "max_tokens": self.max_tokens,
                "temperature": self.temperature}


class JudgeBackendError(RuntimeError):
    """A backend could not answer (bad configuration, a refused request, retries spent). One line;
    it never contains an API key."""


class BudgetExhausted(JudgeBackendError):
    """The endpoint's request budget is spent; answered requests are cached, so a resumed run with a
    larger budget pays only for the rest."""


@runtime_checkable
class ChatBackend(Protocol):
    name: str  # "local" or "endpoint"

    def complete(self, requests: Sequence[ChatRequest]) -> list[str]:
        """One reply text per request, in order. Raises `JudgeBackendError` when it cannot answer."""
        ...
