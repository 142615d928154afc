"""The `arithmetic-tools` task: its world (held out, worked by hand), its SFT demonstrations (the loss
on the model's turns, never on the tool's result), its environment, real episodes in that environment
(the mask 0 on every token the calculator's answer put in, 1 on every token the model sampled, and the
same chat's SFT mask equal to the episode's), its greedy episode eval, and GRPO taking the environment
from the task."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.data import IGNORE_INDEX, encode_sft
from posttrain.data.records import Message, Problem, SFTExample
from posttrain.envs import Budget, EpisodeEnd, ToolEnv, run_episodes
from posttrain.models import build_tiny, train_tokenizer
from posttrain.rollout import SamplingParams, make_engine
from posttrain.tasks import Capability, EvalRequest, TaskError, TaskSet, build_task
from posttrain.tasks.arithmetic_tools import ArithmeticToolsTask, tool_chat
from posttrain.worlds.tool_arithmetic import LongProblem, ToolArithmeticWorld, direct_answer

from conftest import Recording

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the world -----------------------------------------------------------------------------------
def test_problems_and_their_working_by_hand():
    mul = LongProblem((47, 83), "*")
    # 47·3 = 141, 47·80 = 3760, 141 + 3760 = 3901 = 47·83
    assert (mul.value, mul.level, mul.expression) == (3901, "T1", "47 * 83")
    assert direct_answer(mul) == "<think>47*3=141, 47*80=3760, 141+3760=3901</think> 3901"
    add = LongProblem((123, 456, 789), "+")
    # 123 + 456 = 579, 579 + 789 = 1368
    assert (add.value, add.level, add.expression) == (1368, "T2", "123 + 456 + 789")
    assert direct_answer(add) == "<think>123+456=579, 579+789=1368</think> 1368"


def test_held_out_problems_are_never_drawn_for_training():
    world = ToolArithmeticWorld(seed=0, eval_per_level=300)
    held = {p for ps in world.eval_problems.values() for p in ps}
    assert [len(ps) for ps in world.eval_problems.values()] == [300, 300] and len(held) == 600
    drawn = world.train_problems(5000, stream="sft") + world.train_problems(5000, stream="problems")
    assert not held & set(drawn)
    assert {p.level for p in drawn} == {"T1", "T2"}
    # a smaller eval is a prefix of a larger one: a checkpoint's score on the first 200 does not move
    assert ToolArithmeticWorld(seed=0).eval_problems["T1"] == world.eval_problems["T1"][:200]


# ---- SFT demonstrations --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task() -> ArithmeticToolsTask:
    return ArithmeticToolsTask(seed=0)


@pytest.fixture(scope="module")
def tok(task):
    return train_tokenizer(task.tokenizer_texts(), vocab_size=512)


def test_a_minority_of_demonstrations_call_the_tool(task):
    records = task.records("sft", 2000)
    share = sum(r.meta["tool"] for r in records) / len(records)
    assert abs(share - 0.4) < 0.044  # binomial SE at n = 2000: √(0.4·0.6/2000) = 0.011, so ±0.044 is 4 SE
    for r in records:
        roles = [m.role for m in r.messages]
        assert roles == (["user", "assistant", "tool", "assistant"] if r.meta["tool"] else ["user", "assistant"])
    assert all(r.meta["tool"] for r in ArithmeticToolsTask(tool_share=1.0).records("sft", 50))
    with pytest.raises(TaskError, match="tool_share"):
        ArithmeticToolsTask(tool_share=1.5)


def test_the_sft_loss_covers_the_call_and_the_answer_never_the_tool_result(task, tok):
    chat = tool_chat(LongProblem((47, 83), "*"), "What is 47 * 83?")
    enc = encode_sft(SFTExample(chat), tok, 128)
    trained = tok.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE_INDEX],
                         skip_special_tokens=False)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "47 * 83"}}</tool_call>'
    assert trained == call + "<|im_end|>" + "3901<|im_end|>"  # the two assistant turns, each with its EOS
    # every token of the tool's turn (role line, result, its end) is out of the loss
    text = tok.decode(enc.input_ids, skip_special_tokens=False)
    tool_turn = "<|im_start|>tool\n3901<|im_end|>"
    assert tool_turn in text
    at, pos = text.index(tool_turn), 0
    for t, lab in zip(enc.input_ids, enc.labels):
        piece = tok.decode([t], skip_special_tokens=False)
        if at <= pos < at + len(tool_turn):
            assert lab == IGNORE_INDEX, piece
        pos += len(piece)


# ---- the environment -----------------------------------------------------------------------------
def test_the_task_supplies_a_calculator_environment(task):
    factory = task.environment()
    env = factory()
    assert isinstance(env, ToolEnv) and set(env.tools) == {"calculator"}
    assert env.reset(Problem("What is 47 * 83?")) == [Message("user", "What is 47 * 83?")]  # no system prompt
    step = env.step(tool_chat(LongProblem((47, 83), "*"), "")[1].content)
    assert step.new_messages == [Message("tool", "3901")] and not step.done and step.tool_calls == 1
    assert env.step("3901").done
    assert task.environment(system_prompt=True)().reset(Problem("x"))[0].role == "system"  # params override
    factory.close()
    assert not build_task("arithmetic").has(Capability.ENV)
    with pytest.raises(TaskError, match="no 'env'"):
        build_task("arithmetic").environment()


# ---- real episodes -------------------------------------------------------------------------------
DEMO = tool_chat(LongProblem((47, 83), "*"), "What is 47 * 83?")


@pytest.fixture(scope="module")
def caller(tok):
    """A tiny model taught one tool demonstration by heart (SFT on it alone): it calls the calculator."""
    torch.manual_seed(0)
    model = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id)
    enc = encode_sft(SFTExample(DEMO), tok, 128)
    ids, labels = torch.tensor([enc.input_ids]), torch.tensor([enc.labels])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return model.eval()


def test_on_real_episodes_the_mask_is_0_on_the_tool_result_and_1_on_every_model_token(caller, tok, task):
    problems = [Problem("What is 47 * 83?")] * 3 + [Problem(f"What is {a} * {b}?") for a, b in ((12, 34), (56, 78), (90, 11))]
    engine = Recording(make_engine("native", caller, tok))
    factory = task.environment()
    run = run_episodes(engine, tok, factory, problems, budget=Budget(max_turns=3, max_tokens=160, turn_tokens=48),
                       params=SamplingParams(temperature=1.0, seed=0))
    factory.close()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    called = 0
    for e in run.episodes:
        ids, mask = e.token_ids.tolist(), e.model_mask.tolist()
        assert mask == [any(a <= t < b for a, b in e.turn_spans) for t in range(len(ids))]  # token by token
        for k, (a, b) in enumerate(e.turn_spans):
            # the model's tokens are exactly what it sampled (cut only where the episode's token budget ran out)
            sampled = [c for call in engine.calls for p, c in call if p == ids[:a] and c[:b - a] == ids[a:b]]
            assert sampled and (len(sampled[0]) == b - a or b == 160)
            if b == 160 and len(sampled[0]) > b - a:
                assert e.finish == "length"  # a turn cut at the token budget never counts as an answer
            if k + 1 < len(e.turn_spans):  # the environment's text between two turns, by hand
                result = e.messages[2 * k + 2]
                assert result.role == "tool"
                close = "\n" if ids[b - 1] == im_end else "<|im_end|>\n"
                assert tok.decode(ids[b:e.turn_spans[k + 1][0]], skip_special_tokens=False) == (
                    f"{close}<|im_start|>tool\n{result.content}<|im_end|>\n<|im_start|>assistant\n")
        called += e.tool_calls > 0
    assert called >= 3  # the calculator answered real calls (the model learnt the call by heart)


def test_the_sft_mask_of_a_chat_equals_the_episode_mask_of_the_same_chat(caller, tok, task):
    factory = task.environment()
    run = run_episodes(make_engine("native", caller, tok), tok, factory, [Problem("What is 47 * 83?")],
                       budget=Budget(max_turns=3, max_tokens=160, turn_tokens=48), params=SamplingParams(temperature=0.0))
    factory.close()
    e = run.episodes[0]
    assert e.messages == DEMO and e.end is EpisodeEnd.DONE and e.tool_calls == 1  # greedy replays the demonstration
    enc = encode_sft(SFTExample(e.messages), tok, 128)
    n = len(e.token_ids)
    assert enc.input_ids[:n] == e.token_ids.tolist()  # the template renders the episode's tokens (and a final "\n")
    assert [lab != IGNORE_INDEX for lab in enc.labels[:n]] == e.model_mask.tolist()
    assert enc.labels[n:] == [IGNORE_INDEX] * (len(enc.labels) - n)


# ---- the eval ------------------------------------------------------------------------------------
def test_the_eval_runs_greedy_episodes_and_reports_accuracy_and_tool_use(caller, tok):
    task = ArithmeticToolsTask(seed=0)
    rows = task.evaluate(caller, tok, EvalRequest(per_level=6, max_new_tokens=48, batch_size=4), stage="t", checkpoint="c")
    got = {(r.level, r.metric): r for r in rows}
    assert set(got) == {(lv, m) for lv in ("T1", "T2", None) for m in ("exact_match", "tool_use")}
    assert got[(None, "tool_use")].n == 12 and got[(None, "tool_use")].value > 0  # it calls the tool (on 47 * 83's form)
    for lv in ("T1", "T2"):
        assert got[(lv, "exact_match")].n == 6
    pooled = got[(None, "exact_match")]
    assert pooled.value == pytest.approx((got[("T1", "exact_match")].value + got[("T2", "exact_match")].value) / 2)
    with pytest.raises(TaskError, match="pass@k over episodes is not built"):
        task.evaluate(caller, tok, EvalRequest(per_level=2, k=(1,)), stage="t", checkpoint="c")


def test_an_answer_counts_only_when_the_episode_ended_with_it(task):
    from posttrain.envs.episodes import Episode
    from posttrain.tasks.arithmetic_tools import episode_correct

    def ep(text, end, finish="stop"):
        return Episode(0, [Message("user", "q"), Message("assistant", text)], torch.zeros(1), torch.zeros(1),
                       torch.zeros(1), torch.zeros(1), 1, [], [], end, finish=finish)

    p = Problem("What is 47 * 83?", answer="3901")
    assert episode_correct(p, ep("3901", EpisodeEnd.DONE))
    assert not episode_correct(p, ep("3901", EpisodeEnd.TURN_BUDGET))
    assert not episode_correct(p, ep("3901", EpisodeEnd.DONE, finish="length"))  # "39012…" cut after 4 tokens
    assert not episode_correct(p, ep("<think>x</think> 3900", EpisodeEnd.DONE))
    assert task.gold_rewards([p, p], ["3901", "3901"], ["stop", "length"]) == [1.0, 0.0]


# ---- GRPO takes the environment from the task ----------------------------------------------------
def test_grpo_env_from_the_task_and_a_recipe_whose_data_task_has_none(tmp_path):
    from posttrain.pipeline.resume import RunError
    from posttrain.pipeline.run import validate_inputs
    from posttrain.runtime.config import Recipe
    from posttrain.stages._episodes import build_env

    def recipe(task_name):
        return Recipe.model_validate({"stages": [{"stage": "grpo", "data": [{"task": task_name, "n": 8}],
                                                  "env": {"name": "task", "params": {"max_calls": 2}}}]})

    good = recipe("arithmetic-tools")
    tasks = TaskSet({"arithmetic-tools": lambda: ArithmeticToolsTask(seed=0)})

    class Ctx:
        pass

    ctx = Ctx()
    ctx.tasks = tasks
    factory = build_env(ctx, good.stages[0].env, good.stages[0].data)
    env = factory()
    assert isinstance(env, ToolEnv) and env.max_calls == 2 and set(env.tools) == {"calculator"}
    validate_inputs(good, None, tmp_path, tasks)
    bad = recipe("arithmetic")
    with pytest.raises(RunError, match=r"stages\[0\]\.env: name 'task', but none of the stage's data tasks"):
        validate_inputs(bad, None, tmp_path, TaskSet({"arithmetic": lambda: build_task("arithmetic")}))
