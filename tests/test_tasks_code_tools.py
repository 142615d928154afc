"""The `code-tools` task: generated problems and a user's JSONL (validated), the environment's tools
(`run_tests`, a Python session per episode) and their failure modes, hidden tests deciding the reward
in the sandbox, probes for the hidden tests counted on real programs, and real multi-turn episodes
whose loss mask is 0 on everything the environment wrote — bubblewrap, and the unsafe backend."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from posttrain.data.records import Problem
from posttrain.envs import Budget, EpisodeEnd, format_call, pad_episodes, run_episodes
from posttrain.rollout import SamplingParams
from posttrain.rollout.output import Rollout
from posttrain.tasks import Capability, build_task
from posttrain.tasks.code_tools import CodeProblemError, read_code_problems
from posttrain.worlds.code_functions import LEVELS, generate, reference

LIMITS = {"timeout_s": 2.0, "memory_bytes": 512 << 20, "output_bytes": 64 << 10, "processes": 8}
BACKENDS = ["bubblewrap", pytest.param("unsafe-subprocess", marks=pytest.mark.filterwarnings("ignore::UserWarning"))]


def _backend_or_skip(name: str) -> None:
    if name == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed here (apt-get install -y bubblewrap)")


@pytest.fixture(scope="module", params=BACKENDS)
def factory(request):
    _backend_or_skip(request.param)
    f = build_task("code-tools").environment(sandbox=request.param, limits=LIMITS, concurrency=2)
    yield f
    f.close()


@pytest.fixture(scope="module")
def problems():
    return build_task("code-tools").records("problem", 9)


def call(name: str, code: str) -> str:
    return format_call(name, {"code": code})


# ---- problems ------------------------------------------------------------------------------------
def test_generated_problems_are_seeded_levelled_and_their_reference_passes():
    a, b = generate(9, seed=0), generate(9, seed=0)
    assert a == b and generate(9, seed=1) != a
    assert {f.level for f in a} == set(LEVELS)
    for f in a:
        assert len(f.visible) == 2 and len(f.hidden) == 6 and not set(f.visible) & set(f.hidden)
        fn = reference(f.solution, f.name)
        for t in f.visible + f.hidden:  # the asserts hold for the reference (trusted source, here)
            exec(t, {f.name: fn})
    f = generate(1, seed=0, levels=["C1"], stream="problem-0")[0]
    # scale_shift with a = 2, b = -1 (seed 0): 16·2 − 1 = 31
    assert f.name == "scale_shift" and f.visible[0] == "assert scale_shift(16) == 31"


def test_a_problem_carries_hidden_tests_apart_from_the_prompt(problems):
    t = build_task("code-tools")
    assert {Capability.PROBLEMS, Capability.ENV} <= t.capabilities
    for p in problems:
        assert all(v in p.prompt for v in p.meta["visible_tests"])
        assert not any(h in p.prompt for h in p.tests)  # the hidden asserts are never shown


def test_a_user_file_is_read_and_a_bad_row_names_file_line_and_field(tmp_path):
    good = {"prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"", "entry_point": "add",
            "visible_tests": ["assert add(1, 2) == 3"], "tests": ["assert add(-1, 1) == 0"], "level": "easy"}
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "name": "add2"}) + "\n")
    ps = read_code_problems(path)
    assert len(ps) == 2 and ps[0].tests == ["assert add(-1, 1) == 0"] and ps[0].meta["visible_tests"] == good["visible_tests"]
    for row, line, want in [({k: v for k, v in good.items() if k != "tests"}, 2, "missing field 'tests'"),
                            ({**good, "tests": []}, 2, "field 'tests': expected a non-empty list"),
                            ({**good, "visible_tests": ["add(1, 2) == 3"]}, 2, r"field 'visible_tests'\[0\]"),
                            ({**good, "tests": ["assert sub(1, 2) == 3"]}, 2, "does not call the entry point"),
                            ({**good, "entry_point": "1add"}, 2, "not a Python name"),
                            ({**good, "color": "red"}, 2, "unknown field 'color'"),
                            ({**good, "level": 3}, 2, "field 'level': expected str")]:
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(CodeProblemError, match=f"mine.jsonl:{line}: .*{want}" if line else want):
            read_code_problems(path)
    path.write_text("{not json\n")
    with pytest.raises(CodeProblemError, match="mine.jsonl:1: not JSON"):
        read_code_problems(path)


# ---- the environment: tools, reward, failure modes -----------------------------------------------
def test_run_tests_reports_each_visible_test_and_the_answer_is_judged_on_hidden_tests(factory, problems):
    p = problems[0]  # scale_shift: x * 2 + (-1)
    env = factory()
    env.reset(p)
    r = env.step(call("run_tests", "def scale_shift(x):\n    return x"))
    assert r.new_messages[0].content == ("assert scale_shift(16) == 31: FAIL (got 16)\n"
                                         "assert scale_shift(45) == 89: FAIL (got 45)\n0/2 visible tests passed")
    assert (r.done, r.reward, r.tool_calls, r.tool_errors, r.hidden_probes) == (False, 0.0, 1, 0, 0)
    # right on x ≥ 9 only: hidden inputs (seed 0) 9, 48, 7, -39, … — the reward is the fraction passed
    answer = "Here it is:\n```python\ndef scale_shift(x):\n    return 2 * x - 1 if x >= 9 else 0\n```"
    r = env.step(answer)
    hidden = [int(t.split("(")[1].split(")")[0]) for t in p.tests]
    assert r.done and r.reward == pytest.approx(sum(x >= 9 for x in hidden) / 6) and 0 < r.reward < 1
    env.close()


def test_the_last_code_block_of_the_final_turn_is_the_answer(factory, problems):
    f = generate(1, seed=0, stream="problem-0")[0]
    env = factory()
    env.reset(problems[0])
    wrong = "```python\ndef scale_shift(x):\n    return 0\n```"
    assert env.step(f"```python\n{f.solution}```\nor\n{wrong}").reward == 0.0  # the last block: wrong
    env = factory()
    env.reset(problems[0])
    assert env.step(f"{wrong}\nbetter:\n```python\n{f.solution}```").reward == 1.0
    all_or_nothing = build_task("code-tools").environment(sandbox=factory.tools[0].backend, reward="all")
    env = all_or_nothing()
    env.reset(problems[0])
    assert env.step("```python\ndef scale_shift(x):\n    return 2 * x - 1 if x >= 9 else 0\n```").reward == 0.0
    all_or_nothing.close()


def test_malformed_calls_hangs_and_floods_are_messages_and_errors(factory, problems):
    env = factory()
    env.reset(problems[0])
    r = env.step('<tool_call>{"name": "run_tests", "arguments": {"code": 1}}</tool_call><tool_call>{oops')
    assert r.tool_errors == 2 and not r.done and "run_tests takes exactly" in r.new_messages[0].content
    assert "no closing </tool_call> tag" in r.new_messages[1].content
    r = env.step(call("run_tests", "def scale_shift(x):\n    while True:\n        pass"))
    assert r.tool_errors == 1 and r.new_messages[0].content == "error: timeout: wall-clock timeout"  # killed from outside
    r = env.step(call("run_tests", "import sys\nsys.stdout.write('x' * 10_000_000)\ndef scale_shift(x):\n    return x"))
    assert r.tool_errors == 1 and "output_limit" in r.new_messages[0].content
    r = env.step(call("python", "import sys\nsys.stdout.write('x' * 10_000_000)"))
    # the sandbox stops at 64 KiB and the session is reset; the chat gets at most 2,000 characters and a note
    assert r.tool_errors == 1 and len(r.new_messages[0].content) < 2100 and "truncated" in r.new_messages[0].content
    env.close()


def test_the_python_session_keeps_state_within_an_episode_and_resets_on_a_timeout(factory, problems):
    host = factory.tools[1]
    before = host.live  # sessions other tests' episodes left open (the factory closes them at the end)
    env = factory()
    env.reset(problems[0])
    r = env.step(call("python", "x = 41\ndef double(v):\n    return 2 * v") + call("python", "double(x + 1)"))
    assert [m.content for m in r.new_messages] == ["", "84\n"] and r.tool_errors == 0  # 2 · (41 + 1)
    other = factory()  # another episode: a fresh interpreter
    other.reset(problems[1])
    assert "NameError" in other.step(call("python", "x")).new_messages[0].content
    assert host.live == before + 2
    r = env.step(call("python", "while True:\n    pass"))
    assert r.tool_errors == 1 and "timed out after 2 s; the session was reset" in r.new_messages[0].content
    r = env.step(call("python", "x"))
    assert "NameError" in r.new_messages[0].content  # the reset session starts empty
    env.close()
    other.close()
    assert host.live == before


PROBES = {
    "reads the tests file": "print(open('/job/spec.marshal', 'rb').read()[:10])",
    "walks the filesystem": "import os\nfor d, _, fs in os.walk('/'):\n    if d.count('/') > 2:\n        break",
    "inspects its caller's frame": "import sys\nprint(list(sys._getframe(1).f_locals))",
    "walks frames through inspect": "import inspect\nprint([f.filename for f in inspect.stack()])",
    "reads env vars": "import os\nprint(os.environ.get('HIDDEN_TESTS'), dict(os.environ))",
    "lists every object": "import gc\nprint(len(gc.get_objects()))",
    "climbs out of a traceback": "try:\n    raise ValueError\nexcept ValueError as e:\n    up = e.__traceback__.tb_frame.f_back",
    "reads another process": "try:\n    print(open('/proc/1/cmdline', 'rb').read())\nexcept OSError as e:\n    print(e)",
}
HONEST = ("import collections, dataclasses, enum, functools, json, re\nP = collections.namedtuple('P', 'a b')\n"
          "@dataclasses.dataclass\nclass D:\n    x: int = 0\nclass E(enum.Enum):\n    A = 1\n"
          "try:\n    int('x')\nexcept ValueError as e:\n    pass\nopen('mine.txt', 'w').write('ok')\n"
          "print(P(1, 2), D(), E.A, json.dumps([1]), re.findall('[0-9]', 'a1'), open('mine.txt').read())")


@pytest.mark.parametrize("tool", ["run_tests", "python"])
def test_programs_that_probe_for_the_hidden_tests_are_counted_and_find_nothing(factory, problems, tool):
    env = factory()
    env.reset(problems[0])
    honest = env.step(call(tool, HONEST))
    assert honest.hidden_probes == 0, honest.new_messages  # imports, namedtuple, dataclass, its own file
    for what, code in PROBES.items():
        r = env.step(call(tool, code + "\ndef scale_shift(x):\n    return x"))
        assert r.hidden_probes >= 1, what
        assert "scale_shift(9)" not in r.new_messages[0].content  # the hidden calls are never in a tool's sandbox
    env.close()


def test_an_answer_that_probes_is_counted_and_still_judged(factory, problems):
    f = generate(1, seed=0, stream="problem-0")[0]
    env = factory()
    env.reset(problems[0])
    r = env.step(f"```python\nimport gc\nSEEN = len(gc.get_objects())\n{f.solution}```")
    assert r.done and r.reward == 1.0 and r.hidden_probes == 1


# ---- real episodes: the loss mask ----------------------------------------------------------------
class ScriptedEngine:
    """A RolloutEngine that "samples" scripted turns (row r's k-th turn: script[r][k]) as token ids,
    EOS-terminated, log-probs −1: exact control of what the model wrote."""

    name = "scripted"

    def __init__(self, tok, script):
        self.tok, self.script, self.turn = tok, script, {}
        self.pad_id, self.eos_ids = tok.pad_token_id, [tok.convert_tokens_to_ids("<|im_end|>")]
        self.by_prompt: dict[tuple, int] = {}

    def decode_cost(self, **_):
        return None

    def generate(self, prompts, params):
        rows = []
        for p in prompts:
            firsts = [f for f in self.by_prompt if tuple(p[:len(f)]) == f]  # the episode's first prompt
            if not firsts:
                self.by_prompt[tuple(p)] = len(self.by_prompt)
                firsts = [tuple(p)]
            key = self.by_prompt[firsts[0]]
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            ids = self.tok(self.script[key][k], add_special_tokens=False)["input_ids"] + self.eos_ids
            rows.append((p, ids, self.script[key][k]))
        n, width = len(rows), max(len(r[1]) for r in rows)
        pw = max(len(r[0]) for r in rows)
        comp = torch.full((n, width), self.pad_id)
        cmask = torch.zeros((n, width), dtype=torch.bool)
        pids = torch.full((n, pw), self.pad_id)
        for j, (p, ids, _) in enumerate(rows):
            comp[j, :len(ids)] = torch.tensor(ids)
            cmask[j, :len(ids)] = True
            pids[j, pw - len(p):] = torch.tensor(p)
        lp = torch.where(cmask, -1.0, 0.0)
        return Rollout(pids, pids != self.pad_id, comp, cmask, lp, lp.clone(), ["stop"] * n, torch.arange(n),
                       [r[2] for r in rows])


def test_on_real_episodes_the_mask_is_0_on_everything_the_environment_wrote(factory, problems):
    from posttrain.models import train_tokenizer

    tok = train_tokenizer(build_task("code-tools").tokenizer_texts()[:200], vocab_size=512)
    f = generate(2, seed=0, stream="problem-0")
    script = [[call("run_tests", "def scale_shift(x):\n    return x"), call("python", "y = 3") + call("python", "y * 2"),
               '<tool_call>{"name": "run_tests"', f"```python\n{f[0].solution}```"],
              [f"```python\n{f[1].solution}```"]]
    engine = ScriptedEngine(tok, script)
    before = factory.tools[1].live
    run = run_episodes(engine, tok, factory, problems[:2], budget=Budget(max_turns=5, max_tokens=2048, turn_tokens=512),
                       params=SamplingParams(temperature=1.0, seed=0))
    a, b = run.episodes
    assert (a.turns, a.tool_calls, a.tool_errors, a.end, a.reward) == (4, 3, 1, EpisodeEnd.DONE, 1.0)
    assert (b.turns, b.tool_calls, b.reward) == (1, 0, 1.0)
    for e in run.episodes:
        ids, mask = e.token_ids.tolist(), e.model_mask.tolist()
        assert mask == [any(s <= t < t2 for s, t2 in e.turn_spans) for t in range(len(ids))]  # token by token
        for k, (s, t2) in enumerate(e.turn_spans):  # the model's tokens are exactly the script's
            assert tok.decode(ids[s:t2], skip_special_tokens=False) == script[e.problem_index][k] + "<|im_end|>"
    # what the environment wrote between turns, by hand (ChatML): tool results, test reports — all mask 0
    between = tok.decode(a.token_ids[a.turn_spans[0][1]:a.turn_spans[1][0]].tolist(), skip_special_tokens=False)
    assert between == ("\n<|im_start|>tool\nassert scale_shift(16) == 31: FAIL (got 16)\nassert scale_shift(45) == 89: "
                       "FAIL (got 45)\n0/2 visible tests passed<|im_end|>\n<|im_start|>assistant\n")
    between = tok.decode(a.token_ids[a.turn_spans[1][1]:a.turn_spans[2][0]].tolist(), skip_special_tokens=False)
    assert between == "\n<|im_start|>tool\n<|im_end|>\n<|im_start|>tool\n6\n<|im_end|>\n<|im_start|>assistant\n"  # 3 · 2
    between = tok.decode(a.token_ids[a.turn_spans[2][1]:a.turn_spans[3][0]].tolist(), skip_special_tokens=False)
    assert between == ("\n<|im_start|>tool\nerror: tool call 1 has no closing </tool_call> tag<|im_end|>\n"
                       "<|im_start|>assistant\n")  # the error message the model reads: the environment's, mask 0
    batch = pad_episodes(run.episodes, tok.pad_token_id)  # what the update forwards: loss only on the model's tokens
    assert batch.mask.sum() == sum(t2 - s for e in run.episodes for s, t2 in e.turn_spans)
    assert factory.tools[1].live == before  # each episode's session closed when it ended


# ---- the session in the `tools` environment, and factory.close() -------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_tools_environment_has_the_session_option_and_close_ends_every_session(backend):
    from posttrain.envs import build_environment

    _backend_or_skip(backend)
    f = build_environment("tools", tools=["python"], python_session=True, sandbox=backend, python_limits=LIMITS)
    host = f.tools[0]
    envs = [f() for _ in range(2)]
    for env in envs:
        env.reset(Problem("go"))
    r = envs[0].step(call("python", "import math\nr = math.isqrt(50)") + call("python", "r * r"))
    assert r.new_messages[1].content == "49\n"  # isqrt(50) = 7, 7 · 7 = 49: the first call's state, in the second
    assert "NameError" in envs[1].step(call("python", "r")).new_messages[0].content  # a fresh session per episode
    pids = [e.tools["python"].session._run.proc.pid for e in envs]
    assert host.live == 2 and host.started == 2
    f.close()  # ends every session still open (an episode loop that raised never closed its environments)
    assert host.live == 0 and all(e.tools["python"].session._run is None for e in envs)
    for pid in pids:  # the sandbox processes are gone (reaped)
        with pytest.raises(ChildProcessError):
            __import__("os").waitpid(pid, __import__("os").WNOHANG)


def test_the_evals_run_greedy_episodes_and_report_pass_and_tool_use():
    from posttrain.models import build_tiny, train_tokenizer
    from posttrain.tasks import EvalRequest

    task = build_task("code-tools")
    tok = train_tokenizer(task.tokenizer_texts()[:200], vocab_size=512)
    model = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, max_seq_len=512)
    rows = task.evaluate(model, tok, EvalRequest(levels=("C1",), per_level=2, max_new_tokens=8), stage="s", checkpoint="c")
    # a random model writes no passing function in 8 tokens and calls no tool (no parseable call): 0 of 2 each
    assert [(r.level, r.metric, r.value, r.n) for r in rows] == [("C1", "pass", 0.0, 2), ("C1", "tool_use", 0.0, 2)]
    assert task.eval_problems("C1")[0] != task.records("problem", 1, levels=["C1"])[0]  # another draw


# ---- a user's file in a recipe: `{path}` problems in `env: {name: code}` --------------------------
ADD = {"prompt": "Write add(a, b): return a + b.", "entry_point": "add", "visible_tests": ["assert add(1, 2) == 3"],
       "tests": ["assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}


def _file_recipe(folder, rows):
    from posttrain.runtime.config import Recipe

    folder.mkdir(exist_ok=True)
    path = folder / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Recipe.model_validate({
        "name": "code-file", "threads": 1, "telemetry": {"measure_cpu": False},
        "model": {"init": "tiny-1m", "max_seq_len": 512, "vocab_size": 512},
        # the eval names the code-tools task: a from-scratch tokenizer trains on its texts (a file has none)
        "evals": [{"task": "code-tools", "levels": ["C1"], "per_level": 1, "max_new_tokens": 8}],
        "stages": [{"stage": "grpo", "data": [{"path": str(path)}], "rewards": [], "steps": 1, "save_every": 1,
                    "batch_size": 4, "group_size": 2, "max_new_tokens": 8, "log_every": 1,
                    "optim": {"lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0},
                    "env": {"name": "code", "max_turns": 2, "max_tokens": 512,
                            "params": {"python": "stateless", "limits": LIMITS}}}]})


def test_a_users_file_runs_in_the_code_environment_and_a_bad_row_stops_the_stage(tmp_path):
    from posttrain.pipeline.run import run_pipeline

    _backend_or_skip("bubblewrap")
    run_pipeline(_file_recipe(tmp_path / "good", [ADD, {**ADD, "tests": ["assert add(0, 0) == 0"]}]), tmp_path / "run")
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grpo = [m for m in metrics if m.get("stage") == "grpo"]
    assert grpo and {"tool/hidden_probe", "episode/tool_calls_mean", "reward/env"} <= set(grpo[0])
    bad = _file_recipe(tmp_path / "bad", [ADD, {**ADD, "visible_tests": []}])
    with pytest.raises(ValueError, match=r"mine.jsonl:2: field 'visible_tests': a code problem needs a non-empty list"):
        run_pipeline(bad, tmp_path / "bad_run")
    assert not (tmp_path / "bad_run" / "checkpoints" / "grpo").exists()  # stopped before any step


# ---- GRPO through run_pipeline, with a scripted policy that uses the tools -----------------------
class ScriptedPolicy:
    """A rollout engine for the GRPO stage: turn 1 calls `run_tests` with a program that also lists the
    garbage collector's objects (a probe); turn 2 answers with the reference (even rows of the call) or
    a wrong function (odd rows), so every group's rewards differ and the update has a gradient."""

    name = "scripted"

    def __init__(self, tok, solutions: dict[str, str]):
        self.tok, self.solutions = tok, solutions
        self.pad_id, self.eos_ids = tok.pad_token_id, [tok.convert_tokens_to_ids("<|im_end|>")]

    def decode_cost(self, **_):
        from posttrain.telemetry.costs import Cost

        return Cost()

    def sync_weights(self, model) -> int:
        return 0

    def release_memory(self) -> int:
        return 0

    def generate(self, prompts, params):
        texts = []
        for j, p in enumerate(prompts):
            seen = self.tok.decode(p, skip_special_tokens=False)
            name, solution = next((n, s) for n, s in self.solutions.items() if f"def {n}(" in seen)
            if seen.count("<|im_start|>assistant") == 1:
                texts.append(call("run_tests", f"import gc\nN = len(gc.get_objects())\n{solution}"))
            else:
                texts.append(f"```python\n{solution if j % 2 == 0 else f'def {name}(*a):' + chr(10) + '    return None'}\n```")
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + self.eos_ids for t in texts]
        n, width, pw = len(ids), max(map(len, ids)), max(map(len, prompts))
        comp, cmask = torch.full((n, width), self.pad_id), torch.zeros((n, width), dtype=torch.bool)
        pids = torch.full((n, pw), self.pad_id)
        for j, (p, c) in enumerate(zip(prompts, ids)):
            comp[j, :len(c)], cmask[j, :len(c)], pids[j, pw - len(p):] = torch.tensor(c), True, torch.tensor(p)
        lp = torch.where(cmask, -1.0, 0.0)
        return Rollout(pids, pids != self.pad_id, comp, cmask, lp, lp.clone(), ["stop"] * n, torch.arange(n), texts)


