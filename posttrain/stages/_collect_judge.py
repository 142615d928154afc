"""An AI judge as the collect step's scorer (`rejection_sampling.judge`): the candidates of each prompt
rated by a chat model — alone on a rubric, or against each other in pairs — and the judge's agreement
with the task's gold judge where the task has one.

The judging itself is posttrain.judges' (docs/judges.md): `judge_scores` for the rubric (1–10, parsed
from "Score: N", unparseable → None), `judge_pairs` for pairs (each pair in both orders, a tie when the
orders disagree: position-bias control), `gold_agreement` / `pairs_from_scores` for agreement. This
module decides which candidates are judged and how a judgement becomes each candidate's score.

Departures / choices (numbered):
1. Only a candidate that ended its turn non-empty is judged: a truncated or empty one is never kept
   (rejection_sampling, departure 1), so asking about it would be paid for and thrown away.
2. Rubric: score = (N − 1) / 9 in [0, 1]. Pairwise: every pair of a prompt's judged candidates, a
   candidate's score its share of points (a win 1, a tie ½) over the pairs the judge could read — a
   round robin (Copeland-style), so best-of-K is the candidate that beats most of its siblings. A
   prompt with a single finished candidate has no pair: that candidate is unjudged (None), never guessed.
3. Agreement with gold: over every pair of a prompt's judged candidates that the gold judge separates
   (its rewards differ). Rubric scores become pair judgements by `pairs_from_scores` (higher wins,
   equal ties); pairwise judgements are compared as they are. Each batch's counts are journaled with
   its metrics, so the stage's pooled figure survives a resume without judging again.
4. The endpoint's replies are cached under `<run dir>/judge_cache` (judges/cache.py); a local judge has
   no reply cache: the collect journal (rejection_sampling, departure 4) already replays judged batches
   on resume without asking again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from posttrain.data import Problem
from posttrain.judges import (
    ChatBackend,
    EndpointBackend,
    LocalChatBackend,
    PairJudgement,
    Winner,
    gold_agreement,
    judge_pairs,
    judge_scores,
    pairs_from_scores,
)
from posttrain.judges.pairwise import DEFAULT_CRITERIA
from posttrain.judges.rubric import DEFAULT_RUBRIC
from posttrain.models import checkpoint_folder
from posttrain.runtime.config import CollectJudge, DataSource
from posttrain.runtime.context import RunContext
from posttrain.tasks.base import Capability, Task

LOW, HIGH = 1, 10  # the rubric's scale


def judge_backend(spec: CollectJudge, ctx: RunContext, model: Any, tokenizer: Any, engine: Any) -> ChatBackend:
    """The chat model behind the judge. `checkpoint: policy` is the model generating the candidates
    (policy or teacher), through the stage's own engine."""
    if spec.backend == "endpoint":
        return EndpointBackend(spec.base_url or "", spec.model or "", api_key_env=spec.api_key_env, budget=spec.budget,
                               timeout_s=spec.timeout_s, cache_dir=ctx.run_dir / "judge_cache")
    if spec.checkpoint == "policy":
        return LocalChatBackend(model, tokenizer, engine=engine, batch_size=spec.batch_size, seed=ctx.recipe.seed)
    return LocalChatBackend.from_checkpoint(checkpoint_folder(spec.checkpoint), batch_size=spec.batch_size,
                                            seed=ctx.recipe.seed)


def gold_task(ctx: RunContext, sources: Sequence[DataSource]) -> Task | None:
    """The task whose gold judge measures the judge: the first data task with one (None: a file, or no gold)."""
    for src in sources:
        if src.task is not None and (task := ctx.tasks.get(src.task)).has(Capability.GOLD):
            return task
    return None


@dataclass(frozen=True)
class Judged:
    scores: list[float | None]    # per row, in [0, 1]; None: not judged (truncated, empty, alone) or unparseable
    metrics: dict[str, float]     # judge/… counts of this batch (summed over batches by `pooled`)


def finished(texts: Sequence[str], finish: Sequence[str]) -> list[bool]:
    return [why != "length" and bool(t.strip()) for t, why in zip(texts, finish)]


def rubric_scores(backend: ChatBackend, spec: CollectJudge, problems: Sequence[Problem], texts: Sequence[str],
                  judged: Sequence[bool]) -> tuple[list[float | None], int]:
    """Each judged row rated alone; (scores in [0, 1] or None, requests sent)."""
    rows = [i for i, ok in enumerate(judged) if ok]
    got = judge_scores(backend, [problems[i].prompt for i in rows], [texts[i].strip() for i in rows],
                       rubric=spec.rubric or DEFAULT_RUBRIC, low=LOW, high=HIGH, max_tokens=spec.max_tokens)
    out: list[float | None] = [None] * len(texts)
    for i, s in zip(rows, got.scores):
        out[i] = None if s is None else (s - LOW) / (HIGH - LOW)
    return out, len(rows)


