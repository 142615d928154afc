"""Decontamination: drop training records that contain an eval prompt, verbatim or lightly reworded.

Llama 3 (Dubey et al. 2024, §5.1.4, "Contamination analysis") calls an eval example contaminated when
a share T of its tokens lie in 8-grams the training corpus also contains. We use that measure per
record: an eval prompt's **coverage** by a record is the share of the eval prompt's word tokens that lie
in an n-gram the record also contains; a record is removed when some eval prompt's coverage reaches
`threshold`. Texts are compared as `words()` of their normalized form (text.py), so whitespace and
casing never matter.

Defaults and why: n = 5, threshold = 0.5.
- A changed word splits an eval prompt of L words into the words before it (k) and after it
  (L − k − 1); each side stays covered when it is ≥ n words long. With n = 5, one changed word
  anywhere leaves coverage ≥ (L − 5) / L ≥ 0.5 for L ≥ 10: a reworded prompt of a sentence is caught.
  Llama 3's n = 8 would let a word changed near the middle of a 12–15 word prompt through.
- An eval prompt shorter than n words counts as one n-gram: the whole prompt. Such prompts (the
  arithmetic world's "What is 12 + 7?" is 6 words, so it has two 5-grams) are caught only when the
  record contains them whole — "What is 12 + 8?" is a different problem, not a rewording.
- 0.5 errs towards removal: a record sharing half an eval prompt's words in 5-word runs is more likely
  a copy than chance. The cost of a false positive is one training record.

Departures (numbered):
1. Coverage is measured on the eval prompt, per record (Llama 3 measures an eval example against a
   whole pretraining corpus).
2. By default the whole record is searched (`part="all"`: prompt and responses — a generated reply can
   also recite an eval question); `part="prompt"` searches the prompt side only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.data.gates.report import GateResult, Removed, make_report
from posttrain.data.gates.text import Part, record_text, snippet, where, words
from posttrain.data.records import Problem, Record

DECONTAM_N = 5
DECONTAM_THRESHOLD = 0.5


@dataclass(frozen=True)
class EvalIndex:
    """The eval prompts' n-grams: gram → [(eval number, first word position)]. Build with `eval_index`."""

    n: int
    names: tuple[str, ...]         # each eval prompt's name (eval set and position)
    lengths: tuple[int, ...]       # each eval prompt's length in words
    grams: dict[tuple[str, ...], list[tuple[int, int]]]
    short_lengths: frozenset[int]  # lengths (< n) of the eval prompts that are one whole-prompt gram


def _ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def eval_index(prompts: Sequence[tuple[str, Problem | str]], *, n: int = DECONTAM_N) -> EvalIndex:
    """Index eval prompts given as (name, problem or prompt text) — every eval set a recipe names."""
    if n < 1:
        raise ValueError(f"n={n}; expected an int ≥ 1")
    names, lengths, short = [], [], set()
    grams: dict[tuple[str, ...], list[tuple[int, int]]] = defaultdict(list)
    for e, (name, prompt) in enumerate(prompts):
        text = record_text(prompt, Part.PROMPT) if isinstance(prompt, Problem) else prompt
        tokens = words(text)
        if not tokens:
            raise ValueError(f"eval prompt {name!r} has no words")
        names.append(name)
        lengths.append(len(tokens))
        if len(tokens) < n:
            short.add(len(tokens))
            grams[tuple(tokens)].append((e, 0))
        else:
            for i, g in enumerate(_ngrams(tokens, n)):
                grams[g].append((e, i))
    return EvalIndex(n, tuple(names), tuple(lengths), dict(grams), frozenset(short))


def coverage(index: EvalIndex, text: str) -> dict[int, float]:
    """For each eval prompt sharing an n-gram with `text`: the share of its words in shared n-grams."""
    tokens = words(text)
    covered: dict[int, set[int]] = defaultdict(set)
    for size in {index.n, *index.short_lengths}:
        for g in set(_ngrams(tokens, size)):
            for e, start in index.grams.get(g, ()):
                covered[e].update(range(start, start + len(g)))
    return {e: len(pos) / index.lengths[e] for e, pos in covered.items()}


def decontaminate(records: Sequence[Record], index: EvalIndex, *, threshold: float = DECONTAM_THRESHOLD,
                  part: Part | str = Part.ALL) -> GateResult:
    """Drop every record in which some eval prompt's coverage is ≥ `threshold`."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold}; expected a share of an eval prompt's words in (0, 1]")
    kept, removed = [], []
    for i, r in enumerate(records):
        text = record_text(r, part)
        hits = coverage(index, text)
        e, share = max(hits.items(), key=lambda kv: (kv[1], -kv[0]), default=(-1, 0.0))
        if share >= threshold:
            removed.append(Removed(where(r, i), "eval overlap",
                                   f"covers {share:.0%} of eval prompt {index.names[e]} ({index.n}-grams)", snippet(text)))
        else:
            kept.append(r)
    return GateResult(kept, make_report("decontaminate", len(records), len(kept), removed))
