"""Judges (posttrain.judges): parsing a judge's reply, both orders and ties, rubric scores, agreement with
a gold judge (hand-counted), and the local HF backend's plumbing on a tiny model."""

from __future__ import annotations

import math
import re

import pytest

from posttrain.data import Message
from posttrain.judges import (
    ChatBackend,
    ChatRequest,
    LocalChatBackend,
    PairJudgement,
    RubricVerifier,
    Winner,
    combine_orders,
    count_pairs,
    gold_agreement,
    judge_pairs,
    judge_scores,
    pairs_from_scores,
    pairwise_gold_agreement,
    parse_choice,
    parse_score,
)
from posttrain.rewards.base import Skip

pytestmark = pytest.mark.usefixtures("one_thread")


class Scripted:
    """A chat backend answering by a rule over the request (the protocol, in-process: the logic tests)."""

    name = "scripted"

    def __init__(self, rule):
        self.rule, self.requests = rule, []

    def complete(self, requests):
        self.requests += list(requests)
        return [self.rule(r.messages[-1].content) for r in requests]


def _response(text: str, letter: str) -> str:
    return re.search(rf"\[Response {letter}\]\n(.*?)(?:\n\n\[|\nWhich)", text, re.S).group(1)


@pytest.mark.parametrize("reply, choice", [
    ("A", "A"), (" B\n", "B"), ("[[A]]", "A"), ("(B).", "B"), ("A: it is correct", "A"), ("B. Shorter.", "B"),
    ("Response B", "B"), ("The answer: A", "A"), ("Verdict: [[B]]", "B"), ("I think A is better.", "A"),
    ("A good answer is hard to find", None),   # the article, not a choice
    ("Response A is longer but Response B is right", None),  # cues name both letters
    ("Both are fine", None), ("", None), ("a", None),
])
def test_parse_choice(reply, choice):
    assert parse_choice(reply) == choice


def test_combine_orders():
    # order 1 shows the first reply as A, order 2 shows it as B
    assert combine_orders("A", "B") is Winner.FIRST and combine_orders("B", "A") is Winner.SECOND
    assert combine_orders("A", "A") is Winner.TIE and combine_orders("B", "B") is Winner.TIE  # position bias
    assert combine_orders("A", None) is None


def test_judge_pairs_asks_both_orders_and_counts():
    # the rule prefers the response that holds "4": a consistent judge, so no ties
    judge = Scripted(lambda t: "A" if "4" in _response(t, "A") else "B")
    out = judge_pairs(judge, ["2+2?", "2+2?", "1+1?"], ["4", "5", "two"], ["5", "4", "three"])
    # pair 1: order 1 (A=4, B=5) → A, order 2 (A=5, B=4) → B: the first wins; pair 2 the mirror image;
    # pair 3: neither holds "4", so the rule says B in both orders — the position decided: a tie
    assert [j.winner for j in out] == [Winner.FIRST, Winner.SECOND, Winner.TIE]
    assert [j.choices for j in out] == [("A", "B"), ("B", "A"), ("B", "B")]
    assert len(judge.requests) == 6 and _response(judge.requests[1].messages[-1].content, "A") == "5"
    assert judge.requests[0].messages[0].role == "system" and judge.requests[0].temperature == 0.0
    counts = count_pairs(out + [PairJudgement(None, (None, "A"), ("?", "A"))])
    assert (counts.n, counts.first, counts.second, counts.ties, counts.unparseable) == (4, 1, 1, 1, 1)


@pytest.mark.parametrize("reply, score", [
    ("Score: 7", 7.0), ("The answer is right but long. Score: 6/10", 6.0), ("score = 9", 9.0), ("8", 8.0),
    ("Score: 2. On reflection, Score: 4", 4.0),  # the last one counts
    ("Score: 11", None), ("Score: 0", None),       # outside 1..10
    ("It is good.", None), ("7 or 8", None),
])
def test_parse_score(reply, score):
    assert parse_score(reply, low=1, high=10) == score


def test_rubric_judge_and_verifier_count_unparseable_replies():
    replies = iter(["Score: 10", "no idea", "Score: 4"])
    judge = Scripted(lambda t: next(replies))
    result = judge_scores(judge, ["q1", "q2", "q3"], ["r1", "r2", "r3"])
    assert result.scores == [10.0, None, 4.0] and result.unparseable == 1
    replies = iter(["Score: 10", "no idea", "Score: 4"])
    scores = RubricVerifier(judge)(["r1", "r2", "r3"], prompt=["q1", "q2", "q3"])
    # (10 − 1)/9 = 1.0, unparseable → None (unjudgeable), (4 − 1)/9 = 0.333
    assert scores == [1.0, None, pytest.approx(1 / 3)] and scores.reasons == [None, Skip.UNJUDGEABLE, None]