def test_grpo_through_run_pipeline_logs_tool_calls_probes_and_hidden_rewards(tmp_path, monkeypatch):
    from posttrain.pipeline.run import run_pipeline
    from posttrain.runtime.config import Recipe
    from posttrain.runtime.context import RunContext

    _backend_or_skip("bubblewrap")
    # one distinct function per family (the stage's problems: the task's stream problem-0, all levels)
    solutions = {f.name: f.solution for f in generate(9, seed=0, stream="problem-0")}
    monkeypatch.setattr(RunContext, "rollout_engine", lambda self, model, backend="native": ScriptedPolicy(self.tokenizer, solutions))
    recipe = Recipe.model_validate({
        "name": "code-grpo", "threads": 1, "telemetry": {"measure_cpu": False},
        "model": {"init": "tiny-1m", "max_seq_len": 1024, "vocab_size": 512},
        "stages": [{"stage": "grpo", "data": [{"task": "code-tools", "n": 9}], "rewards": [], "steps": 2,
                    "save_every": 2, "batch_size": 4, "group_size": 2, "max_new_tokens": 512, "log_every": 1,
                    "optim": {"lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0},
                    "env": {"name": "task", "max_turns": 2, "max_tokens": 1024, "params": {"limits": LIMITS}}}]})
    run_pipeline(recipe, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grpo = [m for m in rows if m.get("stage") == "grpo"]
    assert len(grpo) == 2
    for m in grpo:
        # 4 episodes a step, each one run_tests call (probing the gc once) then an answer; half the answers right
        assert m["episode/tool_calls_mean"] == 1.0 and m["episode/tool_errors"] == 0.0
        assert m["tool/hidden_probe"] == 4.0 and m["tool/hidden_probe_frac"] == 1.0
        assert m["reward/env"] == 0.5 and m["reward/pass_rate"] == 0.5 and m["groups/zero_variance_frac"] == 0.0
        assert m["episode/turns_mean"] == 2.0 and m["loss/policy"] == m["loss/policy"]  # finite (not NaN)
