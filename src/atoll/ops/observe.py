"""What a chaos test or soak sees of a run's processes on this machine: /proc plus the bucket.

Shared by ``tests/integration`` and ``benchmarks/chaos.py``; nothing in the product depends on
it. A stack's processes are found by a marker in their environment (every process a
:class:`~atoll.ops.stack.LocalStack` starts, and every flow run its workers start, inherits the
stack's environment), so the sweep never touches another test's or another person's processes.
Linux only (/proc).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from atoll.storage import paths
from atoll.storage.codec import load_record
from atoll.storage.liveness import KIND_HEARTBEAT, KIND_LEASE, MAX_LIFECYCLE_RECORD_BYTES, Heartbeat, Lease
from atoll.storage.reading import Skipped, read_parsed

__all__ = ["processes_with", "pid_state", "live_copies", "alive"]

NOT_RUNNING = frozenset({None, "Z", "T", "t", "X"})
"""/proc states of a process that cannot be at work: gone, zombie, stopped (SIGSTOP), traced, dead."""


def processes_with(env_var: str, marker: str) -> list[int]:
    """Pids (other than this one) whose environment has ``env_var=marker``."""
    needle = f"{env_var}={marker}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass  # exited while we looked, or not ours to read
    return out


def pid_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (R, S, D, T, Z, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def live_copies(store: Any, learner_id: str, *, env_var: str, marker: str, heartbeat_timeout_s: float) -> list[int]:
    """Incarnations of ``learner_id`` that are at work right now: the process named by the lease
    runs on this machine under the marker (not frozen, not a zombie) and heartbeats as alive. A
    fenced copy that wakes up exits without another heartbeat, so it never counts."""
    mine = set(processes_with(env_var, marker))
    out = []
    # A heartbeat's age on the store's clock (atoll.storage.liveness), not the learner's.
    stored = {paths.parse_incarnation_key(i.name): i.modified_s
              for i in store.store.list_info(paths.learner_heartbeats_prefix(learner_id))}
    for name in store.store.list(paths.learner_leases_prefix(learner_id)):
        n = paths.parse_incarnation_key(name)
        if n is None:
            continue
        # Through the one reader: a lease or heartbeat that is not a plain, well-formed record
        # is skipped like an absent one.
        lease = read_parsed(store.store, paths.learner_lease_key(learner_id, n), MAX_LIFECYCLE_RECORD_BYTES,
                            lambda data: Lease.from_body(load_record(data, KIND_LEASE)))
        if lease is None or isinstance(lease, Skipped):
            continue
        if lease.pid not in mine or pid_state(lease.pid) in NOT_RUNNING:
            continue
        beat = read_parsed(store.store, paths.learner_heartbeat_key(learner_id, n), MAX_LIFECYCLE_RECORD_BYTES,
                           lambda data: Heartbeat.from_body(load_record(data, KIND_HEARTBEAT)))
        if beat is None or isinstance(beat, Skipped):
            continue
        written = stored.get(n)
        if beat.status == "alive" and time.time() - (beat.time if written is None else written) < heartbeat_timeout_s:
            out.append(n)
    return out


def alive(store: Any, holder: str | None, *, newer_than: int = 0, max_age_s: float = 10.0) -> Any:
    """The newest incarnation's liveness (of learner ``holder``, or of the synchronizer when None)
    if it is newer than ``newer_than``, has not exited and heartbeat within ``max_age_s``; else None."""
    live = store.synchronizer_liveness() if holder is None else store.learner_liveness(holder)
    if live.lease is None or live.incarnation <= newer_than or live.exited_reason is not None:
        return None
    age = live.heartbeat_age_s(time.time())
    return live if age is not None and age < max_age_s else None
