"""The bounded retry policies of the store, the synchronizer's rounds and the learner's fetcher.

Three things are retried under a :class:`RetryPolicy` from here, each bounded; none forever:

* one storage operation that failed transiently (network, 5xx, throttling): :data:`STORAGE_RETRY`;
* one round of the synchronizer that raised (a storage error that outlived the storage retries, a
  bug): :data:`ROUND_RETRY`, in the plain loop and in the Prefect training run alike (where a
  failed poll of ``await-quorum`` is retried under it too); after the
  last attempt the error propagates, so the process fails loudly and orchestration restarts it
  from the bucket;
* the learner's background fetch of new global versions: :data:`FETCH_RETRY`; after the last
  attempt the learner fails loudly instead of training on stale state.

Bad *data* is never retried: a malformed contribution becomes a recorded rejection at once.

Other waits live with what they pace: relaunching a crashed learner flow run or training run waits
out ``relaunch_backoff_s`` (the healing and supervision policies); a local learner process that
keeps dying restarts with a doubling back-off; the round recorder tries a Prefect API call again
for about 2.5 s while the server answers busy, and a batch of rounds it failed to write after
``retry_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["RetryPolicy", "STORAGE_RETRY", "ROUND_RETRY", "FETCH_RETRY"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter: retry n waits in [d/2, d], d = min(max, base * 2**n)."""

    attempts: int = 5
    """Total tries of one operation (1 = no retry)."""

    base_delay_s: float = 0.1
    """Upper bound of the wait before the first retry."""

    max_delay_s: float = 5.0
    """Cap on any single wait."""

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {self.attempts!r}")
        if not (0 <= self.base_delay_s <= self.max_delay_s):
            raise ValueError(f"need 0 <= base_delay_s <= max_delay_s, got {self.base_delay_s!r}, {self.max_delay_s!r}")

    def delay_s(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0 = the first retry)."""
        d = min(self.max_delay_s, self.base_delay_s * float(2 ** min(retry, 60)))
        jitter: float = (rng or random).uniform(0, d / 2)
        return d / 2 + jitter

    def exhausted(self, failures: int) -> bool:
        """True once ``failures`` consecutive failures used up every attempt."""
        return failures >= self.attempts


STORAGE_RETRY = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=5.0)
"""One storage operation (get, put, create, list)."""

ROUND_RETRY = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=10.0)
"""One synchronizer round that raised (plain loop and Prefect training run)."""

FETCH_RETRY = RetryPolicy(attempts=8, base_delay_s=0.5, max_delay_s=30.0)
"""The learner's background fetch of committed rounds."""
