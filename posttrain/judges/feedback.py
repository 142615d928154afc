"""AI feedback against a constitution: critique → revision (SL-CAI) and pairwise labels (RL-CAI),
each by a chat model or by a principle's rule.

Bai et al. 2022, "Constitutional AI". §3.1 (SL-CAI): the model is shown its own response, asked a
critique request, then a revision request, each with a sampled principle; the revisions are the SFT
targets. §4.1 (RL-CAI): a feedback model is shown a prompt and two responses and asked which better
follows a sampled principle; its normalized preference is the label for a preference model.

Two kinds of feedback model, one interface each:
- `ChatReviser` / `ChatLabeler`: any `ChatBackend` (a local HF chat model — the policy itself for
  self-critique — or an OpenAI-compatible endpoint). The critique and revision turns follow the
  paper's appendix format (`CritiqueRequest:` / `RevisionRequest:` turns after the conversation).
  The labeler is our pairwise judge (pairwise.py: both orders, a tie when they disagree) with the
  principle's `preference` question as its criteria.
- `RuleReviser` / `RuleLabeler`: the principle's registered checker (checkers.py) and the rule
  reviser derived from it. On the arithmetic world the tiny policy cannot follow a critique request,
  so a rule stands in for the model: that makes the world's SL-CAI a demonstration of the data path,
  not of self-critique, and the world's RL-CAI labels equal to the gold by construction.

Departures: (1) the paper's labels are soft (the feedback model's probabilities over (A)/(B)); ours
are hard winners from the both-orders rule — a tie or unparseable pair gives no preference row;
(2) one critique/revision per sampled principle per pass (the paper also does several passes: the
stage's `revisions` sets how many).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from posttrain.data.records import Message, Problem, prompt_messages
from posttrain.judges.backend import ChatBackend, ChatRequest
from posttrain.judges.checkers import CHECKERS, rule_revision
from posttrain.judges.constitution import Principle
from posttrain.judges.pairwise import PairJudgement, Winner, judge_pairs


@dataclass(frozen=True)
class Revision:
    critique: str
    revision: str | None  # None: no usable revision (an empty reply, or a rule that cannot fix it)


class Reviser(Protocol):
    name: str

    def revise(self, problems: Sequence[Problem], responses: Sequence[str], principles: Sequence[Principle]) -> list[Revision]:
        """One critique and revision per (problem, response, principle)."""
        ...


class Labeler(Protocol):
    name: str

    def label(self, problems: Sequence[Problem], firsts: Sequence[str], seconds: Sequence[str],
              principles: Sequence[Principle]) -> list[PairJudgement]:
        """Which reply of each pair better follows its principle."""
        ...


# ---- rules ---------------------------------------------------------------------------------------------
def _need_check(p: Principle, who: str) -> str:
    if p.check is None:
        raise ValueError(f"{who}: principle {p.name!r} has no `check`; a rule reviser or labeler needs a checker for every principle")
    return p.check


class RuleReviser:
    """The principle's rule critiques (its verdict) and revises (the smallest compliant edit)."""

    name = "rule"

    def revise(self, problems: Sequence[Problem], responses: Sequence[str], principles: Sequence[Principle]) -> list[Revision]:
        out = []
        for problem, text, p in zip(problems, responses, principles, strict=True):
            critique, revision = rule_revision(_need_check(p, "rule reviser"), problem, text)
            out.append(Revision(critique, revision))
        return out


def rule_winner(check: str, problem: Problem, first: str, second: str) -> Winner:
    """The compliant reply wins; both or neither compliant (or the principle not applying) is a tie."""
    a, b = CHECKERS[check](problem, first), CHECKERS[check](problem, second)
    if a.ok == b.ok:
        return Winner.TIE
    return Winner.FIRST if a.ok else Winner.SECOND


