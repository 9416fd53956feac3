"""The bucket layout as pure functions from ids to keys and URLs (strings, never pathlib).

A *key* is a path relative to the run root, always with ``/`` separators; a *URL* is the run
root plus a key. Round numbers and versions are zero-padded so that lexical order is numeric
order. See docs/protocol.md for what each object holds.
"""

from __future__ import annotations

import re
from pathlib import Path

from atoll.storage.validation import InvalidInput, validate_id, validate_learner_id

__all__ = [
    "to_url",
    "RUN_MANIFEST",
    "HEAD",
    "SYNC_PREFIX",
    "LEARNERS_PREFIX",
    "PROBE_PREFIX",
    "learner_prefix",
    "repairs_prefix",
    "repair_key",
    "learner_of_key",
    "join_url",
    "run_url",
    "blob_key",
    "blobs_prefix",
    "parse_blob_name",
    "parse_contribution_sha16",
    "learner_contributions_prefix",
    "parse_base_folder",
    "commits_prefix",
    "commit_key",
    "parse_commit_key",
    "evals_prefix",
    "eval_key",
    "parse_eval_key",
    "contributions_prefix",
    "contribution_key",
    "learner_state_key",
    "checkpoints_prefix",
    "checkpoint_model_key",
    "checkpoint_config_key",
    "probe_key",
    "STOP",
    "PRUNE",
    "MAX_INCARNATION",
    "learner_leases_prefix",
    "learner_lease_key",
    "learner_heartbeats_prefix",
    "learner_heartbeat_key",
    "sync_leases_prefix",
    "sync_lease_key",
    "sync_heartbeats_prefix",
    "sync_heartbeat_key",
    "parse_incarnation_key",
]

RUN_MANIFEST = "run.json"
"""The run's frozen config, fragment plan and version-0 fragments (written once, by whoever
creates the run)."""

SYNC_PREFIX = "sync/"
"""Everything only the synchronizer writes: commits, head, global state blobs, checkpoints."""

LEARNERS_PREFIX = "learners/"
"""One prefix per learner, ``learners/<id>/``: the only place that learner writes."""

HEAD = "sync/head.json"
"""A hint naming the latest committed round (overwritten; never trusted without the commit)."""

PROBE_PREFIX = "_probe/"
"""Scratch objects of the create-once capability probe (random names, deleted after use)."""

STOP = "sync/stop.json"
"""The run's stop marker (overwritten): ``{"stopped": bool, "reason", "by", "time"}``."""

PRUNE = "sync/prune.json"
"""The run's retention record (overwritten by ``atoll prune``): which old state may be gone."""

MAX_INCARNATION = 99_999_999
"""Largest lease incarnation number (8 digits, zero-padded)."""

MAX_FRAGMENT_GROUPS = 1024
"""Most mergers a split synchronizer has (``sync/groups/<g>of<G>/``)."""

