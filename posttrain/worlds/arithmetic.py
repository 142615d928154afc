"""The arithmetic world: a seeded, closed world with a gold judge, data for every stage.

Why a synthetic world: no hub is reachable, and a world with a gold judge lets every stage measure
what public trainers cannot — *true* quality behind a proxy (a reward model, a verifier).

The world has four levels of problems over natural numbers (subtraction never goes below zero):

| level | problems                           | demonstrated answer                      |
|-------|------------------------------------|------------------------------------------|
| L1    | a ∘ b, a, b ≤ 9, ∘ ∈ {+, −, ×}       | the fact in <think>, then the number      |
| L2    | 1–2 digit a ± b (one operand ≥ 10) | column work in <think>, then the number   |
| L3    | 3-digit a ± b                      | column work in <think>, then the number   |
| L4    | 2-digit × 1-digit                  | column work in <think>, then the number   |

Column work runs right to left, one single-digit fact per column (`7+8=15, 3+4+1=8`), so a model that
knows the L1 facts can learn L2–L4 as a procedure rather than memorise 20,000 sums — the same reason
chain-of-thought helps large models. A single-digit problem shows its one fact (`<think>3+4=7</think> 7`):
measured, a 0.9M model answering held-out single-digit questions *directly* reached only ~9% while
using the same facts inside column work at ~98% — the written fact is how it retrieves what it knows.

Single-digit facts are knowledge, not eval leakage: they appear in prose and inside the column work
of every multi-digit demonstration, the way they saturate real pretraining data. Decontamination is
by problem *as a question*: no held-out problem is asked, in any phrasing, by any training split.

What each stage gets:
- pretraining: prose facts ("7 plus 8 is 15."), worked columns in prose, and *question lists*
  (questions followed by more questions) — so the base knows facts but continues a chat question
  instead of answering it;
- SFT: chat demonstrations; a share ramble before answering (like human demonstrations do), so SFT
  alone leaves something for preference optimization to fix;
- preferences: pairs ranked by the gold judge (correct beats wrong; among correct, concise beats
  rambling), and rankings of K responses;
- RL: verifiable problems with their answer and level;
- eval: held-out problems per level, never seen as questions by any training split (decontamination
  is by problem, across every phrasing).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

LEVELS: dict[str, str] = {
    "L1": "1-digit +,-,*",
    "L2": "1-2 digit add/sub",
    "L3": "3-digit add/sub",
    "L4": "2-digit x 1-digit",
}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {"+": "plus", "-": "minus", "*": "times"}
SYMBOL = {"+": "+", "-": "-", "*": "*"}

QUESTION_TEMPLATES = (
    "What is {a} {o} {b}?",
    "What is {a}{o}{b}?",
    "Compute {a} {o} {b}.",
    "Calculate {a}{o}{b}.",
    "How much is {a} {w} {b}?",
    "{a} {o} {b} = ?",
)
RAMBLES = (
    "Hmm, let me see. ",
    "Okay, so this is a question about numbers. ",
    "Let me think about this carefully, step by step, before I answer. ",
    "That is a good question. Numbers can be tricky. ",
    "Alright. I will work it out. ",
)


@dataclass(frozen=True, order=True)
class Fact:
    a: int
    op: str
    b: int

    @property
    def value(self) -> int:
        return OPS[self.op](self.a, self.b)

    @property
    def level(self) -> str:
        if self.op == "*":
            return "L1" if self.a <= 9 and self.b <= 9 else "L4"
        big = max(self.a, self.b)
        return "L1" if big <= 9 else "L2" if big <= 99 else "L3"


@lru_cache(maxsize=None)
def all_facts(level: str) -> tuple[Fact, ...]:
    """Every problem of a level, in a fixed order."""
    if level == "L1":
        return tuple(Fact(a, op, b) for op in "+-*" for a in range(10) for b in range(10) if op != "-" or a >= b)
    if level == "L2":
        return tuple(Fact(a, op, b) for op in "+-" for a in range(100) for b in range(100)
                     if max(a, b) >= 10 and (op != "-" or a >= b))
    if level == "L4":
        return tuple(Fact(a, "*", b) for a in range(10, 100) for b in range(2, 10))
    raise ValueError(f"level {level} is sampled, not enumerated")


def sample_fact(level: str, rng: random.Random) -> Fact:
    if level == "L3":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        op = rng.choice("+-")
        return Fact(max(a, b), op, min(a, b)) if op == "-" else Fact(a, op, b)
    return rng.choice(all_facts(level))


def column_work(f: Fact) -> str:
    """Right-to-left column arithmetic, one single-digit fact per column: the <think> content.

    A single-digit problem is its one fact (`3*4=12`)."""
    if f.level == "L1":
        return f"{f.a}{f.op}{f.b}={f.value}"
    if f.op == "*":
        digits, carry, steps = str(f.a)[::-1], 0, []
        for d in digits:
            p = int(d) * f.b + carry
            steps.append(f"{d}*{f.b}" + (f"+{carry}" if carry else "") + f"={p}")
            carry = p // 10
        return ", ".join(steps)
    xs, ys = str(f.a)[::-1], str(f.b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if f.op == "+":
            s = x + y + carry
            steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
            carry = s // 10
        else:
            # Borrow shows as a leading 1 on the top digit, a borrow taken shows as "-1": 903-457 →
            # "13-7=6, 10-1-5=4, 9-1-4=4".
            borrow = 1 if x - carry < y else 0
            top = x + 10 * borrow
            steps.append(f"{top}" + ("-1" if carry else "") + f"-{y}={top - carry - y}")
            carry = borrow
    return ", ".join(steps)


def concise_answer(f: Fact) -> str:
    return f"<think>{column_work(f)}</think> {f.value}"


ANSWER_RE = re.compile(r"^(?:<think>(?P<think>.*?)</think>)?\s*(?P<body>[^<\d]*?)\s*(?P<answer>-?\d+)\s*$", re.S)


def parse_answer(completion: str) -> int | None:
    """The final integer of a well-formed response, or None when the response is off-format.

    Well-formed: an optional `<think>…</think>`, then free text (no digits: one answer only) ending in
    the integer, nothing after.
    """
    m = ANSWER_RE.match(completion.strip())
    return int(m.group("answer")) if m else None


def gold_reward(f: Fact, completion: str) -> float:
    """The gold judge's scalar: 0 wrong or off-format; 1 for a concise correct answer, less for rambling.

    Rambling costs up to 0.5 (0.01 per character of text between the reasoning and the answer).
    """
    if parse_answer(completion) != f.value:
        return 0.0
    body = ANSWER_RE.match(completion.strip()).group("body")
    return 1.0 - min(0.5, 0.01 * len(body))


# Held-out problems per level by default, and the most L3 may hold out (it is sampled from 810,000).
BASE_EVAL, EVAL_CAP_L3 = 200, 20_000


@dataclass
class ArithmeticWorld:
    """All splits of the world, deterministic for a seed. Eval problems are held out of every split."""

    seed: int = 0
    eval_per_level: int = BASE_EVAL  # held-out problems per level (fewer where a level has fewer)
    ramble_rate: float = 0.3  # share of SFT demonstrations that ramble before the answer
    level_weights: dict[str, float] = field(default_factory=lambda: {"L1": 0.35, "L2": 0.3, "L3": 0.1, "L4": 0.25})
    # every problem a training split has drawn from this instance, for contamination checks
    drawn: set[Fact] = field(default_factory=set, repr=False, compare=False)

    @cached_property
    def eval_facts(self) -> dict[str, list[Fact]]:
        """Held-out problems per level. The first `BASE_EVAL` of each level are the same whatever
        `eval_per_level` is; a larger eval appends problems drawn from a second stream, so a small
        eval is always a prefix of a large one (and a checkpoint's score on it does not move)."""
        rng = random.Random(f"{self.seed}-eval")
        out = {}
        for level in LEVELS:
            if level == "L3":
                seen, facts = set(), []
                while len(facts) < BASE_EVAL:
                    f = sample_fact("L3", rng)
                    if f not in seen:
                        seen.add(f)
                        facts.append(f)
                out[level] = facts
            else:
                pool = all_facts(level)
                # L1 has only 245 problems: hold out a quarter (the rest teach the format).
                out[level] = sorted(rng.sample(pool, min(BASE_EVAL, len(pool) // 4)))
        extra = random.Random(f"{self.seed}-eval-extra")
        for level, facts in out.items():
            cap = EVAL_CAP_L3 if level == "L3" else len(all_facts(level)) // 4
            seen = set(facts)
            while len(facts) < min(self.eval_per_level, cap):
                f = sample_fact(level, extra)
                if f not in seen:
                    seen.add(f)
                    facts.append(f)
        return out

    @cached_property
    def _held_out(self) -> frozenset[Fact]:
        return frozenset(f for facts in self.eval_facts.values() for f in facts)

    def train_fact(self, rng: random.Random, level: str | None = None) -> Fact:
        """A training problem (never an eval one), of `level` or drawn by the level weights."""
        if level is None:
            level = rng.choices(list(self.level_weights), weights=list(self.level_weights.values()))[0]
        while True:
            f = sample_fact(level, rng)
            if f not in self._held_out:
                self.drawn.add(f)
                return f

    # ---- pretraining -------------------------------------------------------------------------------
    def pretrain_documents(self, n: int, *, seed_offset: int = 0) -> Iterator[str]:
        """Prose facts, worked columns in prose, and question lists (questions followed by questions).

        Single-digit facts of every kind appear in prose, held-out ones included: that is the
        knowledge SFT is meant to unlock, and the base is probed on it in prose.
        """
        rng = random.Random(f"{self.seed}-pretrain-{seed_offset}")
        l1 = all_facts("L1")
        for _ in range(n):
            kind = rng.random()
            if kind < 0.45:
                facts = [rng.choice(l1) for _ in range(rng.randint(4, 8))]
                yield " ".join(prose_fact(f, rng) for f in facts)
            elif kind < 0.8:
                f = self.train_fact(rng, rng.choice(["L2", "L2", "L3", "L4"]))
                yield prose_work(f)
            else:
                qs = [question(self.train_fact(rng), rng) for _ in range(rng.randint(3, 6))]
                yield "Questions:\n" + "\n".join(qs)

    # ---- SFT ---------------------------------------------------------------------------------------
    def sft_example(self, rng: random.Random) -> list[dict[str, str]]:
        f = self.train_fact(rng)
        answer = concise_answer(f)
        if rng.random() < self.ramble_rate:
            answer = ramble(f, rng)
        return [{"role": "user", "content": question(f, rng)}, {"role": "assistant", "content": answer}]

    def sft_split(self, n: int, *, seed_offset: int = 0) -> list[list[dict[str, str]]]:
        rng = random.Random(f"{self.seed}-sft-{seed_offset}")
        return [self.sft_example(rng) for _ in range(n)]

    # ---- preferences -------------------------------------------------------------------------------
    def preference_split(self, n: int, *, seed_offset: int = 0) -> list[dict]:
        """Pairs ranked by the gold judge; `kind` says whether they differ in style or correctness."""
        rng = random.Random(f"{self.seed}-pref-{seed_offset}")
        out = []
        for i in range(n):
            f = self.train_fact(rng)
            good = concise_answer(f)
            if i % 2 == 0:
                bad, kind = ramble(f, rng), "style"
            else:
                bad, kind = wrong_answer(f, rng), "correctness"
            out.append({"prompt": question(f, rng), "chosen": good, "rejected": bad, "kind": kind,
                        "level": f.level, "answer": str(f.value)})
        return out

    # ---- RL / eval ---------------------------------------------------------------------------------
    def problems(self, n: int, *, levels: list[str] | None = None, seed_offset: int = 0) -> list[dict]:
        rng = random.Random(f"{self.seed}-problems-{seed_offset}")
        out = []
        for _ in range(n):
            f = self.train_fact(rng, rng.choice(levels) if levels else None)
            out.append(problem_row(f, question(f, rng)))
        return out

    def eval_problems(self, level: str) -> list[dict]:
        # One fixed phrasing per problem, so a checkpoint's score moves only with the checkpoint.
        return [problem_row(f, QUESTION_TEMPLATES[0].format(a=f.a, o=SYMBOL[f.op], b=f.b))
                for f in self.eval_facts[level]]

    def probe_prompts(self) -> list[tuple[str, int]]:
        """Prose probes of held-out single-digit facts: ('7 plus 8 is', 15)."""
        return [(f"{f.a} {WORDS[f.op]} {f.b} is", f.value) for f in self.eval_facts["L1"]]


def problem_row(f: Fact, prompt: str) -> dict:
    return {"prompt": prompt, "answer": str(f.value), "level": f.level, "a": f.a, "op": f.op, "b": f.b}


def question(f: Fact, rng: random.Random) -> str:
    t = rng.choice(QUESTION_TEMPLATES)
    return t.format(a=f.a, o=SYMBOL[f.op], b=f.b, w=WORDS[f.op])


def prose_fact(f: Fact, rng: random.Random) -> str:
    forms = [
        f"{f.a} {WORDS[f.op]} {f.b} is {f.value}.",
        f"{f.a} {WORDS[f.op]} {f.b} is {f.value}.",
        f"We know that {f.a} {WORDS[f.op]} {f.b} is {f.value}.",
    ]
    return rng.choice(forms)


def prose_work(f: Fact) -> str:
    return f"To find {f.a} {WORDS[f.op]} {f.b}, work the columns: {column_work(f)}. So {f.a} {WORDS[f.op]} {f.b} is {f.value}."


def ramble(f: Fact, rng: random.Random) -> str:
    """A correct but verbose demonstration: filler before the final answer."""
    filler = rng.choice(RAMBLES) + rng.choice(["I think the answer is", "The result should be", "So we get"])
    return f"<think>{column_work(f)}</think> {filler} {f.value}"


def wrong_answer(f: Fact, rng: random.Random) -> str:
    delta = rng.choice([-10, -2, -1, 1, 2, 10])
    wrong = max(0, f.value + delta) if f.value + delta != f.value else f.value + 1
    if wrong == f.value:
        wrong = f.value + 1
    return f"<think>{column_work(f)}</think> {wrong}"


def export_jsonl(world: ArithmeticWorld, out_dir: str | Path, *, n: int = 1000) -> dict[str, Path]:
    """Write every split as JSONL in the documented schemas (docs/data.md), to show users the formats."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {
        "pretrain": [{"text": d} for d in world.pretrain_documents(n)],
        "sft": [{"messages": m} for m in world.sft_split(n)],
        "preference": world.preference_split(n),
        "problems": world.problems(n),
    }
    splits.update({f"eval_{lv}": world.eval_problems(lv) for lv in LEVELS})
    paths = {}
    for name, rows in splits.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
