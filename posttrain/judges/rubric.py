"""Scalar (rubric) judging: the judge rates one reply on a scale; the score is parsed from its reply.

The judge is asked to end with `Score: N` for an integer N in [low, high]. `parse_score` reads the last
`Score: N` (also `score = N`, `Score: N/10`), or a reply that is only a number; a number outside
[low, high] or no number is **unparseable → None**, counted, never turned into a default score.

`RubricVerifier` puts a rubric judge behind the verifier contract (posttrain.rewards.base): called as
`verifier(completions, prompt=[...])`, it returns `Scores` normalized to [0, 1] ((N − low)/(high − low)),
with `Skip.UNJUDGEABLE` for an unparseable reply — so a judge can stand wherever a verifier can.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.data.records import Message, Prompt
from posttrain.judges.backend import ChatBackend, ChatRequest
from posttrain.judges.pairwise import question_text
from posttrain.rewards.base import Scores, Skip, check_columns

RUBRIC_SYSTEM = "You are a strict grader. You rate a response to a question against a rubric."
RUBRIC_TEMPLATE = """[Question]
{question}

[Response]
{response}

[Rubric]
{rubric}

Rate the response from {low} (worst) to {high} (best). End your reply with "Score: N"."""
DEFAULT_RUBRIC = "Is the final answer correct? Is the response concise, without rambling?"

_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+)?", re.I)
_ONLY_NUMBER = re.compile(r"^\W*(-?\d+(?:\.\d+)?)\W*$")


@dataclass(frozen=True)
class RubricResult:
    scores: list[float | None]  # per reply, on the judge's scale; None: unparseable
    replies: list[str]          # the judge's raw replies

    @property
    def unparseable(self) -> int:
        return sum(s is None for s in self.scores)


def parse_score(reply: str, *, low: int = 1, high: int = 10) -> float | None:
    found = _SCORE.findall(reply) or _ONLY_NUMBER.findall(reply.strip())
    if not found:
        return None
    value = float(found[-1])
    return value if low <= value <= high else None


def rubric_request(prompt: Prompt, response: str, *, rubric: str = DEFAULT_RUBRIC, low: int = 1, high: int = 10,
                   max_tokens: int = 32) -> ChatRequest:
    user = RUBRIC_TEMPLATE.format(question=question_text(prompt), response=response, rubric=rubric, low=low, high=high)
    return ChatRequest((Message("system", RUBRIC_SYSTEM), Message("user", user)), max_tokens=max_tokens)


def judge_scores(backend: ChatBackend, prompts: Sequence[Prompt], responses: Sequence[str], *,
                 rubric: str = DEFAULT_RUBRIC, low: int = 1, high: int = 10, max_tokens: int = 32) -> RubricResult:
    if len(prompts) != len(responses):
        raise ValueError(f"judge_scores: {len(prompts)} prompts for {len(responses)} responses; expected equal")
    replies = backend.complete([rubric_request(p, r, rubric=rubric, low=low, high=high, max_tokens=max_tokens)
                                for p, r in zip(prompts, responses)])
    return RubricResult([parse_score(t, low=low, high=high) for t in replies], list(replies))


class RubricVerifier:
    """A rubric judge as a verifier: `(completions, prompt=[...]) -> Scores` in [0, 1]."""

    def __init__(self, backend: ChatBackend, *, rubric: str = DEFAULT_RUBRIC, low: int = 1, high: int = 10):
        if not low < high:
            raise ValueError(f"RubricVerifier: low={low}, high={high}; expected low < high")
        self.backend, self.rubric, self.low, self.high = backend, rubric, low, high

    def __call__(self, completions: list[str], /, *, prompt: Sequence[Prompt]) -> Scores:
        check_columns("rubric judge", completions, prompt=prompt)
        result = judge_scores(self.backend, prompt, completions, rubric=self.rubric, low=self.low, high=self.high)
        values = [None if s is None else (s - self.low) / (self.high - self.low) for s in result.scores]
        return Scores(values, [Skip.UNJUDGEABLE if v is None else None for v in values])
