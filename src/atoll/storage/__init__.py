"""atoll.storage: the bucket protocol over fsspec (docs/protocol.md is the layout's reference).

Knows nothing of Prefect. Entry point: :class:`RunStore` (``RunStore.open(url, storage_options)``).
"""

from atoll.storage.bucket import (
    CheckpointInfo,
    CommitResult,
    ContributionListing,
    GlobalState,
    LearnerState,
    RunStore,
)
from atoll.storage.codec import SCHEMA_VERSION, sha256_hex
from atoll.storage.liveness import Heartbeat, Lease, LeaseError, Liveness, StopMarker
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

__all__ = [
    "AcceptedContribution",
    "BlobRef",
    "CheckpointInfo",
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
    "Lease",
    "LeaseError",
    "Liveness",
    "ObjectStore",
    "PruneRecord",
    "PrunedError",
    "REJECTION_KINDS",
    "RetryPolicy",
    "RoundOrderError",
    "RunExistsError",
    "RunManifest",
    "RunNotFoundError",
    "RunStore",
    "SCHEMA_VERSION",
    "StopMarker",
    "StorageError",
    "TransientStorageError",
    "UnsafeStoreError",
    "is_transient",
    "redact",
    "sha256_hex",
    "validate_id",
]
