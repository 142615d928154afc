"""Multi-turn episodes over the native engine with a tiny model and scripted environments: the mask is
1 on exactly the tokens the model sampled and 0 on everything the environment wrote, token by token;
the recorded log-probs equal a teacher-forced forward; budgets end episodes; slow rows do not block."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from posttrain.data.records import Message, Problem
from posttrain.envs import Budget, EpisodeEnd, StepResult, pad_episodes, run_episodes
from posttrain.models import build_tiny
from posttrain.rollout import SamplingParams, make_engine

from conftest import Recording

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tok):
    m = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id).eval()
    # An untrained model almost never samples <|im_end|>; a long embedding row (tied to the output) makes
    # it frequent, so some turns end with the model's EOS and others at the turn budget — both paths.
    with torch.no_grad():
        m.model.embed_tokens.weight[tok.convert_tokens_to_ids("<|im_end|>")] *= 45
    return m


class Scripted:
    """Answers turn k (1-based) with a tool message and a user message; done after `turns` turns (reward 1)."""

    def __init__(self, turns: int = 3, sleep_first: float = 0.0, log: list | None = None, name: str = ""):
        self.turns, self.k, self.sleep_first, self.log, self.name = turns, 0, sleep_first, log, name

    def reset(self, problem):
        return [Message("system", "be brief"), Message("user", problem.prompt)]

    def step(self, text):
        self.k += 1
        if self.k == 1 and self.sleep_first:
            time.sleep(self.sleep_first)
        if self.log is not None:
            self.log.append((self.name, self.k, time.monotonic()))
        if self.k >= self.turns:
            return StepResult([], 1.0, done=True)
        return StepResult([Message("tool", f"result {self.k}"), Message("user", "go on")], None, done=False,
                          tool_calls=1)


def env_text(k: int, model_wrote_eos: bool) -> str:
    """What the environment writes after turn k in ChatML, by hand: the turn's end unless the model wrote
    <|im_end|> itself, the two messages, and the next generation prompt."""
    close = "\n" if model_wrote_eos else "<|im_end|>\n"
    return (close + f"<|im_start|>tool\nresult {k}<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
            "<|im_start|>assistant\n")


def _run(model, tok, problems, factory, backend="native", **kw):
    engine = Recording(make_engine(backend, model, tok))
    kw.setdefault("budget", Budget(max_turns=4, max_tokens=300, turn_tokens=12))
    kw.setdefault("params", SamplingParams(temperature=1.0, seed=3))
    return engine, run_episodes(engine, tok, factory, problems, **kw)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_the_mask_is_1_on_every_model_token_and_0_on_every_environment_token(model, tok, backend):
    problems = [Problem(f"{i} + {2 * i} =") for i in range(6)]
    engine, run = _run(model, tok, problems, lambda: Scripted(turns=3), backend)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = [s for call in engine.calls for s in call]
    ended_with_eos = 0
    for e in run.episodes:
        assert e.end is EpisodeEnd.DONE and e.turns == 3 and e.reward == 1.0 and e.tool_calls == 2
        ids, mask = e.token_ids.tolist(), e.model_mask.tolist()
        in_span = [any(a <= t < b for a, b in e.turn_spans) for t in range(len(ids))]
        assert mask == in_span  # token by token: 1 inside a model turn, 0 everywhere else
        assert not any(mask[: e.prompt_len])
        assert ids[: e.prompt_len] == tok.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": problems[e.problem_index].prompt}],
            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for k, (a, b) in enumerate(e.turn_spans):
            # the model's tokens are exactly what the engine sampled, given exactly the tokens before them
            assert (ids[:a], ids[a:b]) in sampled
            if k + 1 < len(e.turn_spans):
                eos = ids[b - 1] == im_end
                ended_with_eos += eos
                nxt = e.turn_spans[k + 1][0]
                assert tok.decode(ids[b:nxt], skip_special_tokens=False) == env_text(k + 1, eos)
        assert e.turn_spans[-1][1] == len(ids)  # nothing after the last turn (the episode was over)
        assert [m.role for m in e.messages] == ["system", "user"] + ["assistant", "tool", "user"] * 2 + ["assistant"]
    assert 0 < ended_with_eos < 12  # both closings were exercised (12 inner turns in all)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_model_logprobs_equal_a_teacher_forced_forward(model, tok, backend):
    problems = [Problem(f"{i} * 3 =") for i in range(4)]
    _, run = _run(model, tok, problems, lambda: Scripted(turns=3), backend)
    for e in run.episodes:  # one episode at a time: no padding
        with torch.no_grad():
            logits = model(input_ids=e.token_ids[None]).logits[0].float()               # (T, V)
        tf = torch.log_softmax(logits[:-1], -1).gather(-1, e.token_ids[1:, None])[:, 0]  # (T − 1,) log π(x_t | x_<t)
        m = e.model_mask[1:]
        assert m.sum() == sum(b - a for a, b in e.turn_spans)
        torch.testing.assert_close(e.policy_logprobs[1:][m], tf[m], atol=1e-4, rtol=0)
        assert (e.policy_logprobs[~e.model_mask] == 0).all() and (e.logprobs[~e.model_mask] == 0).all()
        torch.testing.assert_close(e.logprobs, e.policy_logprobs)  # T = 1, no filter: q = π
    # the padded batch the update would forward: the same log-probs where its mask is 1
    b = pad_episodes(run.episodes, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    tf = torch.log_softmax(logits[:, b.prompt_len - 1: -1].float(), -1).gather(-1, b.input_ids[:, b.prompt_len:, None])[..., 0]
    assert b.mask.sum() == sum(int(e.model_mask.sum()) for e in run.episodes)
    torch.testing.assert_close(b.old_logprobs[b.mask], tf[b.mask], atol=1e-4, rtol=0)


def test_the_turn_budget_ends_an_episode_the_environment_would_continue(model, tok):
    _, run = _run(model, tok, [Problem("1 + 1 =")] * 3, lambda: Scripted(turns=99),
                  budget=Budget(max_turns=2, max_tokens=400, turn_tokens=8))
    for e in run.episodes:
        assert e.end is EpisodeEnd.TURN_BUDGET and e.turns == 2 and e.reward is None
        assert len(e.rewards) == 2  # the environment saw both turns


def test_the_token_budget_caps_the_whole_sequence(model, tok):
    budget = Budget(max_turns=10, max_tokens=60, turn_tokens=12)
    _, run = _run(model, tok, [Problem("7 + 8 ="), Problem("12 + 345 + 6789 =")], lambda: Scripted(turns=99),
                  budget=budget)
    for e in run.episodes:
        assert e.end is EpisodeEnd.TOKEN_BUDGET and len(e.token_ids) <= budget.max_tokens
        assert all(b - a <= budget.turn_tokens for a, b in e.turn_spans)
    with pytest.raises(ValueError, match="leaving no room"):
        run_episodes(make_engine("native", model, tok), tok, lambda: Scripted(), [Problem("1 " * 80)],
                     budget=Budget(max_tokens=40))


def _slow_row_run(model, tok, tool_wait_s):
    log: list = []
    made = iter(range(3))
    lock = threading.Lock()

    def factory():
        with lock:
            i = next(made)
        return Scripted(turns=3, sleep_first=2.0 if i == 0 else 0.0, log=log, name=str(i))

    _, run = _run(model, tok, [Problem("5 + 5 =")] * 3, factory, tool_wait_s=tool_wait_s,
                  budget=Budget(max_turns=4, max_tokens=300, turn_tokens=6))
    slow_first_step = next(t for name, k, t in log if name == "0" and k == 1)
    fast_last = max(t for name, k, t in log if name != "0")
    assert all(e.turns == 3 and e.end is EpisodeEnd.DONE for e in run.episodes)
    return run, fast_last < slow_first_step


def test_with_a_wait_limit_rows_without_a_slow_tool_are_not_blocked(model, tok):
    # row 0's first step takes 2 s; rows 1 and 2 finish all three turns while it waits
    run, fast_finished_first = _slow_row_run(model, tok, tool_wait_s=0.05)
    assert fast_finished_first and run.generate_calls >= 4   # 3 calls for the fast rows, ≥ 2 more for row 0


def test_lockstep_waits_for_the_round(model, tok):
    run, fast_finished_first = _slow_row_run(model, tok, tool_wait_s=None)
    assert not fast_finished_first and run.generate_calls == 3


def test_lockstep_with_a_seed_is_reproducible(model, tok):
    a = _run(model, tok, [Problem("3 + 4 =")] * 3, lambda: Scripted(turns=3))[1]
    b = _run(model, tok, [Problem("3 + 4 =")] * 3, lambda: Scripted(turns=3))[1]
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a.episodes, b.episodes))
