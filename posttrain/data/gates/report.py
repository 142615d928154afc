"""What a gate returns: the records it kept and typed counts of what it removed, by reason, with examples.

    kept, report = exact_dedup(records)
    report.removed                 # {"exact duplicate": 3}
    report.examples[0]             # Removed(where="sft.jsonl:7", reason="exact duplicate", detail="same text as sft.jsonl:2", text="…")
    report.metrics()               # {"gate/exact_dedup/seen": 10, "gate/exact_dedup/kept": 7, "gate/exact_dedup/removed/exact duplicate": 3}

`run_gates(records, [gate, ...])` chains gates in order (each sees what the previous kept) and returns
the survivors with one report per gate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from posttrain.data.records import Record

EXAMPLES = 3  # removed records a report keeps per reason, for a person to audit


@dataclass(frozen=True)
class Removed:
    where: str   # the record's origin (file:line, name[i]) or its index in the gate's input
    reason: str  # the gate's reason, one of its report's `removed` keys
    detail: str  # why, concretely: what it duplicates, which eval prompt it overlaps and how much
    text: str    # the start of the record's text


@dataclass(frozen=True)
class GateReport:
    gate: str                    # exact_dedup | near_dedup | decontaminate | length | format
    seen: int                    # records in
    kept: int                    # records out
    removed: dict[str, int]      # reason → records removed for it
    examples: tuple[Removed, ...]  # up to EXAMPLES per reason, in input order

    @property
    def n_removed(self) -> int:
        return self.seen - self.kept

    def summary(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in self.removed.items()) or "nothing"
        return f"{self.gate}: kept {self.kept} of {self.seen}; removed {why}"

    def metrics(self) -> dict[str, int]:
        out = {f"gate/{self.gate}/seen": self.seen, f"gate/{self.gate}/kept": self.kept}
        out.update({f"gate/{self.gate}/removed/{reason}": n for reason, n in self.removed.items()})
        return out


class GateResult(NamedTuple):
    kept: list[Record]
    report: GateReport


Gate = Callable[[Sequence[Record]], GateResult]


def make_report(gate: str, seen: int, kept: int, removed: Sequence[Removed]) -> GateReport:
    counts = Counter(r.reason for r in removed)
    shown: Counter[str] = Counter()
    picked = []
    for r in removed:
        if shown[r.reason] < EXAMPLES:
            shown[r.reason] += 1
            picked.append(r)
    return GateReport(gate, seen, kept, dict(counts), tuple(picked))


def run_gates(records: Sequence[Record], gates: Sequence[Gate]) -> tuple[list[Record], list[GateReport]]:
    """Apply `gates` in order; the survivors of the last and every gate's report."""
    kept, reports = list(records), []
    for gate in gates:
        kept, report = gate(kept)
        reports.append(report)
    return kept, reports
