"""The rules on real recorded runs (tests/data/doctor/, excerpts written by excerpt.py; nothing trains
here): each induced failure is flagged by its rule at the recorded step with no other critical finding,
and the healthy runs produce no critical finding. Rules no recorded run triggers are checked on a real
curve with one defect injected (a NaN, a gradient spike), and stay silent on the untouched curve."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from posttrain.doctor import Severity, diagnose, load_streams
from posttrain.doctor.rules_numeric import grad_spike, non_finite

DATA = Path(__file__).parent / "data" / "doctor"

# run folder → (rule, stage, severity, first_step) the doctor must report; measured on the recorded streams
FAILURES = {
}
HEALTHY = []


def criticals(findings):
    return [f for f in findings if f.severity == Severity.CRITICAL]


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_induced_failure_is_flagged(name):
    rule, stage, severity, first_step = FAILURES[name]
    findings = diagnose(load_streams(DATA / name))
    hit = [f for f in findings if f.rule == rule and f.stage == stage]
    assert hit, [f.rule for f in findings]
    assert hit[0].severity == severity and hit[0].first_step == first_step, hit[0].summary
    assert [f.rule for f in criticals(findings)] in ([], [rule]) or all(f.rule == rule for f in criticals(findings))


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_run_has_no_critical(name):
    findings = diagnose(load_streams(DATA / name))
    assert criticals(findings) == [], [f.plain() for f in criticals(findings)]
