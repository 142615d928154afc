"""A small code world: MBPP-style function problems and stdin → stdout problems, written for posttrain.

Enough for a recipe to exercise the `code` verifier end to end (prompt → completion → sandbox →
reward); far too small to train on. Each problem carries a reference solution that passes its own
tests (checked in tests/test_sandbox_verifier.py) — the tiny models will not write working code, so
tests feed hand-written candidates.

Rows follow the `Problem` record: `prompt`, `tests` (assert strings, or {"stdin", "stdout"} dicts),
`level` ("function" | "stdio"), plus `entry_point` and `reference` in the row for convenience.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodeProblem:
    name: str
    text: str  # the task, as the prompt states it
    tests: tuple[str, ...] | tuple[dict[str, str], ...]
    reference: str  # a solution that passes `tests`
    entry_point: str | None = None  # the function under test (None: a stdin → stdout program)

    @property
    def kind(self) -> str:
        return "function" if self.entry_point else "stdio"

    def prompt(self) -> str:
        if self.entry_point:
            example = self.tests[0]
            return (f"Write a Python function `{self.entry_point}`. {self.text}\n"
                    f"Your code should pass this test:\n{example}\n"
                    "Answer with the code in one ```python block.")
        return (f"Write a Python program that reads standard input and writes standard output. "
                f"{self.text}\nAnswer with the code in one ```python block.")

    def row(self) -> dict:
        return {"prompt": self.prompt(), "tests": list(self.tests), "level": self.kind,
                "entry_point": self.entry_point, "reference": self.reference, "name": self.name}

    def reference_completion(self) -> str:
        return f"Here is the solution.\n```python\n{self.reference}\n```\n"


PROBLEMS: tuple[CodeProblem, ...] = (
    CodeProblem(
        "sum_of_digits", "Return the sum of the decimal digits of a non-negative integer n.",
        ("assert digit_sum(0) == 0", "assert digit_sum(7) == 7", "assert digit_sum(1234) == 10",
         "assert digit_sum(99999) == 45"),
        "def digit_sum(n):\n    return sum(int(c) for c in str(n))", "digit_sum"),
    CodeProblem(
        "reverse_words", "Return the words of sentence s in reverse order, joined by single spaces.",
        ("assert reverse_words('hello world') == 'world hello'", "assert reverse_words('a') == 'a'",
         "assert reverse_words('one two three') == 'three two one'"),
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))", "reverse_words"),
    CodeProblem(
        "is_palindrome", "Return True if string s reads the same backwards, ignoring case.",
        ("assert is_palindrome('Level')", "assert not is_palindrome('posttrain')",
         "assert is_palindrome('') is True"),
        "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]", "is_palindrome"),
    CodeProblem(
        "pair_sums", "Return a tuple of the sums of adjacent elements of list xs.",
        ("assert pair_sums([1, 2, 3]) == (3, 5)", "assert pair_sums([5]) == ()",
         "assert pair_sums([-1, 1, -1, 1]) == (0, 0, 0)"),
        "def pair_sums(xs):\n    return tuple(a + b for a, b in zip(xs, xs[1:]))", "pair_sums"),
    CodeProblem(
        "char_counts", "Return a dict mapping each character of s to how often it occurs.",
        ("assert char_counts('abca') == {'a': 2, 'b': 1, 'c': 1}", "assert char_counts('') == {}"),
        "def char_counts(s):\n    out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n"
        "    return out", "char_counts"),
    CodeProblem(
        "circle_area", "Return the area of a circle of radius r.",
        ("assert math.isclose(circle_area(1), 3.141592653589793, rel_tol=1e-6)",
         "assert math.isclose(circle_area(2.5), 19.634954084936208, rel_tol=1e-6)"),
        "import math\n\ndef circle_area(r):\n    return math.pi * r * r", "circle_area"),
    CodeProblem(
        "unique_sorted", "Return the distinct elements of xs as a set.",
        ("assert unique_sorted([3, 1, 3, 2]) == set([1, 2, 3])", "assert unique_sorted([]) == set()"),
        "def unique_sorted(xs):\n    return set(xs)", "unique_sorted"),
    CodeProblem(
        "nth_fibonacci", "Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1.",
        ("assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55",
         "assert fib(90) == 2880067194370816120"),
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", "fib"),
    CodeProblem(
        "add_two", "The input is two integers on one line; print their sum.",
        ({"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "-5 5\n", "stdout": "0\n"},
         {"stdin": "1000000000000 1\n", "stdout": "1000000000001\n"}),
        "a, b = map(int, input().split())\nprint(a + b)"),
    CodeProblem(
        "count_lines", "Print how many non-empty lines the input has.",
        ({"stdin": "a\n\nb\n", "stdout": "2\n"}, {"stdin": "", "stdout": "0\n"}),
        "import sys\nprint(sum(1 for line in sys.stdin if line.strip()))"),
    CodeProblem(
        "sort_numbers", "The first line is n, the second n integers; print them sorted ascending, "
        "space-separated.",
        ({"stdin": "3\n3 1 2\n", "stdout": "1 2 3\n"}, {"stdin": "1\n7\n", "stdout": "7\n"}),
        "input()\nprint(*sorted(map(int, input().split())))"),
    CodeProblem(
        "fizzbuzz", "Read n and print FizzBuzz from 1 to n, one item per line.",
        ({"stdin": "5\n", "stdout": "1\n2\nFizz\n4\nBuzz\n"},
         {"stdin": "15\n",
          "stdout": "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n"}),
        "for i in range(1, int(input()) + 1):\n"
        "    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)"),
)


def code_problems(kind: str | None = None) -> list[CodeProblem]:
    """All problems, or those of one kind ('function' | 'stdio')."""
    if kind not in (None, "function", "stdio"):
        raise ValueError(f"code_problems: kind must be 'function', 'stdio' or None, got {kind!r}")
    return [p for p in PROBLEMS if kind is None or p.kind == kind]


def problem_rows(kind: str | None = None) -> list[dict]:
    """The problems as dataset rows (`prompt`, `tests`, `level`, …), ready for the `code` verifier."""
    return [p.row() for p in code_problems(kind)]
