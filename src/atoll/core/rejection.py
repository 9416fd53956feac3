"""Why a contribution was not merged: a typed value every layer keys on, never its text.

A :class:`Rejection` is a kind from the closed set :class:`RejectionKind` plus a human-readable
detail. Code decides on the kind (is it final? should the next round reconsider it?); people read
the detail. Commit records store the two as separate fields (``{"kind": ..., "detail": ...}``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["RejectionKind", "Rejection", "STORAGE_KINDS", "MAX_DETAIL_CHARS", "MAX_RECORDED_PER_LEARNER",
           "MAX_RECORDED_REJECTIONS", "MAX_SUMMARY_LEARNERS", "summarize_rejections"]

MAX_DETAIL_CHARS = 500
"""Longest detail a rejection keeps (longer text is cut, with its length noted)."""


class RejectionKind(StrEnum):
    """Every reason a contribution can get weight 0. The value is what the bucket stores."""

    # -- round policy (core) -----------------------------------------------------------------
    LATE = "late"
    """Arrived after the grace window closed. The only kind that is not final: the next round of
    the same fragment reconsiders it (re-anchored)."""
    NO_STEPS = "no_steps"
    """No inner steps since the learner last aligned the fragment (c_steps <= 0)."""
    NO_TOKENS = "no_tokens"
    """No tokens since the learner last aligned the fragment (c_tokens <= 0)."""
    DUPLICATE = "duplicate"
    """A second contribution from one learner in the same round."""
    SUPERSEDED = "superseded"
    """An older contribution of a learner that has since published a newer one."""
    UNKNOWN_BASE = "unknown_base"
    """Computed against a global version of the fragment the synchronizer no longer holds."""
    OUTLIER = "outlier"
    """Outer-gradient norm far above the round's median."""
    NOT_MERGED = "not_merged"
    """Accepted by the quorum decision but left out of the merge for no other recorded reason."""
    IMPOSSIBLE_COUNTERS = "impossible_counters"
    """Counters no honest learner can report: more tokens than its steps could consume (steps x
    batch x context from the recipe), or more steps than are possible since its base version.
    Final."""
    FENCED = "fenced"
    """Published by an older incarnation of its learner: a newer copy has since taken the
    learner's lease (``learners/<id>/leases/``), so the old copy's work is not merged. Final."""
    # -- bad input (storage validation; also raised as InvalidInput) -----------------------------
    TRUNCATED = "truncated"
    """Payload shorter than its record says."""
    CHECKSUM = "checksum"
    """sha256 of the payload differs from its name or record."""
    LAYOUT = "layout"
    """Wrong tensor names, shapes or dtypes for the fragment."""
    NON_FINITE = "non_finite"
    """NaN or Inf values."""
    SCHEMA = "schema"
    """Unknown schema or schema version, or a malformed record."""
    MISSING_PAYLOAD = "missing_payload"
    """The record points at a payload that does not exist."""
    BAD_ID = "bad_id"
    """An unsafe learner or run id (path separators, '..', characters outside the safe set)."""
    OVERSIZE = "oversize"
    """Payload or record larger than its cap."""
    CORRUPT = "corrupt"
    """Bytes that are not a valid safetensors or JSON document, or a record whose digest does
    not match its content."""
    BAD_SIGNATURE = "bad_signature"
    """The run has a keyring and the record is unsigned, signed with another key, or from a
    learner with no key."""
    # -- history ---------------------------------------------------------------------------------
    UNSPECIFIED = "unspecified"
    """A reason written by commit-record schema version 1, which stored only text. Final (only
    text starting with 'late:' is read back as LATE)."""

    @property
    def final(self) -> bool:
        """True if no later round will ever merge the contribution."""
        return self is not RejectionKind.LATE


STORAGE_KINDS = frozenset({
    RejectionKind.TRUNCATED, RejectionKind.CHECKSUM, RejectionKind.LAYOUT, RejectionKind.NON_FINITE,
    RejectionKind.SCHEMA, RejectionKind.MISSING_PAYLOAD, RejectionKind.BAD_ID, RejectionKind.OVERSIZE,
    RejectionKind.CORRUPT, RejectionKind.BAD_SIGNATURE,
})
"""The kinds bad input can have (what :class:`atoll.storage.validation.InvalidInput` carries)."""