class RuleLabeler:
    """Labels by the principle's checker: equal to the gold by construction (a data-path demonstration)."""

    name = "rule"

    def label(self, problems: Sequence[Problem], firsts: Sequence[str], seconds: Sequence[str],
              principles: Sequence[Principle]) -> list[PairJudgement]:
        out = []
        for problem, x, y, p in zip(problems, firsts, seconds, principles, strict=True):
            w = rule_winner(_need_check(p, "rule labeler"), problem, x, y)
            out.append(PairJudgement(w, (None, None), ("rule", "rule")))
        return out


# ---- chat models ---------------------------------------------------------------------------------------
def critique_messages(problem: Problem, response: str, principle: Principle) -> list[Message]:
    """The conversation, then the critique request (Bai et al. 2022, appendix C format)."""
    return [*prompt_messages(problem.prompt), Message("assistant", response),
            Message("user", f"CritiqueRequest: {principle.critique}")]


def revision_messages(problem: Problem, response: str, principle: Principle, critique: str) -> list[Message]:
    return [*critique_messages(problem, response, principle), Message("assistant", f"Critique: {critique}"),
            Message("user", f"RevisionRequest: {principle.revision} Reply with the rewritten response only.")]


def clean_revision(text: str) -> str:
    """A model's revision without a leading `Revision:` label; empty stays empty."""
    t = text.strip()
    for label in ("Revision:", "Revised response:", "RevisionResponse:"):
        if t.lower().startswith(label.lower()):
            t = t[len(label):].strip()
    return t


class ChatReviser:
    """Critique then revision by a chat model: two backend calls per batch (all critiques, then all
    revisions), greedy unless `temperature` says otherwise."""

    name = "chat"

    def __init__(self, backend: ChatBackend, *, max_tokens: int = 64, temperature: float = 0.0):
        self.backend, self.max_tokens, self.temperature = backend, max_tokens, temperature

    def revise(self, problems: Sequence[Problem], responses: Sequence[str], principles: Sequence[Principle]) -> list[Revision]:
        items = list(zip(problems, responses, principles, strict=True))
        critiques = self.backend.complete([ChatRequest(tuple(critique_messages(q, r, p)), self.max_tokens, self.temperature)
                                           for q, r, p in items])
        revisions = self.backend.complete([ChatRequest(tuple(revision_messages(q, r, p, c.strip())), self.max_tokens,
                                                       self.temperature) for (q, r, p), c in zip(items, critiques)])
        return [Revision(c.strip(), clean_revision(v) or None) for c, v in zip(critiques, revisions)]


class ChatLabeler:
    """The pairwise judge (both orders) asked each principle's `preference` question."""

    name = "chat"

    def __init__(self, backend: ChatBackend, *, max_tokens: int = 16):
        self.backend, self.max_tokens = backend, max_tokens

    def label(self, problems: Sequence[Problem], firsts: Sequence[str], seconds: Sequence[str],
              principles: Sequence[Principle]) -> list[PairJudgement]:
        out: list[PairJudgement | None] = [None] * len(problems)
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(principles):  # one judge call per principle (its criteria differ)
            groups.setdefault(p.name, []).append(i)
        for idx in groups.values():
            p = principles[idx[0]]
            got = judge_pairs(self.backend, [problems[i].prompt for i in idx], [firsts[i] for i in idx],
                              [seconds[i] for i in idx], criteria=p.preference, max_tokens=self.max_tokens)
            for i, j in zip(idx, got):
                out[i] = j
        return [j for j in out if j is not None]


def gold_of_pair(principle: Principle, problem: Problem, first: str, second: str) -> tuple[float | None, float | None]:
    """The checker's verdicts as gold rewards for `gold_agreement`: 1 complies, 0 not, None where the
    principle does not apply or has no checker (such a pair leaves the agreement count)."""
    if principle.check is None:
        return None, None
    v = [CHECKERS[principle.check](problem, t) for t in (first, second)]
    return tuple(None if not x.applies else float(x.ok) for x in v)  # type: ignore[return-value]
