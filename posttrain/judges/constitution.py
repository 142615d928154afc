"""A written constitution: a YAML list of principles, validated before anything runs.

Bai et al. 2022, "Constitutional AI: Harmlessness from AI Feedback", appendix C: each principle is a
pair of natural-language requests — a *critique request* ("Identify specific ways in which the
assistant's last response is …") and a *revision request* ("Please rewrite the assistant response to
…") — and the feedback model of RL-CAI is asked a multiple-choice question built from a principle
(§4.1). A file here is a YAML list; each item:

    - name: no_filler                      # an identifier, unique in the file
      critique: Identify any filler …      # the critique request (SL-CAI)
      revision: Rewrite the response …     # the revision request (SL-CAI)
      preference: Which response …          # optional: the pairwise question (RL-CAI); default from `critique`
      check: no_filler                     # optional: a registered rule checker (judges/checkers.py) — the gold

Departures: (1) `check` is ours — on a synthetic world a rule decides compliance, so the gain is
measured by the rule, not by another model; (2) `preference` is optional, derived from the critique
request when absent. Errors name the file, the principle (index and name) and the field.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posttrain.judges.checkers import CHECKERS

FIELDS = ("name", "critique", "revision", "preference", "check")
REQUIRED = ("name", "critique", "revision")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


class ConstitutionError(ValueError):
    """A constitution file that cannot be used: the message names the file, the principle and the field."""


@dataclass(frozen=True)
class Principle:
    name: str
    critique: str          # the critique request
    revision: str          # the revision request
    preference: str        # the pairwise question the RL-CAI feedback model answers
    check: str | None      # a registered checker deciding compliance, or None (not rule-checkable)


@dataclass(frozen=True)
class Constitution:
    principles: tuple[Principle, ...]
    source: str  # the file it came from

    @property
    def checked(self) -> tuple[Principle, ...]:
        """The principles a rule can check (what compliance is measured on)."""
        return tuple(p for p in self.principles if p.check is not None)

    def sample(self, rng: random.Random) -> Principle:
        """One principle, uniformly (the paper samples a principle per critique/revision and per label)."""
        return self.principles[rng.randrange(len(self.principles))]

    def by_name(self, name: str) -> Principle:
        for p in self.principles:
            if p.name == name:
                return p
        raise KeyError(f"{self.source}: no principle named {name!r}; expected one of {[p.name for p in self.principles]}")


def default_preference(critique: str) -> str:
    return f"Which response better follows this principle? {critique}"


def _principle(item: Any, i: int, source: str, seen: set[str]) -> Principle:
    where = f"{source}: principles[{i}]"
    if not isinstance(item, dict):
        raise ConstitutionError(f"{where}: expected a mapping with keys {list(REQUIRED)} (and optionally preference, check); got {item!r}")
    name = item.get("name")
    if isinstance(name, str):
        where += f" ({name})"
    for key in item:
        if key not in FIELDS:
            raise ConstitutionError(f"{where}: {key}: unknown key; expected some of {list(FIELDS)}")
    for key in REQUIRED:
        if key not in item:
            raise ConstitutionError(f"{where}: {key}: missing; every principle needs {list(REQUIRED)}")
    for key in ("critique", "revision", "preference"):
        if key in item and (not isinstance(item[key], str) or not item[key].strip()):
            raise ConstitutionError(f"{where}: {key}: expected a non-empty string (got {item[key]!r})")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConstitutionError(f"{where}: name: expected an identifier (letters, digits, _ or -), got {name!r}")
    if name in seen:
        raise ConstitutionError(f"{where}: name: {name!r} names an earlier principle too; names must be unique")
    seen.add(name)
    check = item.get("check")
    if check is not None and check not in CHECKERS:
        raise ConstitutionError(f"{where}: check: unknown checker {check!r}; expected one of {sorted(CHECKERS)} or no `check`")
    return Principle(name, item["critique"].strip(), item["revision"].strip(),
                     item.get("preference", default_preference(item["critique"].strip())).strip(), check)


def parse_constitution(raw: Any, source: str) -> Constitution:
    if not isinstance(raw, list) or not raw:
        raise ConstitutionError(f"{source}: expected a non-empty YAML list of principles (got {type(raw).__name__})")
    seen: set[str] = set()
    return Constitution(tuple(_principle(item, i, source, seen) for i, item in enumerate(raw)), source)


def load_constitution(path: str | Path) -> Constitution:
    path = Path(path)
    if not path.is_file():
        raise ConstitutionError(f"{path}: constitution file does not exist" if not path.exists()
                                else f"{path}: is not a regular file; expected a constitution YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConstitutionError(f"{path}: not valid YAML: {e}") from None
    return parse_constitution(raw, str(path))
