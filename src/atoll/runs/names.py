"""The names atoll gives things outside the bucket: Prefect artifact-key slugs, round flow-run
names, and counted nouns in messages."""

from __future__ import annotations

__all__ = ["plural", "round_flow_name", "slug"]


def slug(text: str) -> str:
    """Lowercase letters, digits and dashes only (what Prefect artifact keys accept)."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in text.lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "run"


def plural(n: int, noun: str) -> str:
    """``1 learner``, ``2 learners``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def round_flow_name(round_: int) -> str:
    """The name of round ``round_``'s flow run, e.g. ``round-000017``."""
    return f"round-{round_:06d}"
