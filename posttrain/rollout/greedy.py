"""Greedy completions through the native engine, each batch optionally timed as a phase with its
decode cost: what every eval (between stages, in a stage, `posttrain eval`) generates with."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.rollout.engine import make_engine
from posttrain.rollout.sampling import SamplingParams
from posttrain.telemetry import costs

PhaseFn = Callable[[], AbstractContextManager[Any]]  # opens the phase a generation batch is timed in


@torch.no_grad()
def greedy(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[list[int]], max_new: int, batch: int,
           phase: PhaseFn | None = None, stop: tuple[str, ...] = ()):
    """Greedy completions (texts, finish reasons) through the native rollout engine; a row also ends at
    any of the `stop` strings (kept in its text, which ends there).

    With `phase`, each batch is timed in the phase it opens, costed as a padded batch decode (rows that
    finish early are counted to the longest row: an upper bound on the work)."""
    engine = make_engine("native", model, tok)
    texts, reasons = [], []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch):
        with phase() if phase else nullcontext() as p:
            r = engine.generate(prompts[i : i + batch], SamplingParams(temperature=0.0, max_new_tokens=max_new, stop=stop))
            if p is not None:
                p.cost = costs.decode(model.config, batch=len(r), prompt_len=r.prompt_ids.shape[1],
                                      new_tokens=max(1, r.completion_ids.shape[1]))
        texts += r.texts
        reasons += r.finish_reason
    model.train(was_training)
    return texts, reasons
