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
from posttrain.runtime.config import ConstitutionalRLStage, ConstitutionalSLStage, RecipeError
from posttrain.runtime.recipe_file import load_recipe
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


# ---- the stages' data paths -----------------------------------------------------------------------------
class ScriptedEngine:
    """The real engine's rollout (shapes, finish reasons) with its texts replaced by `script(row)`."""

    def __init__(self, engine, script):
        self.engine, self.script = engine, script

    def generate(self, prompts, params):
        ro = self.engine.generate(prompts, params)
        return dataclasses.replace(ro, texts=[self.script(k) for k in range(len(ro))], finish_reason=["stop"] * len(ro))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_sl_cai_writes_auditable_records_and_sft_rows(tmp_path, policy_dir, tokenizer, world):
    from conftest import make_ctx
    from posttrain.stages.constitutional_sl import read_records, run_constitutional_sl

    cfg = ConstitutionalSLStage(constitution=ARITH, data=[{"task": "arithmetic", "n": 12}], batch_prompts=6, max_new_tokens=12,
                                revisions=2)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    result = run_constitutional_sl(cfg, ctx)
    records = read_records(tmp_path / "data" / "constitutional_sl.records.jsonl")
    assert len(records) == 12 and all(len(r["passes"]) == 2 for r in records)  # 2 passes, a principle each
    names = {"work_shown", "answer_from_work", "no_filler"}
    assert {p["principle"] for r in records for p in r["passes"]} <= names
    assert all(set(r["compliance_before"]) == names and r["passes"][0]["critique"] for r in records)
    rows = read_jsonl(tmp_path / "data" / "constitutional_sl.jsonl", "sft").records
    usable = [r for r in records if r["final"]]
    assert len(rows) == len(usable) > 0  # keep: all — every usable final revision is an SFT target
    assert [r.messages[-1].content for r in rows] == [r["final"] for r in usable]
    summary = [r for r in sink.records if "cai/responses" in r][-1]
    assert summary["cai/responses"] == 12 and summary["cai/unusable"] == 12 - len(rows)
    assert (result.checkpoint / "model.safetensors").is_file()
    # a rule revision of a pass applies that pass's principle: the final text complies with the last one
    for r in usable:
        last = r["passes"][-1]
        if last["revision"] is not None:
            assert r["compliance_after"][last["principle"]] in (True, None)


