"""Preference data for the reward-model and DPO-family stages: read, count what was skipped, encode.

Sources are the recipe's `DataSource`s: a task (the arithmetic task's pairs are ranked by its gold
judge; posttrain/tasks/) or a JSONL file validated by `posttrain.data` (identical chosen/rejected and rankings with duplicate
responses are skipped and counted there; empty responses and one-response rankings are errors). Every
skip is reported by the stage (printed, and as `data/skipped` in its summary metrics) — never silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from posttrain.data import (
    DataError,
    EncodedCompletion,
    PreferencePair,
    Ranking,
    UnpairedExample,
    encode_completion,
    mix,
    read_jsonl,
)
from posttrain.data.records import Record
from posttrain.runtime.config import DataSource
from posttrain.tasks import TaskSet
from posttrain.tasks.arithmetic import world_rankings  # noqa: F401  (re-exported: where tests and users found it)


@dataclass
class Loaded:
    """Records of one kind from all sources, and what the readers skipped (reason → count)."""

    records: list[Record]
    skipped: dict[str, int] = field(default_factory=dict)
    summaries: list[str] = field(default_factory=list)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def load_records(tasks: TaskSet, sources: list[DataSource], kind: str, *, seed: int,
                 seed_offset: int = 0) -> Loaded:
    """Every source read whole (files validated row by row), then mixed by weight."""
    pools: list[tuple[list[Record], float]] = []
    out = Loaded(records=[])
    for src in sources:
        if src.path is not None:
            result = read_jsonl(src.path, kind)
            for reason, locations in result.report.skipped.items():
                out.skipped[reason] = out.skipped.get(reason, 0) + len(locations)
            out.summaries.append(result.report.summary())
            pools.append((result.records, src.weight))
        else:
            records = tasks.get(src.task).records(kind, src.n, seed_offset=seed_offset)
            pools.append((records, src.weight))
            out.summaries.append(f"task {src.task}: {len(records)} {kind} records")
    total = sum(len(p) for p, _ in pools)
    out.records = pools[0][0] if len(pools) == 1 else mix(pools, total, seed=seed)
    return out


def trim_to_response(enc: EncodedCompletion) -> EncodedCompletion:
    """Drop template tokens after the reply's last labelled token (ChatML's newline after <|im_end|>),
    so the last token of the sequence is the reply's EOS — where a rollout ends and a reward is read."""
    last = max(i for i, y in enumerate(enc.labels) if y != -100)
    return EncodedCompletion(enc.input_ids[: last + 1], enc.labels[: last + 1], enc.prompt_len, enc.truncated, enc.origin)


def encode_ranking_like(record: PreferencePair | Ranking, tokenizer, max_len: int, truncation: str) -> list[EncodedCompletion]:
    """The responses of a pair (chosen, rejected) or a ranking (best first), each as prompt + reply."""
    responses = [record.chosen, record.rejected] if isinstance(record, PreferencePair) else record.responses
    return [trim_to_response(encode_completion(record.prompt, r, tokenizer, max_len, truncation=truncation,
                                               origin=record.origin)) for r in responses]


def kto_partners(examples: list[UnpairedExample], seed: int) -> list[int]:
    """For each example i, a j with a different prompt: KTO's mismatched pair (x_i, y_j) for z0.

    Fixed once (a seeded cycle through the data), so the reference log-probs of the mismatched pairs
    can be cached like the others. Raises when every example has the same prompt.
    """
    n = len(examples)
    order = np.random.default_rng(seed).permutation(n).tolist()
    partner = [0] * n
    for k, i in enumerate(order):
        for step in range(1, n):
            j = order[(k + step) % n]
            if examples[j].prompt != examples[i].prompt:
                partner[i] = j
                break
        else:
            raise DataError("kto", "every example has the same prompt; KTO's reference point needs "
                                   "mismatched (prompt, completion) pairs, expected at least two prompts")
    return partner
