"""Pairwise judging with position-bias control: each pair is judged in both orders.

LLM judges prefer a position (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot
Arena", §3.3: position bias; their remedy, §3.4: "call a judge twice by swapping the order of two
answers and only declare a win when an answer is preferred in both orders", else a tie). We do exactly
that: order 1 shows the first reply as A, order 2 shows it as B. The first reply wins when order 1
says A and order 2 says B; the second when order 1 says B and order 2 says A; the two orders
disagreeing (A and A, or B and B) is a **tie** — the judge followed the position, not the replies.
A reply the parser cannot read makes the pair **unjudged** (`winner=None`), counted, never guessed.

Parsing (`parse_choice`), case-sensitive on the letters: a reply that is just the letter (`A`, `[[B]]`,
`(A).`), or starts with it followed by punctuation (`A: …`, `B. …`), or names it (`Response A`,
`Answer: B`, `Verdict: [[A]]`, `A is better`) gives that letter — when every such cue in the reply
names the same letter. Anything else (no cue, or cues naming both) is unparseable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from posttrain.data.records import Message, Prompt, prompt_messages
from posttrain.judges.backend import ChatBackend, ChatRequest

PAIRWISE_SYSTEM = "You are an impartial judge. You compare two responses to a question and pick the better one."
PAIRWISE_TEMPLATE = """[Question]
{question}

[Response A]
{a}

[Response B]
{b}

Which response is better? {criteria}
Reply with one letter only: A or B."""
DEFAULT_CRITERIA = "A correct answer beats a wrong one; between two correct answers, the more concise one is better."

_CUES = (
    re.compile(r"^\W*([AB])\W*$"),                    # the whole reply is the letter
    re.compile(r"^\W*([AB])(?=[.:;,)\]])"),           # starts with the letter and punctuation
    re.compile(r"\[\[([AB])\]\]"),                    # [[A]] (MT-Bench's format)
    re.compile(r"\b(?:[Rr]esponse|[Aa]nswer|[Oo]ption|[Cc]hoice|[Vv]erdict|[Ww]inner)\s*(?:is\s*)?[:=]?\s*\(?([AB])\b"),
    re.compile(r"\b([AB])\s+is\s+(?:better|the better|best|preferred|correct)"),
)


class Winner(str, Enum):
    FIRST = "first"
    SECOND = "second"
    TIE = "tie"  # the two orders disagreed: position bias


@dataclass(frozen=True)
class PairJudgement:
    winner: Winner | None              # None: a reply could not be parsed
    choices: tuple[str | None, str | None]  # the letter parsed in order 1 (first = A) and order 2 (first = B)
    replies: tuple[str, str]           # the judge's raw replies, order 1 then order 2


@dataclass(frozen=True)
class PairwiseCounts:
    n: int
    first: int
    second: int
    ties: int
    unparseable: int  # pairs with at least one unparseable reply


def parse_choice(reply: str) -> str | None:
    """'A', 'B', or None (see the module docstring)."""
    found = {m.group(1) for cue in _CUES for m in cue.finditer(reply.strip())}
    return found.pop() if len(found) == 1 else None


def question_text(prompt: Prompt) -> str:
    """The prompt as the judge reads it: its non-assistant turns, one per paragraph."""
    return "\n\n".join(m.content for m in prompt_messages(prompt) if m.role != "assistant")


def pair_request(prompt: Prompt, a: str, b: str, *, criteria: str = DEFAULT_CRITERIA, max_tokens: int = 16) -> ChatRequest:
    user = PAIRWISE_TEMPLATE.format(question=question_text(prompt), a=a, b=b, criteria=criteria)
    return ChatRequest((Message("system", PAIRWISE_SYSTEM), Message("user", user)), max_tokens=max_tokens)


def combine_orders(choice_1: str | None, choice_2: str | None) -> Winner | None:
    """Order 1 shows the first reply as A, order 2 as B."""
    if choice_1 is None or choice_2 is None:
        return None
    if (choice_1, choice_2) == ("A", "B"):
        return Winner.FIRST
    if (choice_1, choice_2) == ("B", "A"):
        return Winner.SECOND
    return Winner.TIE


def judge_pairs(backend: ChatBackend, prompts: Sequence[Prompt], firsts: Sequence[str], seconds: Sequence[str], *,
                criteria: str = DEFAULT_CRITERIA, max_tokens: int = 16) -> list[PairJudgement]:
    """Judge each (prompt, first, second) in both orders: 2 requests per pair, all in one backend call."""
    if not len(prompts) == len(firsts) == len(seconds):
        raise ValueError(f"judge_pairs: {len(prompts)} prompts, {len(firsts)} firsts, {len(seconds)} seconds; expected equal")
    requests = []
    for p, x, y in zip(prompts, firsts, seconds):
        requests += [pair_request(p, x, y, criteria=criteria, max_tokens=max_tokens),
                     pair_request(p, y, x, criteria=criteria, max_tokens=max_tokens)]
    replies = backend.complete(requests)
    out = []
    for k in range(len(prompts)):
        r1, r2 = replies[2 * k], replies[2 * k + 1]
        c1, c2 = parse_choice(r1), parse_choice(r2)
        out.append(PairJudgement(combine_orders(c1, c2), (c1, c2), (r1, r2)))
    return out


def count_pairs(judgements: Sequence[PairJudgement]) -> PairwiseCounts:
    w = [j.winner for j in judgements]
    return PairwiseCounts(len(w), w.count(Winner.FIRST), w.count(Winner.SECOND), w.count(Winner.TIE), w.count(None))
