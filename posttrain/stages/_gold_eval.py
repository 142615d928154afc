"""The gold judge behind the proxy: score a policy's samples with the arithmetic world's `gold_reward`,
and compare two policies head to head on the same held-out prompts.

Used at the end of the DPO and PPO stages (policy vs the starting SFT policy) and inside PPO (the gold
reward of the very samples the reward model scored). A response cut by the length budget gets gold 0,
as the between-stage evals count it off-format.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data import encode_prompt
from posttrain.rollout import SamplingParams, make_engine
from posttrain.worlds.arithmetic import LEVELS, ArithmeticWorld, Fact, gold_reward


def fact_of(row: dict) -> Fact | None:
    """The problem behind a world problem row (or a problem file row carrying a, op, b); else None."""
    try:
        return Fact(int(row["a"]), str(row["op"]), int(row["b"]))
    except (KeyError, TypeError, ValueError):
        return None


def gold_rewards(facts: list[Fact | None], texts: list[str], finish: list[str]) -> list[float | None]:
    """Gold reward per response; None where the problem is unknown; 0 for a response that never ended."""
    return [None if f is None else (gold_reward(f, t) if r == "stop" else 0.0) for f, t, r in zip(facts, texts, finish)]


def heldout_problems(world: ArithmeticWorld, per_level: int) -> list[dict]:
    """The world's held-out eval problems (never a training question), `per_level` of each level."""
    return [p for level in LEVELS for p in world.eval_problems(level)[:per_level]]


def sample_gold(model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: list[dict], *, temperature: float,
                max_new_tokens: int, seed: int, batch: int = 128) -> list[float]:
    """Gold reward of one response per problem (greedy at temperature 0), in problem order."""
    engine = make_engine("native", model, tok)
    out: list[float] = []
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
        r = engine.generate([encode_prompt(p["prompt"], tok) for p in chunk], params)
        out += [g or 0.0 for g in gold_rewards([fact_of(p) for p in chunk], r.texts, r.finish_reason)]
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
                         problems: list[dict], *, temperature: float, samples: int, max_new_tokens: int,
                         seed: int) -> HeadToHead:
    """`samples` rounds of one response per problem from each model (the same seeds), compared pairwise."""
    pol, ref = [], []
    for k in range(samples):
        s = seed + 1_000_003 * k
        pol += sample_gold(policy, tok, problems, temperature=temperature, max_new_tokens=max_new_tokens, seed=s)
        ref += sample_gold(reference, tok, problems, temperature=temperature, max_new_tokens=max_new_tokens, seed=s)
    return head_to_head(pol, ref)
