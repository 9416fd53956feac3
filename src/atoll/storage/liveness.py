"""Liveness in the bucket: leases, heartbeats and the stop marker (docs/protocol.md, "Leases,
heartbeats and stop").

* A **lease** is a create-once record ``learners/<id>/leases/<n>.json`` (the synchronizer's:
  ``sync/leases/<n>.json``). Whoever starts a learner process takes the next incarnation ``n``
  (list the prefix, create ``max + 1``; on a lost race try the next number). The newest lease
  *fences* every older one: an older incarnation that sees it exits without writing anything
  the newer one owns, and the synchronizer rejects contributions that carry an older number.
* A **heartbeat** ``learners/<id>/heartbeats/<n>.json`` (``sync/heartbeats/<n>.json``) is
  overwritten by incarnation ``n`` every few seconds while it makes progress, and a last time
  with ``status="exited"`` and a reason when it exits cleanly. One key per incarnation, so a
  fenced copy can never overwrite the newer one's. Alive means a fresh heartbeat of the newest
  lease, never a Prefect state. Ages are measured on the **store's clock**: the time the store
  recorded for the object (S3 ``LastModified``, GCS ``updated``, a local file's mtime), against
  the reader's ``now``. A writer's clock never decides liveness (a learner whose clock is ten
  minutes off is neither dead nor immortal to the training run); the times inside the records
  are the writer's, kept for people and as the fallback where a backend reports no time. The
  readers that decide (the training run, the supervisor, ``atoll stop``) are assumed to keep
  their clock near the store's (NTP), as an object store's request signing already requires.
* The **stop marker** ``sync/stop.json`` (overwritten) says whether the run was stopped by a
  person (``atoll stop``); learners and the synchronizer exit when they see ``stopped: true``.

Everything here is read with a GET cap; an unparseable, oversized or misplaced object is
ignored and the reason reported (:attr:`Liveness.problems`), never raised: no object a learner
can write may stop the synchronizer. A learner can only harm itself by forging its own leases
(the newest lease number is what counts, whatever its content).
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from atoll.core.rejection import MAX_DETAIL_CHARS
from atoll.storage import paths
from atoll.storage.codec import dump_record, load_record
from atoll.storage.integrity import IntegrityError
from atoll.storage.reading import Skipped, bounded_int, finite_float, read_parsed
from atoll.storage.store import ObjectStore
from atoll.storage.validation import InvalidInput, StorageError, validate_learner_id

__all__ = [
    "KIND_LEASE",
    "KIND_HEARTBEAT",
    "KIND_STOP",
    "SYNCHRONIZER_HOLDER",
    "synchronizer_holder",
    "HEARTBEAT_STATUSES",
    "MAX_LIFECYCLE_RECORD_BYTES",
    "LEASE_ATTEMPTS",
    "Lease",
    "Heartbeat",
    "Liveness",
    "StopMarker",
    "LeaseError",
    "take_lease",
    "write_heartbeat",
    "read_liveness",
    "newest_incarnation",
    "write_stop_marker",
    "read_stop_marker",
    "FAULT_HOLD_ENV",
    "FAULT_SIGNAL_DIR_ENV",
    "fault_hold_before_commit",
]

FAULT_HOLD_ENV = "ATOLL_FAULT_HOLD_BEFORE_COMMIT_S"
FAULT_SIGNAL_DIR_ENV = "ATOLL_FAULT_SIGNAL_DIR"
FAULT_ARMED_ENV = "ATOLL_FAULT_HOLD_WHEN_ARMED"
"""Chaos only: with it set to 1, a commit holds only when ``<signal dir>/arm`` exists (and takes it)."""

KIND_LEASE = "atoll/lease"
KIND_HEARTBEAT = "atoll/heartbeat"
KIND_STOP = "atoll/stop"

SYNCHRONIZER_HOLDER = "synchronizer"
"""The holder name of the synchronizer's leases."""

_MERGER_HOLDER_RE = re.compile(r"^synchronizer/(\d{1,4})of(\d{1,4})$")


