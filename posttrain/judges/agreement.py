"""How often a judge agrees with a gold judge, with its standard error.

Gold preferences come from a task's gold judge (`Task.gold_rewards`, docs/tasks.md: a graded reward
per reply): in a pair, the reply with the higher gold reward is the gold winner; pairs the gold judge
cannot separate (equal rewards, or None) are left out and counted. Over the n pairs left:

    rate = agree / n,   se = sqrt(rate · (1 − rate) / n)   (binomial standard error)

and the Wilson 95% interval (Wilson 1927), which stays honest at a rate of 0 or 1 where the binomial
standard error is 0 (at 0 of 60 it is [0, 0.060]) — where a judge's tie (its two orders disagreed) or an unparseable reply counts as *not* agreeing — a
judge that always answers "A" scores 0, not 50%. `decided_rate` = agree / (agree + disagree) is the
rate on the pairs the judge did decide; together with `ties` and `unparseable` it says whether a low
rate is wrong judgements or no judgements. `pairs_from_scores` turns a rubric judge's two scores per
pair into the same judgements, so both kinds of judge are measured alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from posttrain.data.records import Problem
from posttrain.judges.backend import ChatBackend
from posttrain.judges.pairwise import DEFAULT_CRITERIA, PairJudgement, Winner, judge_pairs

GoldRewards = Callable[[Sequence[Problem], Sequence[str], Sequence[str]], list["float | None"]]


@dataclass(frozen=True)
class Agreement:
    n: int                    # pairs the gold judge separates
    agree: int                # the judge picked the gold winner
    disagree: int             # the judge picked the gold loser
    ties: int                 # the judge's two orders disagreed
    unparseable: int          # a judge reply could not be read
    gold_undecided: int       # pairs left out: equal gold rewards, or a reply the gold judge cannot judge
    rate: float               # agree / n
    se: float                 # binomial standard error of rate
    interval: tuple[float, float]  # Wilson 95% interval of rate
    decided_rate: float | None  # agree / (agree + disagree); None when the judge decided no pair

    def summary(self) -> str:
        decided = "n/a" if self.decided_rate is None else f"{self.decided_rate:.3f}"
        return (f"agreement with gold {self.rate:.3f} ± {self.se:.3f} (95% CI {self.interval[0]:.3f}–{self.interval[1]:.3f}; "
                f"n={self.n}; agree {self.agree}, "
                f"disagree {self.disagree}, tie {self.ties}, unparseable {self.unparseable}; "
                f"on decided pairs {decided}; {self.gold_undecided} pairs the gold judge does not separate)")


def gold_agreement(judgements: Sequence[PairJudgement], gold_first: Sequence[float | None],
                   gold_second: Sequence[float | None]) -> Agreement:
    """Agreement of pair judgements with gold rewards of each pair's first and second reply."""
    if not len(judgements) == len(gold_first) == len(gold_second):
        raise ValueError("gold_agreement: expected one gold reward per reply of every judged pair")
    agree = disagree = ties = unparseable = undecided = 0
    for j, g1, g2 in zip(judgements, gold_first, gold_second):
        if g1 is None or g2 is None or g1 == g2:
            undecided += 1
            continue
        gold = Winner.FIRST if g1 > g2 else Winner.SECOND
        if j.winner is None:
            unparseable += 1
        elif j.winner is Winner.TIE:
            ties += 1
        elif j.winner is gold:
            agree += 1
        else:
            disagree += 1
    n = agree + disagree + ties + unparseable
    rate = agree / n if n else 0.0
    se = math.sqrt(rate * (1 - rate) / n) if n else 0.0
    decided = agree / (agree + disagree) if agree + disagree else None
    return Agreement(n, agree, disagree, ties, unparseable, undecided, rate, se, wilson(agree, n), decided)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials ((0, 1) when n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pairs_from_scores(first: Sequence[float | None], second: Sequence[float | None]) -> list[PairJudgement]:
    """A rubric judge's scores of each pair's two replies as pair judgements: the higher score wins, equal
    scores tie, an unparseable score leaves the pair unjudged — so `gold_agreement` reads both judges alike.
    (Each reply is scored on its own, so there is no position to be biased by.)"""
    out = []
    for a, b in zip(first, second, strict=True):
        winner = None if a is None or b is None else Winner.FIRST if a > b else Winner.SECOND if b > a else Winner.TIE
        out.append(PairJudgement(winner, (None, None), ("", "")))
    return out


def pairwise_gold_agreement(backend: ChatBackend, problems: Sequence[Problem], firsts: Sequence[str],
                            seconds: Sequence[str], gold_rewards: GoldRewards, *,
                            criteria: str = DEFAULT_CRITERIA) -> tuple[Agreement, list[PairJudgement]]:
    """Judge each problem's (first, second) pair in both orders and compare with the gold judge
    (`task.gold_rewards` of a task with the `gold_judge` capability; replies are taken as finished)."""
    judgements = judge_pairs(backend, [p.prompt for p in problems], firsts, seconds, criteria=criteria)
    stop = ["stop"] * len(problems)
    return gold_agreement(judgements, gold_rewards(problems, firsts, stop), gold_rewards(problems, seconds, stop)), judgements
