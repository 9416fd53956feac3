"""Chaos only: storage faults injected into every operation of a process (``$ATOLL_FAULT_STORAGE``)."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter

__all__ = ["StorageFaults"]


class StorageFaults:
    """Chaos only (never set in production): every storage operation of the process first sleeps
    a random latency and, with some probability, fails with a transient error, so the retry
    policy and everything above it run as against an unwell bucket.

    Read once from ``$ATOLL_FAULT_STORAGE``, e.g. ``error=0.01,latency_s=0.05,seed=3``: ``error``
    is the probability of a ``ConnectionResetError`` before an operation (each retry draws again),
    ``latency_s`` the upper end of a uniform extra latency per operation, ``lost`` the probability
    that a write (put, create) lands and its reply is lost (the retry finds it there).
    """

    ENV = "ATOLL_FAULT_STORAGE"

    def __init__(self, error: float, latency_s: float, seed: int | None, lost: float = 0.0) -> None:
        self.error, self.latency_s, self.lost = error, latency_s, lost
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    @classmethod
    def from_env(cls) -> StorageFaults | None:
        spec = os.environ.get(cls.ENV, "").strip()
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        try:
            error = float(fields.get("error", 0.0))
            latency_s = float(fields.get("latency_s", 0.0))
            lost = float(fields.get("lost", 0.0))
            seed = int(fields["seed"]) if "seed" in fields else None
        except ValueError as e:
            raise ValueError(f"${cls.ENV}={spec!r}: {e} (expected e.g. error=0.01,latency_s=0.05,seed=3)") from None
        if not (0.0 <= error < 1.0 and 0.0 <= lost < 1.0 and 0.0 <= latency_s <= 60.0):
            raise ValueError(f"${cls.ENV}={spec!r}: error and lost must be in [0, 1) and latency_s in [0, 60]")
        return cls(error, latency_s, seed, lost)

    def before(self, op: str) -> None:
        with self._lock:
            delay = self._rng.uniform(0.0, self.latency_s) if self.latency_s else 0.0
            fail = self.error > 0 and self._rng.random() < self.error
        if delay:
            self.injected["latency"] += 1
            time.sleep(delay)
        if fail:
            self.injected[f"error:{op}"] += 1
            raise ConnectionResetError(errno.ECONNRESET, f"injected fault ({self.ENV}) before {op}")

    def after(self, op: str) -> None:
        if op in ("put", "create") and self.lost > 0:
            with self._lock:
                fail = self._rng.random() < self.lost
            if fail:
                self.injected[f"lost:{op}"] += 1
                raise ConnectionResetError(errno.ECONNRESET, f"injected lost reply ({self.ENV}) after {op}")
