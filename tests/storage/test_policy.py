"""The bucket policy in docs/protocol.md against the layout's key functions: every key a writer
writes is allowed to it and to nobody else, and exactly the create-once keys demand
If-None-Match. If the layout or the policy changes alone, this fails."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

from atoll.storage import paths

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
ROOT = "arn:aws:s3:::BUCKET/PREFIX/RUN/"
SHA = "ab" * 32


def _policy() -> dict:
    text = DOC.read_text()
    m = re.search(r"<!-- atoll-bucket-policy -->\s*```json\n(.*?)```", text, re.S)
    assert m, "docs/protocol.md lost its bucket policy block"
    return json.loads(m.group(1))


def _principals(stmt: dict) -> list[str]:
    p = stmt["Principal"]["AWS"]
    return [p] if isinstance(p, str) else list(p)


def _patterns(principal: str, learner: str | None, *, effect: str, conditional: bool | None = None) -> list[str]:
    """PutObject resource patterns of ``effect`` that apply to ``principal`` (tag substituted)."""
    out = []
    for stmt in _policy()["Statement"]:
        if stmt["Effect"] != effect or "s3:PutObject" not in stmt["Action"]:
            continue
        if not any(fnmatch.fnmatchcase(principal, p) for p in _principals(stmt)):
            continue
        if conditional is not None and ("Condition" in stmt) != conditional:
            continue
        for r in stmt["Resource"]:
            out.append(r.replace("${aws:PrincipalTag/atoll-learner}", learner or "\0"))
    return out


def _allowed(principal: str, learner: str | None, key: str) -> bool:
    arn = ROOT + key
    allow = any(fnmatch.fnmatchcase(arn, p) for p in _patterns(principal, learner, effect="Allow"))
    hard_deny = any(fnmatch.fnmatchcase(arn, p) for p in _patterns(principal, learner, effect="Deny", conditional=False))
    return allow and not hard_deny


def _create_once_required(principal: str, learner: str | None, key: str) -> bool:
    return any(fnmatch.fnmatchcase(ROOT + key, p)
               for p in _patterns(principal, learner, effect="Deny", conditional=True))


LEARNER = "arn:aws:iam::ACCOUNT:role/atoll-learner-l0"
SYNC = "arn:aws:iam::ACCOUNT:role/atoll-synchronizer"

LEARNER_WRITES = {  # key -> written create-once?
    paths.contribution_key(3, 12, "l0", 24, SHA): True,
    paths.blob_key(SHA, "l0"): False,
    paths.learner_state_key("l0"): False,
    paths.learner_lease_key("l0", 3): True,
    paths.learner_heartbeat_key("l0", 3): False,
    paths.probe_key("abc123"): True,
}
SYNC_WRITES = {
    paths.commit_key(42): True,
    paths.repair_key(42, 1): True,
    paths.RUN_MANIFEST: True,
    paths.blob_key(SHA): False,
    paths.HEAD: False,
    paths.checkpoint_model_key(100): False,
    paths.checkpoint_config_key(100): False,
    paths.eval_key(40): True,
    paths.sync_lease_key(2): True,
    paths.sync_heartbeat_key(2): False,
    paths.STOP: False,
    paths.probe_key("abc123"): True,
}


@pytest.mark.parametrize("key", sorted(LEARNER_WRITES))
def test_a_learner_may_write_its_own_keys(key: str) -> None:
    assert _allowed(LEARNER, "l0", key)
    if key.startswith(paths.LEARNERS_PREFIX):
        assert not _allowed(LEARNER, "l1", key), "another learner must not write l0's prefix"
        assert _create_once_required(LEARNER, "l0", key) == LEARNER_WRITES[key]


@pytest.mark.parametrize("key", sorted(SYNC_WRITES))
def test_the_synchronizer_may_write_its_keys_and_no_learner_may(key: str) -> None:
    assert _allowed(SYNC, None, key)
    if key != paths.probe_key("abc123"):
        assert not _allowed(LEARNER, "l0", key), f"a learner could write {key}"
        assert _create_once_required(SYNC, None, key) == SYNC_WRITES[key]


def test_the_synchronizer_cannot_write_under_learner_prefixes() -> None:
    for key in LEARNER_WRITES:
        if key.startswith(paths.LEARNERS_PREFIX):
            assert not _allowed(SYNC, None, key)


OPERATOR = "arn:aws:iam::ACCOUNT:role/atoll-operator"
RETENTION_DELETES = [paths.blob_key(SHA), paths.checkpoint_model_key(100), paths.checkpoint_config_key(100),
                     paths.contribution_key(3, 12, "l0", 24, SHA), paths.blob_key(SHA, "l0"), paths.probe_key("abc123")]
NEVER_DELETED = [paths.commit_key(42), paths.repair_key(42, 1), paths.eval_key(40), paths.RUN_MANIFEST, paths.HEAD, paths.STOP,
                 paths.PRUNE, paths.learner_state_key("l0"), paths.learner_lease_key("l0", 3),
                 paths.learner_heartbeat_key("l0", 3), paths.sync_lease_key(2), paths.sync_heartbeat_key(2)]


def _may(principal: str, action: str, key: str) -> bool:
    return any(stmt["Effect"] == "Allow" and action in stmt["Action"]
               and any(fnmatch.fnmatchcase(principal, p) for p in _principals(stmt))
               and any(fnmatch.fnmatchcase(ROOT + key, r) for r in stmt["Resource"])
               for stmt in _policy()["Statement"])


def test_only_the_operator_deletes_and_only_what_retention_deletes() -> None:
    """Learners and the synchronizer delete nothing but probe scratch; the operator (``atoll
    prune``) deletes exactly the classes retention prunes, never the chain, leases or rejoin state."""
    for key in RETENTION_DELETES:
        assert _may(OPERATOR, "s3:DeleteObject", key), key
    for key in NEVER_DELETED:
        assert not _may(OPERATOR, "s3:DeleteObject", key), key
    for principal in (LEARNER, SYNC):
        for key in RETENTION_DELETES + NEVER_DELETED:
            assert _may(principal, "s3:DeleteObject", key) == key.startswith(paths.PROBE_PREFIX), (principal, key)
    # The operator writes its retention record and probe scratch, nothing else.
    for key in [*LEARNER_WRITES, *SYNC_WRITES, paths.PRUNE]:
        assert _may(OPERATOR, "s3:PutObject", key) == (key == paths.PRUNE or key.startswith(paths.PROBE_PREFIX)), key
