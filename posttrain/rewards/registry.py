"""The verifier registry: the names a recipe gives verifiers, and how each is built from its parameters.

``build_verifier("math", timeout_s=3.0)`` checks the parameters against the builder's signature
(unknown or missing ones are a :class:`VerifierInputError` naming them) and returns a verifier
obeying the contract of ``base.py``. This module imports every verifier; none of them imports it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from typing import Any

from posttrain.rewards.base import Scores, Skip, Verifier, VerifierInputError
from posttrain.rewards.code import CodeVerifier
from posttrain.rewards.format import ThinkMode, format_reward
from posttrain.rewards.length import (
    LengthUnit,
    check_length_params,
    check_overlong_params,
    length_penalty,
    overlong_penalty,
)
from posttrain.rewards.math_verifier import MathVerifier
from posttrain.sandbox import Limits


class VerifierName(str, Enum):
    """Names a recipe can use for verifiers (``rewards: [{name: math, weight: 1.0}, ...]``)."""

    MATH = "math"  # math-verify answer checking, in killable worker processes
    FORMAT = "format"  # R1 <think>…</think> + exactly one answer over the whole completion
    OVERLONG = "overlong"  # DAPO soft overlong punishment (eq. 13)
    LENGTH = "length"  # plain linear length penalty
    CODE = "code"  # unit tests in the sandbox (posttrain.rewards.code)


def _build_math(
    *, timeout_s: float = 3.0, workers: int = 1, literal_numbers: bool = True, memory_limit_mb: int = 4096
) -> Verifier:
    return MathVerifier(
        timeout_s=timeout_s, workers=workers, literal_numbers=literal_numbers, memory_limit_mb=memory_limit_mb
    )


def _build_format(*, think: str = "required") -> Verifier:
    return functools.partial(format_reward, think=ThinkMode.parse(think))


def _build_overlong(*, max_len: int, cache: int, count: str = "tokens") -> Verifier:
    unit = LengthUnit.parse(count)
    check_overlong_params(max_len=max_len, cache=cache)
    return functools.partial(overlong_penalty, max_len=max_len, cache=cache, count=unit)


def _build_length(*, max_len: int, count: str = "tokens") -> Verifier:
    unit = LengthUnit.parse(count)
    check_length_params(max_len=max_len)
    return functools.partial(length_penalty, max_len=max_len, count=unit)


class _SandboxFailuresAreErrors:
    """Wraps ``posttrain.rewards.code.CodeVerifier``, whose only ``None`` is "the sandbox failed"."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, completions: list[str], /, **columns: Any) -> Scores:
        values = self.inner(completions, **columns)
        return Scores(values, [Skip.ERROR if v is None else None for v in values])

    def close(self) -> None:
        self.inner.close()


def _build_code(
    *,
    backend: str = "bubblewrap",
    limits: dict[str, Any] | None = None,
    concurrency: int | None = None,
    partial_credit: bool = False,
) -> Verifier:
    return _SandboxFailuresAreErrors(
        CodeVerifier(
            backend=backend,
            limits=None if limits is None else Limits(**limits),
            concurrency=concurrency,
            partial_credit=partial_credit,
        )
    )


_BUILDERS: dict[VerifierName, Callable[..., Verifier]] = {
    VerifierName.MATH: _build_math,
    VerifierName.FORMAT: _build_format,
    VerifierName.OVERLONG: _build_overlong,
    VerifierName.LENGTH: _build_length,
    VerifierName.CODE: _build_code,
}


def build_verifier(name: str, **params: Any) -> Verifier:
    """Build the named verifier with its recipe parameters; unknown names/parameters are errors."""
    try:
        key = VerifierName(name)
    except ValueError:
        known = ", ".join(v.value for v in VerifierName)
        raise VerifierInputError(f"unknown verifier {name!r}; expected one of: {known}") from None
    builder = _BUILDERS[key]
    signature = inspect.signature(builder)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not accepts_any:
        allowed = list(signature.parameters)
        for param in params:
            if param not in signature.parameters:
                raise VerifierInputError(
                    f"verifier {key.value!r}: unknown parameter {param!r}; expected one of: {', '.join(allowed)}"
                )
        missing = [
            p.name
            for p in signature.parameters.values()
            if p.default is inspect.Parameter.empty and p.name not in params
        ]
        if missing:
            raise VerifierInputError(
                f"verifier {key.value!r}: missing required parameter(s): {', '.join(missing)}"
            )
    return builder(**params)
