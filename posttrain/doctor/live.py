"""The doctor during a run: every `every` logged records of a stage, the stage rules run on what the
stage has logged so far; a new finding prints once; one at or above `stop_on` stops the stage.

Hooked at the one place metrics are logged (RunContext.log): stages know nothing of it. The cost is
the rules' own time (measured here, written to doctor.json as a share of the stage's wall time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.doctor.diagnose import diagnose_stage
from posttrain.doctor.findings import Finding, Severity, at_least
from posttrain.doctor.streams import StageStream


class DoctorStop(RuntimeError):
    """The live doctor stopped a stage: `finding` is why."""

    def __init__(self, finding: Finding, at_step: int) -> None:
        super().__init__(f"doctor stopped {finding.stage} at step {at_step}: {finding.rule} ({finding.severity.value}, "
                         f"from step {finding.first_step}) — {finding.summary}")
        self.finding = finding
        self.at_step = at_step


@dataclass
class StageCost:
    seconds: float = 0.0      # time inside the rules
    checks: int = 0           # times the rules ran
    stage_seconds: float = 0.0  # the stage's wall time (begin → end)

    def to_json(self) -> dict[str, float]:
        share = self.seconds / self.stage_seconds if self.stage_seconds > 0 else 0.0
        return {"seconds": round(self.seconds, 4), "checks": self.checks, "stage_seconds": round(self.stage_seconds, 2),
                "share": round(share, 6)}


@dataclass
class LiveDoctor:
    every: int = 10                       # run the rules every N logged records of a stage
    stop_on: Severity | None = None       # stop at a finding this severe (None: never)
    say: Any = print                      # how a finding is printed (the run's console)
    seen: dict[tuple[str, str], Finding] = field(default_factory=dict)
    cost: dict[str, StageCost] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stage: StageStream | None = None
    _t0: float = 0.0

    def begin(self, name: str, kind: str, config: dict[str, Any], records: list[dict[str, Any]] | None = None) -> None:
        """A stage starts; `records`: what it logged before a resume (so its rules see the whole curve)."""
        self._stage = StageStream(name, kind, config, list(records or []))
        self.cost.setdefault(name, StageCost())
        self._t0 = time.perf_counter()

    def end(self) -> None:
        """The stage finished (or stopped): one last check, and its wall time for the cost share."""
        if self._stage is None:
            return
        try:
            if self._stage.records and len(self._stage.records) % self.every:
                self.check()  # the records logged since the last check
        finally:
            self.cost[self._stage.name].stage_seconds += time.perf_counter() - self._t0
            self._stage = None

    def observe(self, record: dict[str, Any]) -> None:
        """One logged record (RunContext.log calls this after the sink). May raise DoctorStop."""
        if self._stage is None or record.get("stage") != self._stage.name:
            return
        self._stage.records.append(record)
        if len(self._stage.records) % self.every == 0:
            self.check()

    def check(self) -> list[Finding]:
        assert self._stage is not None
        t = time.perf_counter()
        findings = diagnose_stage(self._stage, self.errors)
        c = self.cost[self._stage.name]
        c.seconds += time.perf_counter() - t
        c.checks += 1
        new = [f for f in findings if f.key not in self.seen or f.severity.rank > self.seen[f.key].severity.rank]
        for f in new:
            self.seen[f.key] = f
            self.say(f.plain())
        stop = next((f for f in new if at_least(f.severity, self.stop_on)), None)
        if stop is not None:
            raise DoctorStop(stop, self._stage.last_step)
        return new

    def check_run(self, findings: list[Finding]) -> None:
        """Between-stage findings (the evals after a stage): print the new ones; may raise DoctorStop."""
        new = [f for f in findings if f.key not in self.seen]
        for f in new:
            self.seen[f.key] = f
            self.say(f.plain())
        stop = next((f for f in new if at_least(f.severity, self.stop_on)), None)
        if stop is not None:
            raise DoctorStop(stop, stop.first_step)

    def cost_json(self) -> dict[str, dict[str, float]]:
        return {k: v.to_json() for k, v in self.cost.items()}
