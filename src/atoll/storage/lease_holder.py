"""What every lease holder writes beside its reads: :class:`LeaseHolder`, the heartbeats of its own
incarnation (docs/protocol.md section 9). Learners and the synchronizer hold leases; the
operator and plain readers do not."""

from __future__ import annotations

from atoll.storage import liveness
from atoll.storage.liveness import Heartbeat, Lease
from atoll.storage.reader import RunReader

__all__ = ["LeaseHolder"]


class LeaseHolder(RunReader):
    """A reader that holds a lease and heartbeats it: the base of
    :class:`~atoll.storage.learner_side.LearnerStore` and
    :class:`~atoll.storage.synchronizer_side.SynchronizerStore`.

    Writes (each under its holder's prefix, which the bucket policy grants it):
    ``paths.learner_heartbeat_key(id, n)`` or ``paths.sync_heartbeat_key(n)`` (overwritten)."""

    def write_heartbeat(self, lease: Lease, *, status: str = "alive", reason: str = "",
                        step: int | None = None, round: int | None = None) -> Heartbeat:
        """Overwrite the heartbeat of ``lease``'s incarnation (``status`` "alive" or "exited")."""
        self._check_writable()
        return liveness.write_heartbeat(self.store, lease, status=status, reason=reason, step=step, round=round)