def test_rl_cai_labels_pairs_and_reports_agreement_with_the_checker(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    from conftest import make_ctx
    from posttrain.runtime.context import RunContext
    from posttrain.stages.constitutional_rl import run_constitutional_rl

    # per prompt, 4 samples → pairs (concise, filler) and (concise, wrong-from-work): the rule labeler decides a
    # pair only when the sampled principle separates it
    script = lambda k: [GOOD, FILLER, GOOD, "<think>5+8=13, 4+4+1=9, 3+3=6</think> 683"][k % 4]
    real = RunContext.rollout_engine
    monkeypatch.setattr(RunContext, "rollout_engine", lambda self, model, backend="native": ScriptedEngine(real(self, model), script))
    cfg = ConstitutionalRLStage(constitution=ARITH, data=[{"task": "arithmetic", "n": 8}], samples=4, batch_prompts=8,
                                max_new_tokens=8)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    run_constitutional_rl(cfg, ctx)
    records = [json.loads(x) for x in (tmp_path / "data" / "constitutional_rl.records.jsonl").read_text().splitlines()]
    assert len(records) == 16  # 8 prompts × 2 pairs
    rows = read_jsonl(tmp_path / "data" / "constitutional_rl.jsonl", "preference").records
    decided = [r for r in records if r["winner"] in ("first", "second")]
    assert len(rows) == len(decided) > 0
    assert all(r.chosen == GOOD for r in rows)  # the concise, computed reply wins every decided pair
    for r in records:  # pair 1 differs only in filler, pair 2 only in the stated answer
        separates = {FILLER: "no_filler", GOOD: None}.get(r["second"], "answer_from_work")
        assert (r["winner"] == "first") == (r["principle"] == separates), r
    summary = [r for r in sink.records if "cai/agreement" in r][-1]
    assert summary["cai/agreement"] == 1.0 and summary["cai/agreement_n"] == len(decided)  # the rule is the gold


def test_rl_cai_skips_pairs_it_cannot_judge(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    from conftest import make_ctx
    from posttrain.runtime.context import RunContext
    from posttrain.stages.constitutional_rl import run_constitutional_rl, usable_pair

    assert not usable_pair("5", " 5 ", "stop", "stop") and not usable_pair("5", "6", "stop", "length") and usable_pair("5", "6", "stop", "stop")
    real = RunContext.rollout_engine
    monkeypatch.setattr(RunContext, "rollout_engine", lambda self, model, backend="native": ScriptedEngine(real(self, model), lambda k: GOOD))
    cfg = ConstitutionalRLStage(constitution=ARITH, data=[{"task": "arithmetic", "n": 4}], samples=2, max_new_tokens=8)
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    with pytest.raises(ValueError, match=r"decided none of 0 pairs \(4 skipped"):
        run_constitutional_rl(cfg, ctx)


# ---- the compliance eval -------------------------------------------------------------------------------
def test_clustered_standard_error_by_hand():
    from posttrain.tasks.constitution_eval import clustered

    # 2 problems × 2 samples: [ok, ok] and [ok, not]; p = 3/4; residuals c_i − p·m_i = 2 − 1.5 = 0.5 and 1 − 1.5 = −0.5
    # se = sqrt(0.25 + 0.25) / 4 = 0.1768
    r = clustered("s", "c", "e", None, "comply/x", [True, True, True, False], 2)
    assert (r.value, r.n) == (0.75, 4) and r.stderr == pytest.approx(0.17678, abs=1e-4)
    # a reply the principle does not apply to leaves the count: [ok, n/a] and [not, n/a] → 1 of 2
    r = clustered("s", "c", "e", None, "comply/x", [True, None, False, None], 2)
    assert (r.value, r.n) == (0.5, 2)
    # group 1: binomial, sqrt(0.5·0.5/2) = 0.3536
    assert clustered("s", "c", "e", None, "m", [True, False], 1).stderr == pytest.approx(0.35355, abs=1e-4)


def test_compliance_rows_per_level_and_pooled():
    from posttrain.judges import load_constitution as load
    from posttrain.tasks.arithmetic import ArithmeticTask
    from posttrain.tasks.constitution_eval import compliance_rows

    task = ArithmeticTask()
    sets = {"L1": [P34, P34], "L3": [P345, P345]}
    replies = {"What is 3+4?": ["<think>3+4=7</think> 7", "So 7"], "What is 345+348?": [GOOD, FILLER]}
    decode = lambda problems: ([replies[p.prompt][i % 2] for i, p in enumerate(problems)], ["stop"] * len(problems))
    rows = {(r.level, r.metric): r for r in compliance_rows("arithmetic/constitution", task, sets, load(ARITH), decode, 1,
                                                            stage="s", checkpoint="c")}
    # L1: work_shown does not apply (n 0); "So 7" states 7 without work and with filler
    assert rows[("L1", "comply/work_shown")].n == 0
    assert (rows[("L1", "comply/answer_from_work")].value, rows[("L1", "comply/no_filler")].value) == (0.5, 0.5)
    # L3: both show work that computes 693; the second has filler
    assert (rows[("L3", "comply/work_shown")].value, rows[("L3", "comply/no_filler")].value) == (1.0, 0.5)
    # pooled over 4 replies: compliant with every applicable principle: the first of each level → 2 of 4
    assert (rows[(None, "comply/all")].value, rows[(None, "comply/all")].n) == (0.5, 4)
    assert rows[(None, "accuracy")].value == 1.0  # every reply ends in the right number


# ---- the shipped recipe, end to end (shrunk) ------------------------------------------------------------------
@pytest.mark.slow
def test_constitutional_ai_recipe_end_to_end_shrunk(tmp_path, monkeypatch):
    """recipes/constitutional-ai.yaml as shipped — its stages, hand-offs and evals — on a tiny model built
    from scratch, a few examples per stage. The policy's samples are scripted (a random model's replies
    give a rule nothing to separate), so the SL-CAI revisions and the RL-CAI labels both have work."""
    from posttrain.pipeline.run import run_pipeline
    from posttrain.runtime.context import RunContext

    replies = [GOOD, FILLER, GOOD, "<think>5+8=13, 4+4+1=9, 3+3=6</think> 683"]
    real = RunContext.rollout_engine
    monkeypatch.setattr(RunContext, "rollout_engine",
                        lambda self, model, backend="native": ScriptedEngine(real(self, model), lambda k: replies[k % 4]))
    monkeypatch.chdir(tmp_path)
    c = str(ARITH)
    recipe = load_recipe(ROOT / "recipes" / "constitutional-ai.yaml", [
        "model.init=tiny-1m", "model.vocab_size=400", "telemetry.measure_cpu=false",
        "evals.0.per_level=2", "evals.0.max_new_tokens=8", "evals.0.samples=2", f"evals.0.constitution={c}",
        f"stages.0.constitution={c}", "stages.0.data.0.n=8", "stages.0.batch_prompts=4", "stages.0.max_new_tokens=8",
        "stages.1.steps=2", "stages.1.batch_size=4", "stages.1.save_every=2", "stages.1.optim.warmup_steps=1",
        f"stages.2.constitution={c}", "stages.2.data.0.n=8", "stages.2.batch_prompts=4", "stages.2.max_new_tokens=8",
        "stages.3.steps=2", "stages.3.batch_size=4", "stages.3.save_every=2", "stages.3.optim.warmup_steps=1"])
    run_dir = tmp_path / "runs" / "constitutional-ai"
    run_pipeline(recipe, run_dir)
    for stage in ("sl_cai_data", "sl_cai", "rl_cai_data", "rl_cai"):
        assert (run_dir / "checkpoints" / stage / "final" / "manifest.json").is_file(), stage
    assert len(read_jsonl(run_dir / "data" / "sl_cai.jsonl", "sft").records) == 8  # every scripted reply is revisable
    assert (run_dir / "data" / "sl_cai_data.records.jsonl").is_file() and (run_dir / "data" / "rl_cai_data.records.jsonl").is_file()
    assert read_jsonl(run_dir / "data" / "rl_cai.jsonl", "preference").records
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    got = {(e["stage"], e["eval"], e["metric"]) for e in evals if e["level"] is None}
    for stage in ("sl_cai_data", "sl_cai", "rl_cai"):  # compliance (greedy and sampled) and accuracy after every stage (a model built from scratch has no "base" row)
        for ev in ("arithmetic/constitution", "arithmetic/constitution@T1"):
            assert {(stage, ev, m) for m in ("comply/all", "comply/no_filler", "accuracy")} <= got, (stage, ev)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["stage"] == "rl_cai_data" and "cai/agreement" in m][-1]
    assert rl["cai/agreement"] == 1.0  # the rule judge is the gold


def test_sl_cai_self_critique_path_runs_the_policy_as_its_own_reviser(tmp_path, policy_dir, tokenizer, world):
    """`reviser: {kind: local, checkpoint: policy}`: critiques and revisions generated by the stage's own
    policy through its engine (a random policy's text; the test is the path, and that every record says
    what the policy wrote)."""
    from conftest import make_ctx
    from posttrain.stages.constitutional_sl import read_records, run_constitutional_sl

    cfg = ConstitutionalSLStage(constitution=ARITH, data=[{"task": "arithmetic", "n": 4}], max_new_tokens=8,
                                reviser={"kind": "local", "checkpoint": "policy", "max_tokens": 8})
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    try:
        run_constitutional_sl(cfg, ctx)
    except ValueError as e:  # a random policy may revise nothing usably; the records are written first
        assert "no usable revision" in str(e)
    records = read_records(tmp_path / "data" / "constitutional_sl.records.jsonl")
    assert len(records) == 4 and all(isinstance(r["passes"][0]["critique"], str) for r in records)
    assert all(r["final"] in (None, r["passes"][0]["revision"]) for r in records)
