"""`StrEnum` for Python 3.10 (stdlib from 3.11): members are their string values, so a YAML value
compares and serializes as itself."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised only on 3.10

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


__all__ = ["StrEnum"]
