"""Procedurally generated small Python functions with visible and hidden tests (the `code-tools` task).

Each problem is one function from a family, its constants drawn from a seeded RNG: a signature, a
one-line description, a reference solution (trusted source, run here in the parent to compute the
expected values), 2 visible tests and 6 hidden ones, all `assert name(args) == expected` strings on
distinct inputs. Levels of difficulty:

- C1: one integer in, one operation (x·a + b, clamping, a digit sum);
- C2: a list in, a filter / count / scan (multiples of k, filter-and-scale, running maxima);
- C3: a string in, a transformation with a rule (a Caesar shift, run-length encoding, vowels
  replaced in the reversed string).

The same (seed, level, index) always gives the same problem; no download, no file.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LEVELS = ("C1", "C2", "C3")
VISIBLE, HIDDEN = 2, 6


@dataclass(frozen=True)
class CodeFunction:
    name: str                   # the entry point
    level: str
    signature: str              # "def scale_shift(x: int) -> int:"
    description: str            # one line: what it returns
    solution: str               # the reference, whole function source
    visible: tuple[str, ...]    # assert strings shown to the model
    hidden: tuple[str, ...]     # assert strings that decide the reward; never shown, never in a sandbox whole

    @property
    def prompt(self) -> str:
        return (f"Write this Python function:\n\n{self.signature}\n    \"\"\"{self.description}\"\"\"\n\n"
                "Visible tests (run them with the run_tests tool):\n" + "\n".join(self.visible)
                + "\n\nAnswer with the whole function in one ```python block, in a turn without a tool call.")


# a family: (name, level, signature, params(rng) -> dict, description template, solution template, inputs(rng) -> args)
Family = tuple[str, str, str, Callable[[random.Random], dict[str, Any]], str, str, Callable[[random.Random], tuple]]


def _ints(rng: random.Random) -> tuple:
    return (rng.randint(-50, 50),)


def _list(rng: random.Random) -> tuple:
    return ([rng.randint(-20, 20) for _ in range(rng.randint(0, 7))],)


def _text(rng: random.Random) -> tuple:
    return ("".join(rng.choice("aabbeiouxyz z") for _ in range(rng.randint(0, 9))),)


FAMILIES: list[Family] = [
    ("scale_shift", "C1", "def scale_shift(x: int) -> int:", lambda r: {"a": r.randint(2, 9), "b": r.randint(-9, 9)},
     "Return x * {a} + ({b}).", "def scale_shift(x):\n    return x * {a} + ({b})\n", _ints),
    ("clamp", "C1", "def clamp(x: int) -> int:", lambda r: {"lo": r.randint(-30, 0), "hi": r.randint(1, 30)},
     "Return x limited to the range [{lo}, {hi}].", "def clamp(x):\n    return max({lo}, min({hi}, x))\n", _ints),
    ("digit_sum", "C1", "def digit_sum(x: int) -> int:", lambda r: {"m": r.randint(2, 4)},
     "Return {m} times the sum of the decimal digits of abs(x).",
     "def digit_sum(x):\n    return {m} * sum(int(c) for c in str(abs(x)))\n", _ints),
    ("count_multiples", "C2", "def count_multiples(xs: list[int]) -> int:", lambda r: {"k": r.randint(2, 5)},
     "Return how many elements of xs are divisible by {k}.",
     "def count_multiples(xs):\n    return sum(1 for x in xs if x % {k} == 0)\n", _list),
    ("filter_scale", "C2", "def filter_scale(xs: list[int]) -> list[int]:",
     lambda r: {"t": r.randint(-5, 5), "m": r.randint(2, 4)},
     "Return the elements of xs greater than {t}, each multiplied by {m}, in their order.",
     "def filter_scale(xs):\n    return [x * {m} for x in xs if x > {t}]\n", _list),
    ("running_max", "C2", "def running_max(xs: list[int]) -> list[int]:", lambda r: {},
     "Return the list whose i-th element is the largest of xs[0..i].",
     "def running_max(xs):\n    out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n"
     "    return out\n", _list),
    ("caesar", "C3", "def caesar(s: str) -> str:", lambda r: {"k": r.randint(1, 25)},
     "Return s with every lowercase letter shifted {k} places forward in the alphabet (z wraps to a); "
     "other characters unchanged.",
     "def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
     _text),
    ("run_lengths", "C3", "def run_lengths(s: str) -> list[list]:", lambda r: {},
     "Return the run-length encoding of s: a list of [character, count] pairs, in order.",
     "def run_lengths(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
     "            out[-1][1] += 1\n        else:\n            out.append([c, 1])\n    return out\n", _text),
    ("swap_vowels", "C3", "def swap_vowels(s: str) -> str:", lambda r: {"c": r.choice("*#-")},
     "Return s reversed, with every vowel (a, e, i, o, u) replaced by '{c}'.",
     "def swap_vowels(s):\n    return ''.join('{c}' if ch in 'aeiou' else ch for ch in reversed(s))\n", _text),
]


def reference(solution: str, name: str) -> Callable[..., Any]:
    """The reference function, from its (trusted, generated here) source."""
    namespace: dict[str, Any] = {}
    exec(compile(solution, f"<reference {name}>", "exec"), namespace)  # our own template, not model output
    return namespace[name]


def make_function(family: Family, rng: random.Random) -> CodeFunction:
    name, level, signature, params, describe, solve, inputs = family
    p = params(rng)
    solution = solve.format(**p)
    fn = reference(solution, name)
    seen: list[tuple] = []
    for _ in range(200):  # distinct inputs: a hidden test never repeats a visible one
        args = inputs(rng)
        if args not in seen:
            seen.append(args)
        if len(seen) == VISIBLE + HIDDEN:
            break
    tests = [f"assert {name}({', '.join(repr(a) for a in args)}) == {fn(*args)!r}" for args in seen]
    return CodeFunction(name, level, signature, describe.format(**p), solution,
                        tuple(tests[:VISIBLE]), tuple(tests[VISIBLE:]))


def generate(n: int, *, seed: int, levels: tuple[str, ...] | list[str] | None = None,
             stream: str = "train") -> list[CodeFunction]:
    """`n` problems, cycling over the levels' families; deterministic in (seed, stream, levels)."""
    levels = tuple(levels or LEVELS)
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"code functions: unknown level(s) {unknown}; expected some of {list(LEVELS)}")
    families = [f for f in FAMILIES if f[1] in levels]
    rng = random.Random(f"code-functions-{seed}-{stream}")
    return [make_function(families[i % len(families)], rng) for i in range(n)]