def test_gold_agreement_arithmetic():
    F, S, T = Winner.FIRST, Winner.SECOND, Winner.TIE
    js = [PairJudgement(w, ("A", "B"), ("", "")) for w in [F, F, F, S, T, None, F, F]]
    g1 = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.5, None]
    g2 = [0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    a = gold_agreement(js, g1, g2)
    # gold separates pairs 1–6 (pair 7 equal, pair 8 unknown): n = 6; agree: 1, 2; disagree: 3 (gold
    # second), 4 (judge second, gold first); tie: 5; unparseable: 6 → rate 2/6, se = sqrt(1/3·2/3/6) = 0.192
    assert (a.n, a.agree, a.disagree, a.ties, a.unparseable, a.gold_undecided) == (6, 2, 2, 1, 1, 2)
    assert a.rate == pytest.approx(1 / 3) and a.se == pytest.approx(math.sqrt(1 / 3 * 2 / 3 / 6))
    assert a.decided_rate == pytest.approx(0.5)  # 2 of the 4 decided
    # Wilson, z² = 3.8416: centre (1/3 + 3.8416/12) / (1 + 3.8416/6) = 0.6535/1.6403 = 0.3984,
    # half 1.96·sqrt(2/9/6 + 3.8416/144) / 1.6403 = 0.3016 → [0.0968, 0.7000]
    assert a.interval == pytest.approx((0.0968, 0.7000), abs=1e-4)
    none = gold_agreement([PairJudgement(T, ("A", "A"), ("", ""))] * 60, [1.0] * 60, [0.0] * 60)
    # 0 of 60: se 0, but Wilson's upper end is 3.8416/60 / (1 + 3.8416/60) = 0.0602
    assert (none.rate, none.se) == (0.0, 0.0) and none.interval == pytest.approx((0.0, 0.0602), abs=1e-4)


def test_rubric_scores_as_pair_judgements():
    # higher score wins, equal scores tie, an unparseable score leaves the pair unjudged
    out = pairs_from_scores([9.0, 2.0, 5.0, None], [3.0, 8.0, 5.0, 7.0])
    assert [j.winner for j in out] == [Winner.FIRST, Winner.SECOND, Winner.TIE, None]
    a = gold_agreement(out, [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])  # gold: the first reply every time
    assert (a.agree, a.disagree, a.ties, a.unparseable, a.rate) == (1, 1, 1, 1, 0.25)


def test_agreement_with_the_arithmetic_gold_judge(world):
    import random

    from posttrain.tasks.arithmetic import ArithmeticTask, fact_of
    from posttrain.worlds.arithmetic import concise_answer, wrong_answer

    task = ArithmeticTask(world=world)
    problems = task.records("problem", 6, levels=["L2"])
    rng = random.Random(0)
    good = [concise_answer(fact_of(p)) for p in problems]
    bad = [wrong_answer(fact_of(p), rng) for p in problems]
    firsts = [g if i % 2 else b for i, (g, b) in enumerate(zip(good, bad))]  # the correct reply first in odd pairs
    seconds = [b if i % 2 else g for i, (g, b) in enumerate(zip(good, bad))]
    answers = {p.prompt: str(p.answer) for p in problems}

    def oracle(text):  # picks the response whose final number is the answer: agrees with gold on every pair
        q = re.search(r"\[Question\]\n(.*?)\n\n\[", text, re.S).group(1)
        return "A" if _response(text, "A").split()[-1] == answers[q] else "B"

    agreement, judgements = pairwise_gold_agreement(Scripted(oracle), problems, firsts, seconds, task.gold_rewards)
    assert (agreement.n, agreement.agree, agreement.rate, agreement.se) == (6, 6, 1.0, 0.0)
    biased, _ = pairwise_gold_agreement(Scripted(lambda t: "A"), problems, firsts, seconds, task.gold_rewards)
    assert (biased.agree, biased.ties, biased.rate) == (0, 6, 0.0)  # always "A": every pair a tie, rate 0


def test_local_backend_plumbing_on_a_tiny_model(policy_dir):
    backend = LocalChatBackend.from_checkpoint(policy_dir, batch_size=2)
    assert isinstance(backend, ChatBackend)
    requests = [ChatRequest((Message("user", f"What is {a} + 3?"),), max_tokens=6) for a in range(3)]
    batched = backend.complete(requests)
    alone = [backend.complete([r])[0] for r in requests]
    assert len(batched) == 3 and all(isinstance(t, str) for t in batched)
    assert batched == alone  # greedy: batching (left-padding) does not change a reply
    assert backend.generated == 6
    out = judge_pairs(backend, ["2+2?"], ["4"], ["5"])  # an untrained model: whatever it says is parsed or counted
    assert out[0].winner in (None, *Winner) and len(out[0].replies) == 2
