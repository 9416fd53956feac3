"""Commit-record stats read as numbers, and numbers written for people.

Stats in a commit record are free-form JSON for people: any of them may be a string, a list, a
bool, an integer far beyond float range. Everything that computes with them or prints them goes
through these."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite", "fmt_bytes", "fmt_int", "fmt_num", "fmt_pct", "fmt_s", "per_token", "short"]


def finite(x: Any) -> float | None:
    """``x`` as a finite float, or None if it is not a number (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        v = float(x)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def fmt_num(x: Any, spec: str, missing: str = "-") -> str:
    v = finite(x)
    return missing if v is None else format(v, spec)


def fmt_int(x: Any, spec: str = "", missing: str = "-") -> str:
    if isinstance(x, bool) or not isinstance(x, int) or abs(x) >= 10**18:
        return missing
    return format(x, spec)


def fmt_s(x: Any) -> str:
    v = finite(x)
    return f"{v:.2f} s" if v is not None else "-"


def fmt_pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def per_token(n: int, tokens: float) -> str:
    """Bytes per token, or ``-`` before any token."""
    return f"{n / tokens:,.1f}" if tokens > 0 else "-"


def short(x: Any, limit: int = 200) -> str:
    """A stat as one line of at most ``limit`` characters; ``-`` if it is not a string or number."""
    text = " ".join(str(x).split()) if isinstance(x, str | int | float) and not isinstance(x, bool) else "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."
