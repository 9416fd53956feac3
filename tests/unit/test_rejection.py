"""Typed rejections: a closed set of kinds, only LATE is not final, JSON round trip, schema-1 text."""

from __future__ import annotations

import pytest

from atoll.core.rejection import STORAGE_KINDS, Rejection, RejectionKind
from atoll.storage.validation import REJECTION_KINDS, InvalidInput


def test_only_late_is_not_final() -> None:
    assert [k for k in RejectionKind if not k.final] == [RejectionKind.LATE]
    assert not Rejection(RejectionKind.LATE, "x").final
    assert Rejection(RejectionKind.OUTLIER, "x").final


@pytest.mark.parametrize("kind", list(RejectionKind))
def test_round_trip_keeps_kind_and_detail_separate(kind: RejectionKind) -> None:
    r = Rejection(kind, "detail with: colons")
    assert r.to_dict() == {"kind": kind.value, "detail": "detail with: colons"}
    assert Rejection.from_dict(r.to_dict()) == r
    assert str(r) == f"{kind.value}: detail with: colons"


def test_unknown_kind_and_bad_detail_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown rejection kind 'nope'"):
        Rejection.from_dict({"kind": "nope", "detail": "x"})
    with pytest.raises(ValueError, match="detail must be a string"):
        Rejection.from_dict({"kind": "late", "detail": 3})
    with pytest.raises(ValueError, match="'not-a-kind' is not a valid RejectionKind"):
        Rejection("not-a-kind", "x")  # type: ignore[arg-type]  # the point of the test


def test_legacy_text_maps_late_prefix_only() -> None:
    assert Rejection.from_legacy_text("late: arrived 1.00s after") == Rejection(RejectionKind.LATE, "arrived 1.00s after")
    old = Rejection.from_legacy_text("superseded by a newer contribution")
    assert old.kind is RejectionKind.UNSPECIFIED and old.final


def test_invalid_input_carries_a_storage_kind() -> None:
    assert set(REJECTION_KINDS) == {k.value for k in STORAGE_KINDS}
    e = InvalidInput("checksum", "sha differs", url="memory://x")
    assert e.kind is RejectionKind.CHECKSUM
    assert e.rejection == Rejection(RejectionKind.CHECKSUM, "sha differs (memory://x)")
    with pytest.raises(ValueError, match="unknown bad-input kind"):
        InvalidInput("late", "a policy kind is not bad input")