@dataclass(frozen=True)
class Rejection:
    """One contribution's rejection: what kind, and the detail a person reads."""

    kind: RejectionKind
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RejectionKind(self.kind))  # a str value from JSON is fine
        if not isinstance(self.detail, str):
            raise TypeError(f"rejection detail must be a string, got {type(self.detail).__name__}")
        if len(self.detail) > MAX_DETAIL_CHARS:  # details echo ids and errors: keep records small
            cut = self.detail[:MAX_DETAIL_CHARS]
            object.__setattr__(self, "detail", f"{cut}... ({len(self.detail)} characters in all)")

    @property
    def final(self) -> bool:
        """True if no later round will ever merge the contribution (every kind but LATE)."""
        return self.kind.final

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "detail": self.detail}

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Rejection:
        """Parse ``{"kind", "detail"}``; raises ValueError for an unknown kind or a bad detail."""
        kind, detail = body.get("kind"), body.get("detail")
        if not isinstance(kind, str) or kind not in RejectionKind._value2member_map_:
            raise ValueError(f"unknown rejection kind {kind!r}; known: {[k.value for k in RejectionKind]}")
        if not isinstance(detail, str):
            raise ValueError(f"rejection detail must be a string, got {type(detail).__name__}")
        return cls(RejectionKind(kind), detail)

    @classmethod
    def from_legacy_text(cls, text: str) -> Rejection:
        """A schema-1 reason (text only): 'late:' text is LATE, anything else UNSPECIFIED."""
        if text.startswith("late:"):
            return cls(RejectionKind.LATE, text[len("late:"):].strip())
        return cls(RejectionKind.UNSPECIFIED, text)


MAX_RECORDED_PER_LEARNER = 8
"""Rejections a commit record lists per learner (its prefix); the rest are counted by kind."""

MAX_RECORDED_REJECTIONS = 1024
"""Rejections a commit record lists in all (about 1 MB at most with the detail cap)."""

MAX_SUMMARY_LEARNERS = 64
"""Learners named in the count of unlisted rejections; the others are added up under ``"*"``."""


def summarize_rejections(rejected: Mapping[str, Rejection], owner: Callable[[str], str], *,
                         per_owner: int = MAX_RECORDED_PER_LEARNER, total: int = MAX_RECORDED_REJECTIONS,
                         ) -> tuple[dict[str, Rejection], dict[str, Any]]:
    """What a commit record lists of a round's rejections, and a count of the rest.

    Rejections come from what learners wrote (any number of objects in a learner's own prefix),
    so a record that listed them all could be made larger than any reader accepts. Listed: per
    ``owner(key)`` (the learner whose prefix holds the key) at most ``per_owner``, round-policy
    kinds first (late, superseded, fenced, ...: what a person looks for), then by key; at most
    ``total`` in all. The rest are counted: ``{"count": n, "by_learner": {owner: {kind: n}}}``
    naming at most :data:`MAX_SUMMARY_LEARNERS` owners (the others under ``"*"``); an empty dict
    when everything is listed. The listed part is exactly ``rejected`` when nothing is cut.
    """
    if len(rejected) <= min(per_owner, total):
        return dict(rejected), {}
    order = sorted(rejected, key=lambda k: (rejected[k].kind in STORAGE_KINDS, k))
    kept: dict[str, Rejection] = {}
    per: Counter[str] = Counter()
    cut: dict[str, Counter[str]] = {}
    for key in order:
        who = owner(key)
        if per[who] < per_owner and len(kept) < total:
            per[who] += 1
            kept[key] = rejected[key]
        else:
            cut.setdefault(who, Counter())[rejected[key].kind.value] += 1
    if not cut:
        return kept, {}
    named = sorted(cut, key=lambda w: (-sum(cut[w].values()), w))
    by_learner = {w: dict(sorted(cut[w].items())) for w in named[:MAX_SUMMARY_LEARNERS]}
    rest: Counter[str] = Counter()
    for w in named[MAX_SUMMARY_LEARNERS:]:
        rest.update(cut[w])
    if rest:
        by_learner["*"] = dict(sorted(rest.items()))
    return kept, {"count": sum(sum(c.values()) for c in cut.values()), "by_learner": by_learner}
