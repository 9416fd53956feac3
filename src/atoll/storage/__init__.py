"""atoll.storage: the bucket protocol over fsspec (docs/protocol.md is the layout's reference).

Knows nothing of Prefect. Entry points: one class per role of the bucket policy, each opened with
``<Role>.open(url, storage_options)``: :class:`RunReader` (everyone), :class:`LearnerStore`,
:class:`SynchronizerStore`, :class:`OperatorStore` (retention), and :class:`RunCreator` to
create a run.
"""

from atoll.storage.chain import CommitChain
from atoll.storage.codec import SCHEMA_VERSION, sha256_hex
from atoll.storage.creation import RunCreator
from atoll.storage.handle import RunHandle
from atoll.storage.learner_side import LearnerStore
from atoll.storage.lease_holder import LeaseHolder
from atoll.storage.liveness import Heartbeat, Lease, LeaseError, Liveness, StopMarker
from atoll.storage.operator_side import OperatorStore
from atoll.storage.reader import CheckpointInfo, ContributionListing, GlobalState, LearnerState, RunReader
from atoll.storage.records import (
    AcceptedContribution,
    BlobRef,
    CommitRecord,
    ContributionRecord,
    FragmentState,
    LearnerStateRecord,
    PruneRecord,
    RunManifest,
)
from atoll.storage.store import ObjectStore, RetryPolicy, is_transient, redact
from atoll.storage.synchronizer_side import CommitResult, SynchronizerStore
from atoll.storage.validation import (
    REJECTION_KINDS,
    InvalidInput,
    PrunedError,
    RoundOrderError,
    RunExistsError,
    RunNotFoundError,
    StorageError,
    TransientStorageError,
    UnsafeStoreError,
    validate_id,
)
from atoll.storage.verify import VerifyReport

__all__ = [
    "AcceptedContribution",
    "BlobRef",
    "CheckpointInfo",
    "CommitChain",
    "CommitRecord",
    "CommitResult",
    "ContributionListing",
    "ContributionRecord",
    "FragmentState",
    "GlobalState",
    "Heartbeat",
    "InvalidInput",
    "LearnerState",
    "LearnerStateRecord",
    "LearnerStore",
    "Lease",
    "LeaseError",
    "LeaseHolder",
    "Liveness",
    "ObjectStore",
    "OperatorStore",
    "PruneRecord",
    "PrunedError",
    "REJECTION_KINDS",
    "RetryPolicy",
    "RoundOrderError",
    "RunCreator",
    "RunExistsError",
    "RunHandle",
    "RunManifest",
    "RunNotFoundError",
    "RunReader",
    "SCHEMA_VERSION",
    "StopMarker",
    "StorageError",
    "SynchronizerStore",
    "TransientStorageError",
    "UnsafeStoreError",
    "VerifyReport",
    "is_transient",
    "redact",
    "sha256_hex",
    "validate_id",
]