_ROUND_DIGITS = 8
_COMMIT_RE = re.compile(r"^(\d{8})\.json$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_SHA16_RE = re.compile(r"^[0-9a-f]{16}$")
_BASE_RE = re.compile(r"^b(\d{8})$")


def to_url(bucket: str) -> str:
    """A local path becomes an absolute ``file://`` URL (other processes may run elsewhere);
    anything with a scheme is returned as is."""
    if "://" in bucket:
        return bucket
    return "file://" + str(Path(bucket).expanduser().resolve())


def join_url(root: str, *keys: str) -> str:
    """``root/key1/key2`` with exactly one ``/`` between parts (works for every fsspec URL)."""
    out = root.rstrip("/")
    for k in keys:
        k = k.strip("/")
        if k:
            out = f"{out}/{k}"
    return out


def run_url(base_url: str, run_id: str) -> str:
    """Root URL of run ``run_id`` under ``base_url`` (the run id is validated)."""
    return join_url(base_url, validate_id(run_id, "run id"))


def _nonneg(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput("schema", f"{what} must be an integer >= 0, got {value!r}")
    return value


def _sha(sha256: str) -> str:
    if not isinstance(sha256, str) or not _SHA_RE.match(sha256):
        raise InvalidInput("schema", f"not a sha256 hex digest: {sha256!r}")
    return sha256


def learner_prefix(learner_id: str) -> str:
    """``learners/<id>/``: everything learner ``learner_id`` writes, and nothing else."""
    return f"{LEARNERS_PREFIX}{validate_learner_id(learner_id)}/"


def blob_key(sha256: str, learner_id: str | None = None) -> str:
    """A content-addressed payload, under its writer's prefix: the synchronizer's global state
    (``learner_id=None``): ``sync/blobs/sha256/<hex>.safetensors``; a learner's deltas and inner
    state: ``learners/<id>/blobs/sha256/<hex>.safetensors``. Separate prefixes mean a learner can
    never overwrite committed state, and a bucket policy can say so."""
    owner = SYNC_PREFIX if learner_id is None else learner_prefix(learner_id)
    return f"{owner}blobs/sha256/{_sha(sha256)}.safetensors"


def commits_prefix() -> str:
    return f"{SYNC_PREFIX}commits/"


def commit_key(round_: int) -> str:
    """The create-once commit record of round ``round_`` (>= 1): ``sync/commits/00000042.json``."""
    if _nonneg(round_, "round") < 1:
        raise InvalidInput("schema", f"rounds start at 1, got {round_}")
    return f"{commits_prefix()}{round_:0{_ROUND_DIGITS}d}.json"


def parse_commit_key(name: str) -> int | None:
    """Round number from a commit key or file name; None for anything else (temp files, HEAD)."""
    m = _COMMIT_RE.match(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def evals_prefix() -> str:
    return f"{SYNC_PREFIX}evals/"


def eval_key(round_: int) -> str:
    """The create-once evaluation record of committed round ``round_`` (>= 1), written by the
    synchronizer's evaluator after the round: ``sync/evals/00000042.json``."""
    if _nonneg(round_, "round") < 1:
        raise InvalidInput("schema", f"rounds start at 1, got {round_}")
    return f"{evals_prefix()}{round_:0{_ROUND_DIGITS}d}.json"


def parse_eval_key(name: str) -> int | None:
    """Round number from an evaluation record's key or file name; None for anything else."""
    m = _COMMIT_RE.match(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m and int(m.group(1)) >= 1 else None


def contributions_prefix(fragment: int, base_version: int, learner_id: str) -> str:
    """Where ``learner_id``'s contributions to ``fragment`` computed against ``base_version`` land."""
    return (f"{learner_prefix(learner_id)}contributions/"
            f"f{_nonneg(fragment, 'fragment'):04d}/b{_nonneg(base_version, 'base_version'):08d}/")


def contribution_key(fragment: int, base_version: int, learner_id: str, c_steps: int, sha256: str) -> str:
    """``learners/<id>/contributions/f0003/b00000012/<id>.s0000000024.<sha[:16]>.json``."""
    return (
        f"{contributions_prefix(fragment, base_version, learner_id)}"
        f"{learner_id}.s{_nonneg(c_steps, 'c_steps'):010d}.{_sha(sha256)[:16]}.json"
    )


def learner_of_key(key: str) -> str | None:
    """The learner whose prefix ``key`` lies under, or None (a synchronizer or top-level key)."""
    if not key.startswith(LEARNERS_PREFIX):
        return None
    lid = key[len(LEARNERS_PREFIX):].split("/", 1)[0]
    try:
        return validate_learner_id(lid)
    except InvalidInput:
        return None


def repairs_prefix(round_: int) -> str:
    """Where the synchronizer commits round ``round_`` if its slot holds something that does not
    verify (a forged or corrupt object it cannot overwrite): ``sync/repairs/00000042/``."""
    if _nonneg(round_, "round") < 1:
        raise InvalidInput("schema", f"rounds start at 1, got {round_}")
    return f"{SYNC_PREFIX}repairs/{round_:0{_ROUND_DIGITS}d}/"


def repair_key(round_: int, n: int) -> str:
    return f"{repairs_prefix(round_)}r{_nonneg(n, 'repair number'):04d}.json"


def learner_state_key(learner_id: str) -> str:
    return f"{learner_prefix(learner_id)}state.json"


def checkpoints_prefix() -> str:
    return f"{SYNC_PREFIX}checkpoints/"


def checkpoint_model_key(round_: int) -> str:
    """``sync/checkpoints/00000100/model.safetensors`` (plain safetensors, whole model)."""
    return f"{checkpoints_prefix()}{_nonneg(round_, 'round'):0{_ROUND_DIGITS}d}/model.safetensors"


def blobs_prefix(learner_id: str | None = None) -> str:
    """The folder :func:`blob_key` puts a writer's payloads in."""
    owner = SYNC_PREFIX if learner_id is None else learner_prefix(learner_id)
    return f"{owner}blobs/sha256/"


def parse_blob_name(name: str) -> str | None:
    """sha256 from a payload's file name (``<hex>.safetensors``, as :func:`blob_key` names it); None otherwise."""
    sha = name.removesuffix(".safetensors")
    return sha if sha != name and _SHA_RE.match(sha) else None


def parse_contribution_sha16(name: str) -> str | None:
    """The payload's first 16 hex digits from a contribution record's file name
    (``<id>.s<steps>.<sha16>.json``, as :func:`contribution_key` names it); None otherwise."""
    stem = name.removesuffix(".json")
    sha16 = stem.rsplit(".", 1)[-1]
    return sha16 if stem != name and "." in stem and _SHA16_RE.match(sha16) else None


def learner_contributions_prefix(learner_id: str, fragment: int | None = None) -> str:
    """``learners/<id>/contributions/`` (or its ``f<pppp>/`` folder): one folder per base version below."""
    head = f"{learner_prefix(learner_id)}contributions/"
    return head if fragment is None else f"{head}f{_nonneg(fragment, 'fragment'):04d}/"


def parse_base_folder(name: str) -> int | None:
    """Base version from a ``b<bbbbbbbb>`` folder name; None for anything else."""
    m = _BASE_RE.match(name.rstrip("/"))
    return int(m.group(1)) if m else None


def checkpoint_config_key(round_: int) -> str:
    return f"{checkpoints_prefix()}{_nonneg(round_, 'round'):0{_ROUND_DIGITS}d}/config.json"


def probe_key(token: str) -> str:
    return f"{PROBE_PREFIX}{validate_id(token, 'probe token')}"


def _incarnation(n: int) -> int:
    if not 1 <= _nonneg(n, "incarnation") <= MAX_INCARNATION:
        raise InvalidInput("schema", f"incarnations are 1 .. {MAX_INCARNATION}, got {n}")
    return n


def learner_leases_prefix(learner_id: str) -> str:
    """``learners/<id>/leases/``: one create-once lease per incarnation of the learner."""
    return f"{learner_prefix(learner_id)}leases/"


def learner_lease_key(learner_id: str, incarnation: int) -> str:
    """``learners/<id>/leases/00000003.json`` (create-once)."""
    return f"{learner_leases_prefix(learner_id)}{_incarnation(incarnation):08d}.json"


def learner_heartbeats_prefix(learner_id: str) -> str:
    return f"{learner_prefix(learner_id)}heartbeats/"


def learner_heartbeat_key(learner_id: str, incarnation: int) -> str:
    """``learners/<id>/heartbeats/00000003.json``: overwritten by incarnation 3 only, so a fenced
    older copy never overwrites the newer one's heartbeat."""
    return f"{learner_heartbeats_prefix(learner_id)}{_incarnation(incarnation):08d}.json"


def _sync_life_prefix(group: tuple[int, int] | None) -> str:
    """``sync/`` for the synchronizer, ``sync/groups/<g>of<G>/`` for the merger of fragment group
    g of G (a split synchronizer: docs/training.md): each group's leases fence only its own."""
    if group is None:
        return SYNC_PREFIX
    index, count = (_nonneg(v, "fragment group") for v in group)
    if not index < count <= MAX_FRAGMENT_GROUPS:
        raise InvalidInput("schema", f"fragment group {index}/{count} is not 0 <= index < count <= {MAX_FRAGMENT_GROUPS}")
    return f"{SYNC_PREFIX}groups/{index}of{count}/"


def sync_leases_prefix(group: tuple[int, int] | None = None) -> str:
    return f"{_sync_life_prefix(group)}leases/"


def sync_lease_key(incarnation: int, group: tuple[int, int] | None = None) -> str:
    """``sync/leases/00000002.json``: the synchronizer's lease (create-once); a merger's under
    ``sync/groups/<g>of<G>/leases/``."""
    return f"{sync_leases_prefix(group)}{_incarnation(incarnation):08d}.json"


def sync_heartbeats_prefix(group: tuple[int, int] | None = None) -> str:
    return f"{_sync_life_prefix(group)}heartbeats/"


def sync_heartbeat_key(incarnation: int, group: tuple[int, int] | None = None) -> str:
    return f"{sync_heartbeats_prefix(group)}{_incarnation(incarnation):08d}.json"


def parse_incarnation_key(name: str) -> int | None:
    """Incarnation number from a lease or heartbeat key or file name; None for anything else."""
    m = _COMMIT_RE.match(name.rsplit("/", 1)[-1])
    if not m:
        return None
    n = int(m.group(1))
    return n if 1 <= n <= MAX_INCARNATION else None
