"""The Task protocol: what a stage trains on and what an eval measures.

A task supplies any of: SFT examples, preference pairs, unpaired (KTO) examples, rankings, problems
(with the judge that checks a reply), held-out evals, and optional extras — a gold judge (a graded
reward beside a learned one), a prose probe, a pretraining stream, texts to train a tokenizer on.
It declares which in `capabilities`; asking a task for one it lacks raises `MissingCapability`,
naming the task and what it does offer, so a stage can say "omitted" instead of faking it.

Records are the typed containers of `posttrain.data` (SFTExample, PreferencePair, …, Problem), so a
stage reads a task's records exactly as it reads a user's JSONL file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

from posttrain.data.records import Problem, Record
from posttrain.envs import EnvironmentFactory
from posttrain.tasks.evaluate import evaluate_problems
from posttrain.tasks.records import EvalRecord, EvalRequest, PhaseFn



class Capability(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    SFT = "sft"                    # chat demonstrations
    PREFERENCE = "preference"      # (prompt, chosen, rejected)
    UNPAIRED = "unpaired"          # (prompt, completion, label) for KTO
    RANKING = "ranking"            # K ≥ 2 responses, best first
    PROBLEMS = "problems"          # training problems with an answer or tests
    EVALS = "evals"                # held-out problems and the judge of a reply
    GOLD = "gold_judge"            # a graded reward on a reply (PPO logs it beside the RM; DPO's win rate)
    PROBE = "prose_probe"          # knowledge probed in prose, without chat behaviour
    PRETRAIN = "pretrain"          # a document stream for next-token pretraining
    TOKENIZER = "tokenizer_texts"  # texts to train a tokenizer on (a model built from scratch)
    ENV = "env"                    # the multi-turn environment its problems are played in (GRPO's `env: {name: task}`)


RECORD_KINDS: dict[str, Capability] = {"sft": Capability.SFT, "preference": Capability.PREFERENCE,
                                       "unpaired": Capability.UNPAIRED, "ranking": Capability.RANKING,
                                       "problem": Capability.PROBLEMS}


class TaskError(ValueError):
    """A task asked for something it cannot give (a capability, a level); one line naming the task."""


class MissingCapability(TaskError):
    """A task asked for something it does not supply; the message names the task and what it has."""

    def __init__(self, task: Task, capability: Capability | str):
        have = ", ".join(sorted(c.value for c in task.capabilities)) or "nothing"
        super().__init__(f"task {task.name!r} has no {Capability(capability).value!r} (it supplies: {have})")


Judge = Callable[[Sequence[Problem], Sequence[str], Sequence[str]], list[bool]]
GoldJudge = Callable[[Sequence[Problem], Sequence[str], Sequence[str]], list["float | None"]]


class Task:
    """Base of every task: each capability a method that raises `MissingCapability` unless overridden.

    Subclasses set `name`, `capabilities` (what they override) and `levels` (() for a task without
    levels). Sampling methods are deterministic in `seed_offset`."""

    name: str = "task"
    capabilities: frozenset[Capability] = frozenset()
    levels: tuple[str, ...] = ()

    def has(self, capability: Capability | str) -> bool:
        return Capability(capability) in self.capabilities

    def _missing(self, capability: Capability) -> MissingCapability:
        return MissingCapability(self, capability)

    # ---- training data ---------------------------------------------------------------------------
    def records(self, kind: str, n: int, *, seed_offset: int = 0, levels: Sequence[str] | None = None) -> list[Record]:
        """`n` records of a `posttrain.data` kind (sft, preference, unpaired, ranking, problem)."""
        if kind not in RECORD_KINDS:
            raise TaskError(f"task {self.name!r}: unknown record kind {kind!r}; expected one of {sorted(RECORD_KINDS)}")
        if not self.has(RECORD_KINDS[kind]):
            raise self._missing(RECORD_KINDS[kind])
        if levels is not None:
            self.check_levels(levels)
        return self._records(kind, n, seed_offset=seed_offset, levels=levels)

    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        raise self._missing(RECORD_KINDS[kind])

    def check_levels(self, levels: Sequence[str]) -> None:
        unknown = [lv for lv in levels if lv not in self.levels]
        if unknown:
            raise TaskError(f"task {self.name!r}: unknown level(s) {unknown}; expected some of {list(self.levels) or 'none (it has no levels)'}")

    # ---- evals -----------------------------------------------------------------------------------
    def eval_problems(self, level: str | None) -> list[Problem]:
        """Held-out problems of a level (None: the task's only set), never a training problem."""
        raise self._missing(Capability.EVALS)

    def judge(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[bool]:
        """Per reply: does it pass its problem (the eval's metric)."""
        raise self._missing(Capability.EVALS)

    def evaluate(self, model: Any, tokenizer: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                 phase: PhaseFn | None = None) -> list[EvalRecord]:
        """The task's held-out eval of one checkpoint: greedy pass@1 and sampled pass@k per level."""
        if not self.has(Capability.EVALS):
            raise self._missing(Capability.EVALS)
        return evaluate_problems(self, model, tokenizer, request, stage=stage, checkpoint=checkpoint, phase=phase)

    def heldout_problems(self, per_level: int) -> list[Problem]:
        """The first `per_level` held-out problems of every level (DPO/PPO's gold comparison)."""
        return [p for lv in (self.levels or (None,)) for p in self.eval_problems(lv)[:per_level]]

    # ---- extras ----------------------------------------------------------------------------------
    def gold_rewards(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[float | None]:
        """A graded reward per reply; None where the problem cannot be judged."""
        raise self._missing(Capability.GOLD)

    def probe_prompts(self) -> list[tuple[str, int]]:
        raise self._missing(Capability.PROBE)

    def pretrain_documents(self, n: int, *, seed_offset: int = 0) -> Iterator[str]:
        raise self._missing(Capability.PRETRAIN)

    def tokenizer_texts(self) -> list[str]:
        raise self._missing(Capability.TOKENIZER)

    def environment(self, **params: Any) -> EnvironmentFactory:
        """A factory of the environment this task's problems are played in (one per episode; close it)."""
        raise self._missing(Capability.ENV)

    def describe(self) -> str:
        """One line for start-up: what the task supplies and what it does not."""
        have = sorted(c.value for c in self.capabilities)
        lacks = sorted(c.value for c in Capability if c not in self.capabilities)
        return f"task {self.name}: supplies {', '.join(have) or 'nothing'}; omitted: {', '.join(lacks) or 'none'}"