def group_pairs(judged: Sequence[bool], samples: int) -> list[tuple[int, int]]:
    """Every pair (a, b), a < b, of judged rows within one prompt's group (rows are prompt-major)."""
    out = []
    for start in range(0, len(judged), samples):
        rows = [i for i in range(start, start + samples) if judged[i]]
        out += list(combinations(rows, 2))
    return out


def round_robin(pairs: Sequence[tuple[int, int]], judgements: Sequence[PairJudgement], n: int) -> list[float | None]:
    """Each row's share of points over its readable pairs (win 1, tie ½); None for a row in none."""
    points, games = [0.0] * n, [0] * n
    for (a, b), j in zip(pairs, judgements):
        if j.winner is None:
            continue  # unparseable: no game
        games[a] += 1
        games[b] += 1
        if j.winner is Winner.TIE:
            points[a] += 0.5
            points[b] += 0.5
        else:
            points[a if j.winner is Winner.FIRST else b] += 1.0
    return [p / g if g else None for p, g in zip(points, games)]


def judge_batch(backend: ChatBackend, spec: CollectJudge, problems: Sequence[Problem], texts: Sequence[str],
                finish: Sequence[str], samples: int, gold: Sequence[float | None] | None) -> Judged:
    """Score one collect batch (rows prompt-major, `samples` per prompt; `problems[i]` is row i's) and
    measure the judge against `gold` (one gold reward per row; None: the task has no gold judge)."""
    ok = finished(texts, finish)
    pairs = group_pairs(ok, samples)
    if spec.mode == "rubric":
        scores, requests = rubric_scores(backend, spec, problems, texts, ok)
        judgements = pairs_from_scores([scores[a] for a, _ in pairs], [scores[b] for _, b in pairs])
    else:
        judgements = judge_pairs(backend, [problems[a].prompt for a, _ in pairs], [texts[a].strip() for a, _ in pairs],
                                 [texts[b].strip() for _, b in pairs], criteria=spec.criteria or DEFAULT_CRITERIA,
                                 max_tokens=spec.max_tokens) if pairs else []
        scores, requests = round_robin(pairs, judgements, len(texts)), 2 * len(pairs)
    m = {"judge/requests": float(requests), "judge/judged": float(sum(s is not None for s in scores)),
         "judge/unjudged_finished": float(sum(o and s is None for o, s in zip(ok, scores)))}
    if gold is not None:
        a = gold_agreement(judgements, [gold[x] for x, _ in pairs], [gold[y] for _, y in pairs])
        m.update({"judge/agree": float(a.agree), "judge/agreement_n": float(a.n), "judge/ties": float(a.ties),
                  "judge/unparseable": float(a.unparseable)})
        if a.n:
            m["judge/agreement_with_gold"] = a.rate
    return Judged(scores, m)


POOLED = ("judge/requests", "judge/judged", "judge/unjudged_finished", "judge/agree", "judge/agreement_n",
          "judge/ties", "judge/unparseable")


def pooled(batches: Sequence[dict[str, float]]) -> dict[str, float]:
    """The stage's judge counts over every batch's metrics, and the pooled agreement with gold and its
    binomial standard error: rate = Σ agree / Σ n, se = sqrt(rate (1 − rate) / n)."""
    out = {k: sum(b.get(k, 0.0) for b in batches) for k in POOLED if any(k in b for b in batches)}
    n = out.get("judge/agreement_n", 0.0)
    if n:
        rate = out["judge/agree"] / n
        out.update({"judge/agreement_with_gold": rate, "judge/agreement_se": (rate * (1 - rate) / n) ** 0.5})
    return out


def with_judge(total: Sequence[float | None], judged: Judged, weight: float) -> tuple[list[float | None], dict[str, float]]:
    """total + weight · the judge's score per row (None where either is None — unless weight is 0: the
    judge is then logged only and vetoes nothing, as a weight-0 verifier in rewards.combine), and the
    metrics `reward/judge` (mean judge score over judged rows) and `reward/total`."""
    out = list(total) if weight == 0 else [None if t is None or s is None else t + weight * s
                                           for t, s in zip(total, judged.scores)]
    scored = [s for s in judged.scores if s is not None]
    kept = [t for t in out if t is not None]
    return out, {**({"reward/judge": sum(scored) / len(scored)} if scored else {}),
                 **({"reward/total": sum(kept) / len(kept)} if kept else {})}
