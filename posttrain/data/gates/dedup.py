"""Duplicate removal: exact (same normalized text) and near (MinHash LSH over n-gram shingles).

Both keep the first record of a group, in input order, and name what each removed record duplicates.

**Exact** — two records are duplicates when their `record_text` (text.py: NFKC, case-folded, whitespace
collapsed; every prompt and response piece, in order) is the same string. By default the whole record
is compared (`part="all"`): K different replies to one prompt are not duplicates; `part="prompt"`
keeps one record per prompt.

**Near** — Broder (1997), "On the resemblance and containment of documents": the resemblance of two
texts is the Jaccard similarity |S₁ ∩ S₂| / |S₁ ∪ S₂| of their shingle sets, estimated by MinHash; the
candidate pairs come from locality-sensitive hashing over bands of the signature (Leskovec, Rajaraman
& Ullman, *Mining of Massive Datasets*, §3.4), as `datasketch.MinHashLSH` implements them. A record
is removed when its Jaccard with an **earlier kept** record is ≥ `threshold`.

Defaults and why: word 3-gram shingles (`words()`: operators and punctuation are words), threshold
0.7, 128 permutations. A one-word change in the middle of a w-word text replaces 3 of its w − 2
shingles, so J = (w − 5) / (w + 1): ≥ 0.7 for w ≥ 19 words — a lightly edited copy of a record of a
sentence or two is caught; shorter records need a closer copy (they also have fewer ways to differ
without meaning something else). `shingle="char"` uses character n-grams of the normalized text
(n = 5 is the usual choice) for texts where word boundaries carry little.

Departures (numbered):
1. LSH only proposes candidates: each is confirmed with the **exact** Jaccard of the two shingle sets,
   so no record is removed for an LSH false positive. That lets the bands favour recall: datasketch
   picks b bands of r rows minimizing a weighted sum of false-positive and false-negative mass around
   the threshold; with its default equal weights a pair *at* J = 0.7 becomes a candidate with
   probability 1 − (1 − J^r)^b = 0.44 (b = 14, r = 9) — most near-threshold duplicates would slip
   through. We weight false negatives 99:1 (`LSH_WEIGHTS`): b = 25, r = 5, so a pair at J = 0.7 is a
   candidate with probability 0.99, at 0.8 with 1.0, and a pair at J = 0.3 costs an exact check 6% of
   the time. `near_dedup_exact` is the O(N²) reference that misses none; a test checks the two agree
   on a file with known near-duplicates.
2. A text with fewer words (characters) than n is one shingle: the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.data.gates.report import GateResult, Removed, make_report
from posttrain.data.gates.text import Part, normalize, record_text, snippet, where, words
from posttrain.data.records import Record

NEAR_THRESHOLD = 0.7  # Jaccard of word 3-gram sets (see the module docstring for why)
NUM_PERM = 128        # MinHash permutations: the Jaccard estimate's standard error is ≈ sqrt(J(1−J)/128) ≤ 0.044
SEED = 1              # MinHash permutation seed: the same input gives the same result every run
LSH_WEIGHTS = (0.01, 0.99)  # (false positive, false negative) weights for the bands: recall first (departure 1)


def exact_dedup(records: Sequence[Record], *, part: Part | str = Part.ALL) -> GateResult:
    """Drop every record whose normalized text equals an earlier record's."""
    first: dict[str, int] = {}
    kept, removed = [], []
    for i, r in enumerate(records):
        key = record_text(r, part)
        if key in first:
            j = first[key]
            removed.append(Removed(where(r, i), "exact duplicate", f"same text as {where(records[j], j)}",
                                   snippet(key)))
        else:
            first[key] = i
            kept.append(r)
    return GateResult(kept, make_report("exact_dedup", len(records), len(kept), removed))


def shingles(text: str, *, n: int = 3, shingle: str = "word") -> frozenset[str]:
    """The n-gram shingle set of a text: word n-grams (`words()`) or character n-grams of `normalize`."""
    if shingle == "word":
        units: Sequence[str] = words(text)
        joiner = " "
    elif shingle == "char":
        units, joiner = normalize(text), ""
    else:
        raise ValueError(f"shingle={shingle!r}; expected 'word' or 'char'")
    if n < 1:
        raise ValueError(f"n={n}; expected an int ≥ 1")
    if len(units) <= n:
        return frozenset([joiner.join(units)])
    return frozenset(joiner.join(units[i:i + n]) for i in range(len(units) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _check(threshold: float) -> None:
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold}; expected a Jaccard similarity in (0, 1]")


def _removed(records: Sequence[Record], i: int, j: int, sim: float, text: str) -> Removed:
    return Removed(where(records[i], i), "near duplicate",
                   f"Jaccard {sim:.2f} with {where(records[j], j)}", snippet(text))


def near_dedup(records: Sequence[Record], *, threshold: float = NEAR_THRESHOLD, n: int = 3, shingle: str = "word",
               part: Part | str = Part.ALL, num_perm: int = NUM_PERM) -> GateResult:
    """Drop every record whose shingle Jaccard with an earlier kept record is ≥ `threshold` (MinHash LSH
    candidates, each confirmed exactly). Needs `datasketch` (the `gates` extra)."""
    _check(threshold)
    try:
        from datasketch import MinHash, MinHashLSH  # optional extra: only this gate needs it
    except ImportError:
        raise ImportError("near-duplicate removal needs datasketch: pip install 'posttrain[gates]'") from None
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    texts = [record_text(r, part) for r in records]
    sets = [shingles(t, n=n, shingle=shingle) for t in texts]
    kept, removed = [], []
    for i, s in enumerate(sets):
        m = MinHash(num_perm=num_perm, seed=SEED)
        m.update_batch([x.encode() for x in s])
        best = max(((jaccard(s, sets[j]), j) for j in lsh.query(m)), default=(0.0, -1), key=lambda t: (t[0], -t[1]))
        if best[0] >= threshold:
            removed.append(_removed(records, i, best[1], best[0], texts[i]))
        else:
            lsh.insert(i, m)  # keys are input indices: only kept records are ever candidates
            kept.append(records[i])
    return GateResult(kept, make_report("near_dedup", len(records), len(kept), removed))


def near_dedup_exact(records: Sequence[Record], *, threshold: float = NEAR_THRESHOLD, n: int = 3,
                     shingle: str = "word", part: Part | str = Part.ALL) -> GateResult:
    """The reference `near_dedup`: every record against every earlier kept one, exact Jaccard. O(N²)."""
    _check(threshold)
    texts = [record_text(r, part) for r in records]
    sets = [shingles(t, n=n, shingle=shingle) for t in texts]
    kept_idx: list[int] = []
    removed = []
    for i, s in enumerate(sets):
        best = max(((jaccard(s, sets[j]), j) for j in kept_idx), default=(0.0, -1), key=lambda t: (t[0], -t[1]))
        if best[0] >= threshold:
            removed.append(_removed(records, i, best[1], best[0], texts[i]))
        else:
            kept_idx.append(i)
    return GateResult([records[i] for i in kept_idx], make_report("near_dedup", len(records), len(kept_idx), removed))


def lsh_bands(threshold: float = NEAR_THRESHOLD, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands b, rows r) datasketch picks for a threshold: a pair at Jaccard J is a candidate with
    probability 1 − (1 − J^r)^b."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    return lsh.b, lsh.r
