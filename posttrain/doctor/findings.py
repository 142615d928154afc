"""What the doctor says: typed findings with their evidence, in JSON and in plain words.

A finding names the rule that fired, the stage, a severity, the first step at which the signature
held, the curves that show it (each with the window that triggered the rule), what it means and the
first-line mitigation. `doctor.json` is `{"findings": [...], "cost": {...}}` of these, as dicts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Severity(str, Enum):  # str-valued: compares and serializes as its value (3.10 has no StrEnum)
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "critical": 2}[self.value]


@dataclass(frozen=True)
class Evidence:
    """One curve behind a finding: `values[i]` at `steps[i]`; `window` = the steps the rule judged."""

    metric: str
    steps: list[int]
    values: list[float]
    window: tuple[int, int]
    reference: float | None = None  # a level the rule compared against (the stage's start, a threshold)
    labels: list[str] | None = None  # names of the x points when they are checkpoints, not steps

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "steps": list(self.steps),
                "values": [v if math.isfinite(v) else None for v in self.values],
                "window": list(self.window), "reference": self.reference, "labels": self.labels}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Evidence:
        return Evidence(d["metric"], [int(s) for s in d["steps"]],
                        [float("nan") if v is None else float(v) for v in d["values"]],
                        (int(d["window"][0]), int(d["window"][1])), d.get("reference"), d.get("labels"))


@dataclass(frozen=True)
class Finding:
    rule: str
    stage: str
    severity: Severity
    first_step: int
    summary: str                  # one line: what was seen, with the numbers
    explanation: str              # why it matters / what it means
    mitigation: str               # the first thing to try
    evidence: list[Evidence] = field(default_factory=list)
    source: str = ""              # the paper or practice behind the rule

    @property
    def key(self) -> tuple[str, str]:
        return (self.rule, self.stage)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["evidence"] = [ev.to_json() for ev in self.evidence]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Finding:
        return Finding(rule=d["rule"], stage=d["stage"], severity=Severity(d["severity"]), first_step=int(d["first_step"]),
                       summary=d["summary"], explanation=d["explanation"], mitigation=d["mitigation"],
                       evidence=[Evidence.from_json(e) for e in d.get("evidence", [])], source=d.get("source", ""))

    def plain(self) -> str:
        """The finding as the terminal prints it: two lines of plain words."""
        when = f"from step {self.first_step}" if self.first_step > 0 else "between checkpoints"
        return (f"doctor [{self.severity.value}] {self.stage} · {self.rule} ({when}): {self.summary}\n"
                f"    why: {self.explanation}\n    try: {self.mitigation}")


def at_least(severity: Severity, threshold: Severity | None) -> bool:
    return threshold is not None and severity.rank >= threshold.rank


def evidence(metric: str, steps: list[int], values: list[float], window: tuple[int, int] | None = None,
             reference: float | None = None, labels: list[str] | None = None) -> Evidence:
    """An Evidence over a curve; the window defaults to the whole curve."""
    if window is None:
        window = (steps[0], steps[-1]) if steps else (0, 0)
    return Evidence(metric, list(steps), list(values), window, reference, labels)
