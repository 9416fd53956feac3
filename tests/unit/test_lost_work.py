"""Lost work by cause (runs/contributions.py LostWork), counted by hand on a learner's steps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from atoll.core.rejection import Rejection, RejectionKind
from atoll.runs.contributions import LOST_CAUSES, LostWork, fate_of


def rec(key: str, base: int, step: int, c_steps: int) -> Any:
    """What LostWork reads of a contribution record: key, base version, counters, its step."""
    return SimpleNamespace(key=key, base_version=base, c_steps=c_steps, info={"step": step})


def test_steps_by_fate_by_hand() -> None:
    """One learner, one fragment, steps 0..30:

    * A (base 0) carries (0, 8] and is merged: 8 merged;
    * (8, 10]: no contribution carries them (the adoption after A's publish overwrote them): 2 overlap;
    * B (base 3) carries (10, 18], is superseded by C (base 5, a newer base: C holds none of B's
      work before its own adoption), which carries (12, 20] and is refused as late twice:
      (10, 12] superseded, (12, 20] late (C, the newest that carries them, decides);
    * (20, 22] overlap; D (base 7) carries (22, 30] and is an outlier: 8 rejected;
    * E (base 7) carries (22, 31], was late once and then merged: (22, 31] merged after all, D's
      steps included (a step any merged contribution carries is merged)."""
    lost = LostWork()
    lost.note("m", 0, rec("A", 0, 8, 8), "merged")
    lost.note("m", 0, rec("B", 3, 18, 8), "superseded")
    lost.note("m", 0, rec("C", 5, 20, 8), "late")
    lost.note("m", 0, rec("C", 5, 20, 8), "late")
    lost.note("m", 0, rec("D", 7, 30, 8), "rejected")
    assert lost.steps() == {"m": {"merged": 8, "overlap": 4, "superseded": 2, "late": 8, "rejected": 8}}
    lost.note("m", 0, rec("E", 7, 31, 9), "late")
    lost.note("m", 0, rec("E", 7, 31, 9), "merged")
    lost.note("m", 0, rec("E", 7, 31, 9), "late")  # a merged contribution stays merged
    assert lost.steps()["m"] == {"merged": 17, "overlap": 4, "superseded": 2, "late": 8, "rejected": 0}
    # Another fragment's steps add up apart (every step feeds every fragment: divide by P).
    lost.note("m", 1, rec("F", 0, 6, 4), "merged")
    assert lost.steps()["m"] == {"merged": 21, "overlap": 6, "superseded": 2, "late": 8, "rejected": 0}


def test_a_newer_contribution_against_the_same_base_holds_the_superseded_ones_work() -> None:
    """A learner that publishes again before it adopts (same base) carries its earlier steps again:
    superseding it loses nothing when the newer one is merged."""
    lost = LostWork()
    lost.note("m", 0, rec("A", 0, 8, 8), "superseded")
    lost.note("m", 0, rec("B", 0, 16, 16), "merged")
    assert lost.steps()["m"] == {"merged": 16, "overlap": 0, "superseded": 0, "late": 0, "rejected": 0}


def test_unusable_records_and_the_causes_of_each_rejection_kind() -> None:
    lost = LostWork()
    lost.note("m", 0, None, "merged")  # unreadable record
    lost.note("m", 0, SimpleNamespace(key="x", base_version=0, c_steps=4, info={}), "merged")  # no step
    lost.note("m", 0, rec("y", 0, 3, 4), "merged")  # more steps than the learner's counter
    assert lost.steps() == {}
    assert fate_of(Rejection(RejectionKind.LATE, "")) == "late"
    assert fate_of(Rejection(RejectionKind.SUPERSEDED, "")) == fate_of(Rejection(RejectionKind.DUPLICATE, "")) == "superseded"
    assert {fate_of(Rejection(k, "")) for k in RejectionKind} == set(LOST_CAUSES) - {"overlap"}
