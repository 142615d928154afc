"""Constitutional AI: the constitution file, the rule checkers, the feedback (critique → revision and
pairwise labels), the SL-CAI and RL-CAI data paths, and the compliance eval."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from posttrain.data import Problem, read_jsonl
from posttrain.judges import (
    CHECKERS,
    ChatLabeler,
    ChatReviser,
    ConstitutionError,
    RuleLabeler,
    RuleReviser,
    Winner,
    gold_agreement,
    gold_of_pair,
    load_constitution,
    parse_constitution,
    split_reply,
    work_result,
)
from posttrain.judges.checkers import rule_revision
from posttrain.runtime.config import ConstitutionalRLStage, ConstitutionalSLStage, RecipeError, load_recipe
from posttrain.worlds.arithmetic import Fact, column_work, concise_answer, ramble

ROOT = Path(__file__).resolve().parents[1]
ARITH = ROOT / "recipes" / "constitutions" / "arithmetic.yaml"
P345 = Problem(prompt="What is 345+348?", answer="693", level="L3", meta={"a": 345, "op": "+", "b": 348})
P34 = Problem(prompt="What is 3+4?", answer="7", level="L1", meta={"a": 3, "op": "+", "b": 4})
P903 = Problem(prompt="What is 903-897?", answer="6", level="L3", meta={"a": 903, "op": "-", "b": 897})
P47x6 = Problem(prompt="What is 47*6?", answer="282", level="L4", meta={"a": 47, "op": "*", "b": 6})
GOOD = "<think>5+8=13, 4+4+1=9, 3+3=6</think> 693"
FILLER = "<think>5+8=13, 4+4+1=9, 3+3=6</think> Alright. I will work it out. The result should be 693"


# ---- the constitution file ------------------------------------------------------------------------------
def write(tmp_path, data) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def principle(**over) -> dict:
    return {"name": "p", "critique": "Identify filler.", "revision": "Rewrite without filler.", "check": "no_filler", **over}


def test_shipped_constitution_loads_with_three_checked_principles():
    c = load_constitution(ARITH)
    assert [p.name for p in c.principles] == ["work_shown", "answer_from_work", "no_filler"]
    assert [p.check for p in c.checked] == ["work_shown", "answer_from_work", "no_filler"]
    assert all(p.critique and p.revision and p.preference for p in c.principles)


@pytest.mark.parametrize("data, expected", [
    ({"principles": []}, "expected a non-empty YAML list of principles"),
    ([], "expected a non-empty YAML list of principles"),
    (["just text"], "principles[0]: expected a mapping"),
    ([{"name": "p", "critique": "x"}], "principles[0] (p): revision: missing"),
    ([principle(extra=1)], "principles[0] (p): extra: unknown key"),
    ([principle(critique="  ")], "principles[0] (p): critique: expected a non-empty string"),
    ([principle(check="no_such_rule")], "principles[0] (p): check: unknown checker 'no_such_rule'"),
    ([principle(), principle()], "principles[1] (p): name: 'p' names an earlier principle too"),
    ([principle(name="two words")], "principles[0] (two words): name: expected an identifier"),
])
def test_constitution_errors_name_file_principle_and_field(tmp_path, data, expected):
    path = write(tmp_path, data)
    with pytest.raises(ConstitutionError) as e:
        load_constitution(path)
    assert str(path) in str(e.value) and expected in str(e.value)


def test_a_principle_without_check_is_allowed_and_gets_a_default_preference():
    c = parse_constitution([principle(check=None)], "mem")
    assert c.checked == () and c.principles[0].preference.endswith("Identify filler.")


def test_recipe_with_a_bad_constitution_is_refused_naming_the_key(tmp_path):
    bad = write(tmp_path, [principle(check="nope")])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stages": [{"stage": "constitutional_sl", "constitution": str(bad),
                                                  "data": [{"task": "arithmetic", "n": 4}]}]}))
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe)
    assert "stages[0]" in str(e.value) and "unknown checker 'nope'" in str(e.value)
    with pytest.raises(ValueError, match="samples 3 must be even"):
        ConstitutionalRLStage(constitution=ARITH, samples=3, data=[{"task": "arithmetic", "n": 4}])


# ---- checkers on hand-written replies -----------------------------------------------------------------
@pytest.mark.parametrize("work, value", [
    ("5+8=13, 4+4+1=9, 3+3=6", 693),       # "6" + "9" + "3"
    ("7+8=15, 3+4+1=8", 85),                # the last column's whole value leads: "8" + "5"
    ("13-7=6, 10-1-9=0, 9-1-8=0", 6),       # 903 − 897: "0" "0" "6" → 6
    ("7*6=42, 4*6+4=28", 282),              # 47 × 6: "28" + "2"
    ("3+4=7", 7),
    ("", None), (None, None), ("so 5+8 is 13", None),
])
def test_work_result_reads_the_number_the_columns_compute(work, value):
    assert work_result(work) == value


def test_work_result_agrees_with_the_world_on_its_own_column_work():
    for f in (Fact(345, "+", 348), Fact(903, "-", 897), Fact(47, "*", 6), Fact(99, "+", 1), Fact(100, "-", 1), Fact(8, "*", 9)):
        assert work_result(column_work(f)) == f.value


def test_work_shown():
    check = CHECKERS["work_shown"]
    assert check(P345, GOOD).ok and check(P345, GOOD).applies
    v = check(P345, "693")
    assert v.applies and not v.ok  # multi-digit, no work
    v = check(P34, "7")
    assert not v.applies and v.ok  # single-digit: the principle says nothing


def test_answer_from_work():
    check = CHECKERS["answer_from_work"]
    assert check(P345, GOOD).ok
    v = check(P345, "<think>5+8=13, 4+4+1=9, 3+3=6</think> 683")
    assert not v.ok and "states 683 but its work computes 693" in v.reason
    v = check(P345, "693")
    assert v.applies and not v.ok and "no work" in v.reason
    v = check(P345, "I am not sure")  # no answer stated: nothing claimed
    assert not v.applies and v.ok


def test_no_filler():
    check = CHECKERS["no_filler"]
    assert check(P345, GOOD).ok and check(P34, "7").ok
    v = check(P345, FILLER)
    assert not v.ok and "The result should be" in v.reason
    assert not check(P345, "six hundred").ok  # no final number at all


def test_split_reply():
    r = split_reply(FILLER)
    assert (r.work, r.answer) == ("5+8=13, 4+4+1=9, 3+3=6", 693) and r.body.startswith("Alright.")


# ---- rule revisers -------------------------------------------------------------------------------------
def test_rule_revisions_make_the_smallest_compliant_edit():
    assert rule_revision("no_filler", P345, FILLER)[1] == GOOD
    critique, same = rule_revision("no_filler", P345, GOOD)
    assert same == GOOD and critique.startswith("Complies")
    # the answer its own work computes, even when the work is wrong: columns 12 and 5 → "5" + "2" = 52
    assert rule_revision("answer_from_work", P47x6, "<think>7+6=12, 4+1=5</think> 99")[1] == "<think>7+6=12, 4+1=5</think> 52"
    # without work, the problem's column work and its result
    assert rule_revision("answer_from_work", P903, "6")[1] == "<think>13-7=6, 10-1-9=0, 9-1-8=0</think> 6"
    assert rule_revision("work_shown", P345, "The result should be 693")[1] == \
        "<think>5+8=13, 4+4+1=9, 3+3=6</think> The result should be 693"
    assert rule_revision("no_filler", P345, "<think>5+8=13</think> six")[1] is None  # nothing to keep
    for check in CHECKERS:  # every revision it makes complies with its own principle
        for text in (FILLER, "693", "<think>1+1=2</think> so 5", ramble(Fact(345, "+", 348), __import__("random").Random(0))):
            fixed = rule_revision(check, P345, text)[1]
            assert fixed is None or CHECKERS[check](P345, fixed).ok, (check, text, fixed)


# ---- feedback by chat models (a scripted backend) ---------------------------------------------------------
class Scripted:
    """A ChatBackend that answers from a function of the request and records every request."""

    name = "local"

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def complete(self, requests):
        self.requests += list(requests)
        return [self.answer(r) for r in requests]


def test_chat_reviser_asks_critique_then_revision_in_the_papers_format():
    c = load_constitution(ARITH)
    nf = c.by_name("no_filler")
    backend = Scripted(lambda r: "It rambles." if r.messages[-1].content.startswith("CritiqueRequest") else "Revision: <think>5+8=13</think> 693")
    out = ChatReviser(backend).revise([P345], [FILLER], [nf])
    assert out[0].critique == "It rambles." and out[0].revision == "<think>5+8=13</think> 693"
    crit, rev = backend.requests
    assert [m.role for m in crit.messages] == ["user", "assistant", "user"]
    assert crit.messages[1].content == FILLER and crit.messages[2].content == f"CritiqueRequest: {nf.critique}"
    assert rev.messages[3].content == "Critique: It rambles." and rev.messages[4].content.startswith(f"RevisionRequest: {nf.revision}")
    assert ChatReviser(Scripted(lambda r: "  ")).revise([P345], [FILLER], [nf])[0].revision is None  # empty: unusable


def test_rule_labeler_and_its_agreement_with_the_checker():
    c = load_constitution(ARITH)
    nf, ws = c.by_name("no_filler"), c.by_name("work_shown")
    firsts, seconds = [GOOD, FILLER, GOOD], [FILLER, GOOD, FILLER]
    principles = [nf, nf, ws]
    got = RuleLabeler().label([P345] * 3, firsts, seconds, principles)
    # no_filler separates the first two pairs; both replies show work, so work_shown ties the third
    assert [j.winner for j in got] == [Winner.FIRST, Winner.SECOND, Winner.TIE]
    gold = [gold_of_pair(p, P345, x, y) for p, x, y in zip(principles, firsts, seconds)]
    assert gold == [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)]
    a = gold_agreement(got, [g[0] for g in gold], [g[1] for g in gold])
    assert (a.n, a.agree, a.gold_undecided, a.rate) == (2, 2, 1, 1.0)  # equal by construction


def test_chat_labeler_asks_each_principles_question_in_both_orders():
    c = load_constitution(ARITH)
    nf = c.by_name("no_filler")
    # a judge that always answers "A" follows the position: both orders disagree → a tie, agreement 0
    backend = Scripted(lambda r: "A")
    got = ChatLabeler(backend).label([P345, P345], [GOOD, FILLER], [FILLER, GOOD], [nf, nf])
    assert [j.winner for j in got] == [Winner.TIE, Winner.TIE] and len(backend.requests) == 4
    assert nf.preference in backend.requests[0].messages[1].content
    a = gold_agreement(got, [1.0, 0.0], [0.0, 1.0])
    assert (a.n, a.agree, a.ties, a.rate) == (2, 0, 2, 0.0)
    # a judge that reads the replies: "A" when response A has no filler
    smart = Scripted(lambda r: "A" if r.messages[1].content.split("[Response A]\n")[1].split("\n")[0] == GOOD else "B")
    got = ChatLabeler(smart).label([P345, P345], [GOOD, FILLER], [FILLER, GOOD], [nf, nf])
    assert [j.winner for j in got] == [Winner.FIRST, Winner.SECOND]


def test_rule_feedback_needs_a_check_on_every_principle(tmp_path):
    with pytest.raises(ValueError, match="has no `check`"):
        RuleReviser().revise([P345], [GOOD], [parse_constitution([principle(check=None)], "mem").principles[0]])
