"""The operator's side of a run: :class:`OperatorStore`, what the bucket policy's ``atoll-operator``
principal writes (docs/protocol.md section 8: ``OperatorRetention``, ``OperatorRetentionRecord``;
section 10: retention, ``atoll prune``)."""

from __future__ import annotations

from atoll.storage import paths
from atoll.storage.codec import dump_record
from atoll.storage.reader import RunReader
from atoll.storage.records import KIND_PRUNE, PruneRecord

__all__ = ["OperatorStore"]


class OperatorStore(RunReader):
    """Retention's handle (:func:`atoll.storage.retention.apply_prune`): everything a reader does,
    and the one record the ``atoll-operator`` role writes, ``paths.PRUNE`` (overwritten, sealed with
    the synchronizer's key where the keyring holds it). Its deletes go through the object store
    (``s3:DeleteObject`` on the key classes ``retention.key_class`` proves); it never writes a
    commit, lease, heartbeat, ``state.json``, ``head.json`` or ``run.json``. The stop marker is
    the synchronizer principal's (:class:`~atoll.storage.synchronizer_side.SynchronizerStore`)."""

    def write_prune_record(self, record: PruneRecord) -> None:
        """Overwrite ``sync/prune.json`` (retention writes it before it deletes anything)."""
        self._check_writable()
        if len(record.floors) != self.plan.num_fragments:
            raise ValueError(f"floors must name {self.plan.num_fragments} fragments, got {len(record.floors)}")
        self.store.put(paths.PRUNE, dump_record(KIND_PRUNE, self._operator_seal("the retention record")(
            KIND_PRUNE, record.to_dict())))
