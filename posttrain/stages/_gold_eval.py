"""The gold judge behind the proxy: score a policy's samples with a task's gold judge, and compare two
policies head to head on the same held-out prompts.

Used at the end of the DPO and PPO stages (policy vs the starting policy) and inside PPO and the
reward-model stage (the gold reward of the very samples the reward model scored). The judge is the
first task among the stage's data sources that has one (`gold_task`); a stage whose data has none
says so once and logs no gold metric. A response cut by the length budget gets gold 0 (the
arithmetic task's judge), as the between-stage evals count it off-format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data import encode_prompt
from posttrain.data.records import Problem
from posttrain.rollout import SamplingParams, make_engine
from posttrain.runtime.config import DataSource, task_names
from posttrain.runtime.context import RunContext
from posttrain.tasks import Capability, Task


def gold_task(ctx: RunContext, folder: str, sources: Sequence[DataSource], what: str, *,
              heldout: bool = False) -> Task | None:
    """The first data task with a gold judge (and held-out problems when `heldout`), or None — and then
    one line saying `what` is omitted."""
    for name in task_names(list(sources)):
        task = ctx.tasks.get(name)
        if task.has(Capability.GOLD) and (not heldout or task.has(Capability.EVALS)):
            return task
    ctx.console.print(f"[dim]{folder}: {what} omitted: no data source is a task with a gold judge "
                      f"(tasks: {task_names(list(sources)) or 'none'})")
    return None


def sample_gold(model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: list[Problem], task: Task, *,
                temperature: float, max_new_tokens: int, seed: int, batch: int = 128) -> list[float]:
    """Gold reward of one response per problem (greedy at temperature 0), in problem order."""
    engine = make_engine("native", model, tok)
    out: list[float] = []
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
        r = engine.generate([encode_prompt(p.prompt, tok) for p in chunk], params)
        out += [g or 0.0 for g in task.gold_rewards(chunk, r.texts, r.finish_reason)]
    return out


@dataclass(frozen=True)
class HeadToHead:
    wins: int
    losses: int
    ties: int
    policy_mean: float
    reference_mean: float

    @property
    def win_rate(self) -> float:
        """Wins over non-tied comparisons (NaN when every comparison tied)."""
        decided = self.wins + self.losses
        return self.wins / decided if decided else float("nan")

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/win_rate": self.win_rate, f"{prefix}/wins": self.wins, f"{prefix}/losses": self.losses,
                f"{prefix}/ties": self.ties, f"{prefix}/gold_reward": self.policy_mean,
                f"{prefix}/gold_reward_reference": self.reference_mean}


def head_to_head(policy: list[float], reference: list[float]) -> HeadToHead:
    """Compare gold rewards prompt by prompt. Shape: two equal-length lists."""
    if len(policy) != len(reference) or not policy:
        raise ValueError(f"head_to_head: {len(policy)} policy and {len(reference)} reference rewards; expected the same, ≥ 1")
    wins = sum(p > r for p, r in zip(policy, reference))
    losses = sum(p < r for p, r in zip(policy, reference))
    return HeadToHead(wins, losses, len(policy) - wins - losses, sum(policy) / len(policy), sum(reference) / len(reference))


def compare_to_reference(policy: PreTrainedModel, reference: PreTrainedModel, tok: PreTrainedTokenizerBase,
                         problems: list[Problem], task: Task, *, temperature: float, samples: int, max_new_tokens: int,
                         seed: int) -> HeadToHead:
    """`samples` rounds of one response per problem from each model (the same seeds), compared pairwise."""
    pol, ref = [], []
    for k in range(samples):
        s = seed + 1_000_003 * k
        pol += sample_gold(policy, tok, problems, task, temperature=temperature, max_new_tokens=max_new_tokens, seed=s)
        ref += sample_gold(reference, tok, problems, task, temperature=temperature, max_new_tokens=max_new_tokens, seed=s)
    return head_to_head(pol, ref)
