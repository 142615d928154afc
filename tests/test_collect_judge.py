"""An AI judge as the collect step's scorer (`rejection_sampling.judge`, stages/_collect_judge.py): the
round robin and the score sum by hand, a judge that reads the replies (an in-process backend that knows
the answers) picking best-of-K and agreeing with gold, a local tiny chat model as the judge (through our
rollout engine), and the real OpenAI-compatible test server (tests/openai_stub_server.py, a process on
127.0.0.1) with its replies cached in the run folder: a re-run judges nothing twice."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from posttrain.data import Problem
from posttrain.judges import PairJudgement, Winner
from posttrain.runtime.config import CollectJudge, RejectionSamplingStage
from posttrain.stages._collect_judge import Judged, group_pairs, judge_batch, pooled, round_robin, with_judge
from posttrain.stages.rejection_sampling import output_path, run_rejection_sampling
from conftest import make_ctx
from test_judges_endpoint import server

pytestmark = pytest.mark.usefixtures("one_thread")
P = Problem(prompt="What is 2+3?", answer="5", level="L1")
GOOD, RAMBLE, WRONG = "<think>2+3=5</think> 5", "<think>2+3=5</think> Numbers can be tricky. The result should be 5", "<think>2+3=6</think> 6"


def J(w: Winner | None) -> PairJudgement:
    return PairJudgement(w, (None, None), ("", ""))


def test_round_robin_and_the_sum_by_hand():
    # rows 0..2 of one prompt; pairs (0,1) (0,2) (1,2): 0 beats 1, 0 ties 2, 1's pair with 2 unreadable
    pairs = group_pairs([True, True, True], 3)
    assert pairs == [(0, 1), (0, 2), (1, 2)]
    # row 0: 1 + ½ over 2 games = 0.75; row 1: 0 over 1 game = 0; row 2: ½ over 1 game = 0.5
    assert round_robin(pairs, [J(Winner.FIRST), J(Winner.TIE), J(None)], 3) == [0.75, 0.0, 0.5]
    # a row in no readable pair is unjudged, not 0
    assert round_robin([(0, 1)], [J(None)], 3) == [None, None, None]
    # unfinished rows never pair; groups never mix: rows 0–1 one prompt, 2–3 another
    assert group_pairs([True, False, True, True], 2) == [(2, 3)]
    # total + 0.5 · judge: [1 + 0.5·0.8, None (judge None), None (total None)]
    total, m = with_judge([1.0, 0.5, None], Judged([0.8, None, 0.2], {}), 0.5)
    assert total == pytest.approx([1.4, None, None]) and m["reward/judge"] == pytest.approx(0.5)  # (0.8 + 0.2) / 2
    # weight 0: logged, vetoes nothing
    assert with_judge([1.0, 0.5], Judged([None, 0.3], {}), 0.0)[0] == [1.0, 0.5]
    # pooled over two batches: 3 of 4 agree → 0.75 ± sqrt(0.75 · 0.25 / 4) = 0.2165
    got = pooled([{"judge/agree": 1.0, "judge/agreement_n": 1.0}, {"judge/agree": 2.0, "judge/agreement_n": 3.0}])
    assert got["judge/agreement_with_gold"] == 0.75 and got["judge/agreement_se"] == pytest.approx(0.216506, abs=1e-6)


class Oracle:
    """A chat backend that reads the judge's request and answers as a perfect judge of these replies
    (correct and concise > correct after rambling > wrong) — for checking what the stage does with a
    judgement, not a judge."""

    name = "oracle"
    RANK = {GOOD: 10, RAMBLE: 6, WRONG: 1}

    def __init__(self):
        self.requests = 0

    def complete(self, requests):
        out = []
        for r in requests:
            self.requests += 1
            text = r.messages[-1].content
            if "[Response A]" in text:
                a, b = re.search(r"\[Response A\]\n(.*)\n\n\[Response B\]\n(.*)\n\nWhich", text, re.S).groups()
                out.append("A" if self.RANK[a] > self.RANK[b] else "B" if self.RANK[b] > self.RANK[a] else "A")
            else:
                reply = re.search(r"\[Response\]\n(.*)\n\n\[Rubric\]", text, re.S).group(1)
                out.append(f"Score: {self.RANK[reply]}")
        return out


@pytest.mark.parametrize("mode", ["rubric", "pairwise"])
def test_a_judge_that_reads_the_replies_picks_best_of_k_and_agrees_with_gold(mode):
    texts = [WRONG, GOOD, RAMBLE, "<think>2+3=5</think> 5 5 5"]  # the last was cut by the budget
    finish = ["stop", "stop", "stop", "length"]
    gold = [0.0, 1.0, 0.5, None]
    backend = Oracle()
    got = judge_batch(backend, CollectJudge(backend="local", mode=mode), [P] * 4, texts, finish, 4, gold)
    if mode == "rubric":  # (N − 1) / 9: 1 → 0, 10 → 1, 6 → 5/9; one request per finished reply
        assert got.scores == pytest.approx([0.0, 1.0, 5 / 9, None]) and backend.requests == 3
    else:  # round robin of 3 pairs, each asked in both orders: GOOD 2/2, RAMBLE 1/2, WRONG 0/2
        assert got.scores == [0.0, 1.0, 0.5, None] and backend.requests == 6
    # gold separates all 3 pairs of finished replies, and the judge agrees on each
    m = got.metrics
    assert (m["judge/agree"], m["judge/agreement_n"], m["judge/agreement_with_gold"]) == (3.0, 3.0, 1.0)
    assert m["judge/requests"] == backend.requests and m["judge/judged"] == 3.0


def _stage(tmp_path, policy_dir, tokenizer, world, name, judge, **over):
    cfg = RejectionSamplingStage(**{"name": name, "samples": 8, "batch_prompts": 16, "max_new_tokens": 32, "min_reward": -1e9,
                                    "data": [{"world": "arithmetic", "n": 16}], "judge": judge, **over})
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    run_rejection_sampling(cfg, ctx)
    summary = [r for r in sink.records if r["stage"] == name][-1]
    rows = [json.loads(x) for x in output_path(cfg, tmp_path).read_text().splitlines()]
    return summary, rows


@pytest.mark.slow
def test_the_policy_as_its_own_local_judge(tmp_path, policy_dir, tokenizer, world):
    # The tiny policy (a chat template, our engine) judges its own samples: weight 0, so its judgement —
    # from a random model mostly unparseable — is logged and measured against gold, and vetoes nothing.
    judge = {"backend": "local", "checkpoint": "policy", "mode": "rubric", "weight": 0.0, "max_tokens": 8}
    summary, rows = _stage(tmp_path, policy_dir, tokenizer, world, "local_judge", judge)
    assert rows and summary["judge/requests"] > 0
    assert summary["judge/judged"] + summary["judge/unjudged_finished"] == summary["judge/requests"]
    assert "judge/agreement_n" in summary  # the arithmetic task has a gold judge: the judge was measured


@pytest.mark.slow
def test_an_endpoint_judge_scores_and_its_cache_spares_a_second_request(tmp_path, policy_dir, tokenizer, world):
    with server("--reply", "Score: 7") as (url, stats):
        judge = {"backend": "endpoint", "base_url": url, "model": "stub", "api_key_env": None, "mode": "rubric",
                 "weight": 1.0}
        summary, rows = _stage(tmp_path, policy_dir, tokenizer, world, "ep", judge, rewards=[{"name": "gold"}])
        sent = stats()["chat_requests"]
        assert sent == summary["judge/requests"] > 0  # one request per finished candidate
        # every kept row: gold + 1.0 · (7 − 1) / 9
        assert all(r["reward"] in (pytest.approx(2 / 3, abs=1e-6), pytest.approx(1 + 2 / 3, abs=1e-6)) for r in rows)
        # all rubric scores equal: every pair a tie, so the judge agrees with gold on none it separates
        assert summary.get("judge/agree", 0.0) == 0.0 and summary["judge/ties"] == summary["judge/agreement_n"]
        assert (tmp_path / "judge_cache").is_dir()
        # the same stage again, its journal and checkpoint gone: every reply comes from the cache
        shutil.rmtree(tmp_path / "checkpoints" / "ep")
        (tmp_path / "journal" / "ep.jsonl").unlink()
        again, rows_again = _stage(tmp_path, policy_dir, tokenizer, world, "ep", judge, rewards=[{"name": "gold"}])
        assert stats()["chat_requests"] == sent and rows_again == rows and again["judge/requests"] == summary["judge/requests"]


@pytest.mark.slow
def test_pairwise_endpoint_judge_that_follows_the_position(tmp_path, policy_dir, tokenizer, world):
    # A judge that always answers "A" is position bias itself: both orders disagree → every pair a tie →
    # every judged candidate scores ½; the agreement with gold is 0, its ties counted.
    with server("--reply", "A") as (url, stats):
        judge = {"backend": "endpoint", "base_url": url, "model": "stub", "api_key_env": None, "mode": "pairwise",
                 "weight": 1.0, "max_tokens": 4}
        summary, rows = _stage(tmp_path, policy_dir, tokenizer, world, "pw", judge, rewards=[{"name": "gold"}])
        assert stats()["chat_requests"] == summary["judge/requests"] > 0 and summary["judge/requests"] % 2 == 0
        assert all(r["reward"] in (pytest.approx(0.5), pytest.approx(1.5)) for r in rows)  # gold + 1.0 · ½
        assert summary.get("judge/agree", 0.0) == 0.0 and summary["judge/ties"] == summary["judge/agreement_n"]


def test_judge_config_errors():
    with pytest.raises(ValueError, match="endpoint needs `base_url` and `model`"):
        CollectJudge(backend="endpoint")
    with pytest.raises(ValueError, match="mode"):
        CollectJudge(backend="local", mode="vote")
    # a judge alone scores the samples
    assert RejectionSamplingStage(rewards=[], data=[{"task": "arithmetic", "n": 8}], judge={"backend": "local"}).judge
