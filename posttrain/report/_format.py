"""Number formatting shared by the page and the terminal summary: SI rates, percentages, durations."""

from __future__ import annotations

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float | None, unit: str, digits: int = 3) -> str:
    """23.5e9, 'FLOP/s' → '23.5 GFLOP/s' (`digits` significant figures); None → '—'."""
    if value is None:
        return "—"
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}"


def pct(fraction: float | None, digits: int = 0) -> str:
    """0.123 → '12%'; None → '—'."""
    return "—" if fraction is None else f"{100 * fraction:.{digits}f}%"


def pct100(percent: float | None) -> str:
    """A value already in 0..100 → '12.3%' (one decimal under 10%, none above)."""
    if percent is None:
        return "—"
    return f"{percent:.1f}%" if percent < 10 else f"{percent:.0f}%"


def duration(seconds: float | None) -> str:
    """75.2 → '1m 15s'; 3.21 → '3.21 s'; None → '—'."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.3g} s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m"
