"""atoll.core: the Decoupled DiLoCo algorithm as pure, exact math and policy.

Imports torch and the standard library only (checked by tests/unit/test_layers.py).
"""

from atoll.core.align import FragmentCounters, LearnerCounters, align_fragment
from atoll.core.compress import CODECS, CompressionError, EncodedTensor, decode, encode, encoded_nbytes
from atoll.core.config import ConfigError, DilocoConfig, data_parallel, paper, synchronous_diloco
from atoll.core.fragments import (
    FragmentPlan,
    embedding_parameter_names,
    fragment_offsets,
    pack_fragments,
    plan_fragments,
)
from atoll.core.merge import merge_fragment, rda, weighted_mean
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import learner_delta, outer_gradient
from atoll.core.quorum import (
    Arrival,
    QuorumDecision,
    QuorumPolicy,
    TimingEma,
    TimingEstimates,
    decide_round,
    grace_window_s,
)
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.retry import FETCH_RETRY, ROUND_RETRY, STORAGE_RETRY, RetryPolicy
from atoll.core.synchronize import FragmentContribution, FragmentRoundResult, MergePolicy, synchronize_fragment
from atoll.core.weights import Counters, WeightResult, contribution_weights, unweighable

__all__ = [
    "Arrival",
    "CODECS",
    "CompressionError",
    "ConfigError",
    "Counters",
    "DilocoConfig",
    "EncodedTensor",
    "FragmentContribution",
    "FragmentCounters",
    "FragmentPlan",
    "FragmentRoundResult",
    "LearnerCounters",
    "MergePolicy",
    "NesterovOuterOptimizer",
    "QuorumDecision",
    "QuorumPolicy",
    "Rejection",
    "RejectionKind",
    "RetryPolicy",
    "FETCH_RETRY",
    "ROUND_RETRY",
    "STORAGE_RETRY",
    "TimingEma",
    "TimingEstimates",
    "WeightResult",
    "align_fragment",
    "contribution_weights",
    "data_parallel",
    "decide_round",
    "decode",
    "embedding_parameter_names",
    "encode",
    "encoded_nbytes",
    "fragment_offsets",
    "grace_window_s",
    "learner_delta",
    "merge_fragment",
    "outer_gradient",
    "pack_fragments",
    "paper",
    "plan_fragments",
    "rda",
    "synchronize_fragment",
    "synchronous_diloco",
    "unweighable",
    "weighted_mean",
]