def synchronizer_holder(group: tuple[int, int] | None = None) -> str:
    """The lease holder of the synchronizer (``group`` None or (0, 1)) or of the merger of
    fragment group (g, G) of a split synchronizer: ``"synchronizer/<g>of<G>"`` (a "/" no learner
    id holds). Each holder's leases fence only its own older incarnations."""
    if group is None or tuple(group) == (0, 1):
        return SYNCHRONIZER_HOLDER
    paths.sync_leases_prefix((group[0], group[1]))  # validates it
    return f"{SYNCHRONIZER_HOLDER}/{group[0]}of{group[1]}"


def _merger_group(holder: str) -> tuple[int, int] | None:
    m = _MERGER_HOLDER_RE.match(holder)
    return (int(m.group(1)), int(m.group(2))) if m else None

HEARTBEAT_STATUSES = ("alive", "exited")

MAX_LIFECYCLE_RECORD_BYTES = 64 << 10
"""GET cap of a lease, heartbeat or stop record (they are a few hundred bytes)."""

LEASE_ATTEMPTS = 64
"""How many incarnation numbers one :func:`take_lease` tries before it gives up (each lost race
re-lists the prefix and moves past the newest lease it sees)."""


class LeaseError(StorageError):
    """No lease could be taken (too many racing takers, or the incarnation numbers ran out)."""


