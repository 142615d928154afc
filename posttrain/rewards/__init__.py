"""Rewards for RLVR: batched verifiers ``(completions, **columns) -> list[float | None]``.

``None`` means *cannot judge*: the item is skipped and counted, never silently 0 or 1. See
docs/rewards.md. Modules:

- ``base``           the verifier contract (:class:`Verifier`, :class:`Scores`, :class:`Skip`,
                     :class:`VerifierInputError`); every verifier module imports it, it imports none
- ``registry``       the names a recipe uses (:class:`VerifierName`) and :func:`build_verifier`;
                     imports every verifier
- ``combine``        the weighted :func:`combine` of several verifiers, with per-verifier counts
- ``format``         R1 ``<think>…</think>`` + exactly one answer; the shared answer-span grammar
- ``math_verifier``  math-verify in killable worker processes, exact-integer fast path
- ``length``         DAPO soft overlong punishment, plain length penalty
- ``passk``          unbiased pass@k (Chen et al. 2021), per-level aggregation, standard errors
- ``code``           unit tests in the sandbox (``posttrain.sandbox``)

(The math module is ``math_verifier``, not ``math``: a ``math.py`` here would become the stdlib
``math`` for any script run from this folder, and ``posttrain.rewards.math`` would shadow any
``math`` name bound in this package.)
"""

from __future__ import annotations

from posttrain.rewards.base import Scores, Skip, Verifier, VerifierInputError
from posttrain.rewards.combine import CombinedRewards, VerifierStats, WeightedVerifier, combine
from posttrain.rewards.format import (
    ThinkMode,
    answer_region,
    answer_span,
    extract_answer,
    final_answer,
    format_answer,
    format_reward,
)
from posttrain.rewards.length import (
    LengthUnit,
    length_penalty,
    overlong_penalty,
    soft_overlong,
)
from posttrain.rewards.math_verifier import MathVerifier
from posttrain.rewards.passk import (
    PassAtK,
    ProblemOutcome,
    pass_at_k,
    pass_at_k_by_level,
    pass_at_k_naive,
    stderr_of_mean,
)
from posttrain.rewards.registry import VerifierName, build_verifier

__all__ = [
    "CombinedRewards",
    "LengthUnit",
    "MathVerifier",
    "PassAtK",
    "ProblemOutcome",
    "Scores",
    "Skip",
    "ThinkMode",
    "Verifier",
    "VerifierInputError",
    "VerifierName",
    "VerifierStats",
    "WeightedVerifier",
    "answer_span",
    "build_verifier",
    "combine",
    "answer_region",
    "extract_answer",
    "final_answer",
    "format_answer",
    "format_reward",
    "length_penalty",
    "overlong_penalty",
    "pass_at_k",
    "pass_at_k_by_level",
    "pass_at_k_naive",
    "soft_overlong",
    "stderr_of_mean",
]