def _reason(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidInput("schema", what)


def _get_int(body: Mapping[str, Any], name: str, *, optional: bool = False) -> int | None:
    return bounded_int(body, name, optional=optional)


def _get_float(body: Mapping[str, Any], name: str) -> float:
    return finite_float(body, name)


def _get_str(body: Mapping[str, Any], name: str, *, optional: bool = False, limit: int = 1024) -> str | None:
    v = body.get(name)
    if v is None and optional:
        return None
    _need(isinstance(v, str) and len(v) <= limit, f"{name} must be a string of at most {limit} characters")
    return str(v)


@dataclass(frozen=True)
class Lease:
    """One incarnation of a learner (``holder`` = its id) or of the synchronizer
    (``holder == "synchronizer"``)."""

    holder: str
    incarnation: int
    started_at: float
    """Unix time (the taker's clock) when the lease was taken."""
    host: str
    pid: int
    flow_run_id: str | None = None
    """The Prefect flow run that runs this incarnation, if any (informational)."""

    def to_dict(self) -> dict[str, Any]:
        return {"holder": self.holder, "incarnation": self.incarnation, "started_at": self.started_at,
                "host": self.host, "pid": self.pid, "flow_run_id": self.flow_run_id}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Lease:
        incarnation = _get_int(body, "incarnation")
        assert incarnation is not None
        return cls(holder=str(_get_str(body, "holder", limit=128)), incarnation=incarnation,
                   started_at=_get_float(body, "started_at"), host=str(_get_str(body, "host")),
                   pid=int(_get_int(body, "pid") or 0), flow_run_id=_get_str(body, "flow_run_id", optional=True))


@dataclass(frozen=True)
class Heartbeat:
    """The last sign of life of one incarnation."""

    incarnation: int
    time: float
    """Unix time (the writer's clock) of this heartbeat."""
    status: str
    """``"alive"`` or ``"exited"`` (the incarnation exited cleanly; ``reason`` says why)."""
    reason: str = ""
    step: int | None = None
    """The learner's local step (None for the synchronizer)."""
    round: int | None = None
    """The newest committed round the writer had seen."""

    def to_dict(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "time": self.time, "status": self.status,
                "reason": self.reason, "step": self.step, "round": self.round}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Heartbeat:
        status = _get_str(body, "status", limit=16)
        _need(status in HEARTBEAT_STATUSES, f"status must be one of {HEARTBEAT_STATUSES}, got {status!r}")
        incarnation = _get_int(body, "incarnation")
        assert incarnation is not None and status is not None
        return cls(incarnation=incarnation, time=_get_float(body, "time"), status=status,
                   reason=str(_get_str(body, "reason", limit=4 * MAX_DETAIL_CHARS)),
                   step=_get_int(body, "step", optional=True), round=_get_int(body, "round", optional=True))


@dataclass(frozen=True)
class Liveness:
    """What the bucket says about the newest incarnation of a learner or of the synchronizer."""

    lease: Lease | None
    """The newest lease (None: never leased, or its record is unusable: see ``problems``)."""
    heartbeat: Heartbeat | None
    """That lease's heartbeat (None: none written yet, or unusable)."""
    problems: tuple[str, ...] = ()
    """Objects that were ignored, and why (corrupt, oversized, misplaced)."""
    newest: int = 0
    """The newest lease number in the bucket, whatever its content (what fences older copies)."""
    heartbeat_stored_at: float | None = None
    """Unix time the store recorded for the heartbeat object (its clock, not the writer's); None
    where the backend reports none."""
    lease_stored_at: float | None = None
    """Unix time the store recorded for the newest lease object (its clock), read only while that
    incarnation has no heartbeat; None otherwise or if unknown."""

    @property
    def incarnation(self) -> int:
        """The newest lease's incarnation; 0 when there is no (usable) lease."""
        return self.lease.incarnation if self.lease is not None else 0

    def heartbeat_age_s(self, now: float) -> float | None:
        """Seconds since the heartbeat was stored, on the store's clock against the reader's
        ``now`` (Unix time); the writer's own time only where the store reported none. None when
        there is no heartbeat. Never negative."""
        if self.heartbeat is None:
            return None
        written = self.heartbeat_stored_at if self.heartbeat_stored_at is not None else self.heartbeat.time
        return max(0.0, now - written)

    def lease_age_s(self, now: float) -> float | None:
        """Seconds since the newest lease was taken, on the store's clock as :meth:`heartbeat_age_s`
        (the taker's ``started_at`` only where the store reported no time); None without a lease."""
        if self.lease is None:
            return None
        taken = self.lease_stored_at if self.lease_stored_at is not None else self.lease.started_at
        return max(0.0, now - taken)

    @property
    def exited_reason(self) -> str | None:
        """Why the newest incarnation exited cleanly, or None if it has not (or never said)."""
        hb = self.heartbeat
        return hb.reason if hb is not None and hb.status == "exited" else None

    def is_alive(self, now: float, stale_after_s: float) -> bool:
        """A usable lease whose heartbeat says alive and is at most ``stale_after_s`` old."""
        age = self.heartbeat_age_s(now)
        return (self.lease is not None and self.heartbeat is not None and self.heartbeat.status == "alive"
                and age is not None and age <= stale_after_s)


@dataclass(frozen=True)
class StopMarker:
    """``sync/stop.json``: ``stopped`` False means running (the marker was cleared)."""

    stopped: bool
    reason: str
    by: str
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {"stopped": self.stopped, "reason": self.reason, "by": self.by, "time": self.time}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> StopMarker:
        stopped = body.get("stopped")
        _need(isinstance(stopped, bool), "stopped must be a boolean")
        return cls(stopped=bool(stopped), reason=str(_get_str(body, "reason", limit=4 * MAX_DETAIL_CHARS)),
                   by=str(_get_str(body, "by")), time=_get_float(body, "time"))


# -- keys per holder ---------------------------------------------------------------------------
def _keys(holder: str) -> tuple[str, Callable[[int], str], Callable[[int], str]]:
    """(leases prefix, lease key, heartbeat key) of a learner id or the synchronizer."""
    if holder == SYNCHRONIZER_HOLDER:
        return paths.sync_leases_prefix(), paths.sync_lease_key, paths.sync_heartbeat_key
    group = _merger_group(holder)
    if group is not None:
        return (paths.sync_leases_prefix(group), lambda n: paths.sync_lease_key(n, group),
                lambda n: paths.sync_heartbeat_key(n, group))
    validate_learner_id(holder)
    return (paths.learner_leases_prefix(holder), lambda n: paths.learner_lease_key(holder, n),
            lambda n: paths.learner_heartbeat_key(holder, n))


def _numbers(store: ObjectStore, prefix: str) -> list[int]:
    return sorted(n for name in store.list(prefix) if (n := paths.parse_incarnation_key(name)) is not None)


def _stored_at(store: ObjectStore, prefix: str) -> dict[int, float]:
    """Incarnation -> the time the store recorded for its object under ``prefix`` (one LIST)."""
    out: dict[int, float] = {}
    for info in store.list_info(prefix):
        n = paths.parse_incarnation_key(info.name)
        if n is not None and not info.is_dir and info.modified_s is not None and math.isfinite(info.modified_s):
            out[n] = float(info.modified_s)
    return out


def newest_incarnation(store: ObjectStore, holder: str) -> int:
    """The newest lease number of ``holder`` (one LIST, cache invalidated); 0 = never leased.

    Decided by the keys alone: a lease object whose content is unusable still fences older ones.
    """
    prefix, _, _ = _keys(holder)
    found = _numbers(store, prefix)
    return found[-1] if found else 0


def take_lease(store: ObjectStore, holder: str, *, flow_run_id: str | None = None,
               clock: Callable[[], float] = time.time) -> Lease:
    """Take the next incarnation of ``holder`` (create-once), fencing every older one."""
    prefix, lease_key, _ = _keys(holder)
    host, pid = socket.gethostname()[:255], os.getpid()
    found = _numbers(store, prefix)
    n = (found[-1] if found else 0) + 1
    for _ in range(LEASE_ATTEMPTS):
        if n > paths.MAX_INCARNATION:
            break
        lease = Lease(holder=holder, incarnation=n, started_at=clock(), host=host, pid=pid, flow_run_id=flow_run_id)
        if store.create(lease_key(n), dump_record(KIND_LEASE, lease.to_dict())):
            return lease
        found = _numbers(store, prefix)  # lost a race: move past the newest lease we can see
        n = max(n + 1, (found[-1] if found else 0) + 1)
    raise LeaseError(f"could not take a lease for {holder!r} at {store.key_url(prefix)}: "
                     f"{LEASE_ATTEMPTS} attempts lost to other takers, or incarnation {paths.MAX_INCARNATION} "
                     f"reached (a lease numbered that high was forged; start a new run)")


def write_heartbeat(store: ObjectStore, lease: Lease, *, status: str = "alive", reason: str = "",
                    step: int | None = None, round: int | None = None,
                    clock: Callable[[], float] = time.time) -> Heartbeat:
    """Overwrite the heartbeat of ``lease``'s incarnation (only that incarnation writes it)."""
    if status not in HEARTBEAT_STATUSES:
        raise ValueError(f"status must be one of {HEARTBEAT_STATUSES}, got {status!r}")
    _, _, heartbeat_key = _keys(lease.holder)
    hb = Heartbeat(incarnation=lease.incarnation, time=clock(), status=status, reason=_reason(reason),
                   step=step, round=round)
    store.put(heartbeat_key(lease.incarnation), dump_record(KIND_HEARTBEAT, {"holder": lease.holder, **hb.to_dict()}))
    return hb


def _read(store: ObjectStore, key: str, kind: str) -> tuple[dict[str, Any] | None, str | None]:
    """(body, None), (None, None) if absent, or (None, why) if the object is unusable: the one
    reader path (:func:`atoll.storage.reading.read_parsed`), so nothing but a transient error raises."""
    got = read_parsed(store, key, MAX_LIFECYCLE_RECORD_BYTES, lambda data: load_record(data, kind))
    if isinstance(got, Skipped):
        return None, f"{store.key_url(key)}: {got.kind.value}: {got.why}"
    return got, None


def read_liveness(store: ObjectStore, holder: str) -> Liveness:
    """The newest lease of ``holder`` and its heartbeat, with the time the store recorded for the
    heartbeat (for the lease instead while there is no heartbeat yet): two LISTs, two GETs."""
    prefix, lease_key, heartbeat_key = _keys(holder)
    n = newest_incarnation(store, holder)
    if n == 0:
        return Liveness(None, None)
    problems: list[str] = []
    lease: Lease | None = None
    body, why = _read(store, lease_key(n), KIND_LEASE)
    if why:
        problems.append(why)
    elif body is None:
        problems.append(f"{store.key_url(lease_key(n))}: listed but gone")
    else:
        try:
            lease = Lease.from_body(body)
            _need(lease.holder == holder and lease.incarnation == n,
                  f"lease of {lease.holder!r} incarnation {lease.incarnation} sits at incarnation {n} of {holder!r}")
        except InvalidInput as e:
            lease = None
            problems.append(f"{store.key_url(lease_key(n))}: {e.kind.value}: {e.reason[:300]}")
    heartbeat: Heartbeat | None = None
    body, why = _read(store, heartbeat_key(n), KIND_HEARTBEAT)
    # Listed after the read: the time listed is that of the body read or of a newer one (an age
    # a heartbeat interval short at worst, never one too long).
    beats = heartbeat_key(n).rsplit("/", 1)[0] + "/"
    beat_at = _stored_at(store, beats).get(n) if body is not None else None
    if why:
        problems.append(why)
    elif body is not None:
        try:
            heartbeat = Heartbeat.from_body(body)
            _need(heartbeat.incarnation == n and body.get("holder", holder) == holder,
                  f"heartbeat of incarnation {heartbeat.incarnation} sits at incarnation {n}")
        except InvalidInput as e:
            heartbeat = None
            problems.append(f"{store.key_url(heartbeat_key(n))}: {e.kind.value}: {e.reason[:300]}")
    # The lease's time matters only until the first heartbeat (a learner still starting).
    lease_at = _stored_at(store, prefix).get(n) if lease is not None and heartbeat is None else None
    return Liveness(lease, heartbeat, tuple(problems), newest=n,
                    heartbeat_stored_at=beat_at if heartbeat is not None else None, lease_stored_at=lease_at)


def write_stop_marker(store: ObjectStore, *, stopped: bool, reason: str, by: str,
                      clock: Callable[[], float] = time.time,
                      seal_with: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None) -> StopMarker:
    """``seal_with(kind, body)``: the sealed body to write (the run's digest and signature)."""
    marker = StopMarker(stopped=stopped, reason=_reason(reason), by=by[:1024], time=clock())
    body = marker.to_dict() if seal_with is None else seal_with(KIND_STOP, marker.to_dict())
    store.put(paths.STOP, dump_record(KIND_STOP, body))
    return marker


def read_stop_marker(store: ObjectStore, *, check: Callable[[dict[str, Any], str], None] | None = None,
                     ) -> tuple[StopMarker | None, str | None]:
    """(marker or None if absent, why it was ignored if unusable). ``check(body, url)`` raises
    IntegrityError for a marker the caller must not act on (a bad or missing signature)."""
    body, why = _read(store, paths.STOP, KIND_STOP)
    if body is None:
        return None, why
    url = store.key_url(paths.STOP)
    try:
        if check is not None:
            check(body, url)
        return StopMarker.from_body(body), None
    except IntegrityError as e:
        return None, f"{url}: ignored: {e.what}"
    except InvalidInput as e:
        return None, f"{url}: {e.kind.value}: {e.reason[:300]}"


def fault_hold_before_commit(round_: int, *, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Fault injection for chaos tests only (never set these in production).

    If ``$ATOLL_FAULT_HOLD_BEFORE_COMMIT_S`` (seconds, a float) and ``$ATOLL_FAULT_SIGNAL_DIR`` (a
    directory) are both set,
    :meth:`SynchronizerStore.commit_round <atoll.storage.synchronizer_side.SynchronizerStore.commit_round>`
    calls this after the round's payload blobs are written and before its commit record is
    created: it creates ``<dir>/payloads-written-<round:08d>`` (holding the pid) and sleeps that
    long, so a test can SIGKILL the synchronizer between a round's payload writes and its commit.
    With ``$ATOLL_FAULT_HOLD_WHEN_ARMED=1`` it holds only the next commit after a file
    ``<dir>/arm`` appears (removing it: one hold per arming), so a soak can pick its moments
    without slowing every round (``benchmarks/chaos.py``). Returns whether it held.
    """
    hold, folder = os.environ.get(FAULT_HOLD_ENV), os.environ.get(FAULT_SIGNAL_DIR_ENV)
    if not hold or not folder:
        return False
    try:
        seconds = float(hold)
    except ValueError:
        return False
    if not math.isfinite(seconds) or seconds < 0:
        return False
    if os.environ.get(FAULT_ARMED_ENV) == "1":
        try:
            os.unlink(os.path.join(folder, "arm"))  # taken: this commit holds, the next ones do not
        except FileNotFoundError:
            return False
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"payloads-written-{round_:08d}"), "w") as f:
        f.write(str(os.getpid()))
    sleep(seconds)
    return True
