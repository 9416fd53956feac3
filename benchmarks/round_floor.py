"""The arithmetic floor of one synchronizer round: the least CPU (or GPU) work any implementation
of the round must do, timed with bare torch and hashlib calls on flat tensors already in memory.

On a machine whose disk is fast and whose cores are few, a round is bound by arithmetic, not I/O:
an 86 M round reads ~27 MB of int4 payloads (a few ms from the page cache) but decodes, weighs and
merges ~43 M fp32 values. ``benchmarks/sync_throughput.py`` reports the round against its I/O
bound and against this floor plus that bound. What the floor counts, for a fragment of n
parameters and M contributions in the run's codecs (each step the protocol or the merge rule
needs, in its fewest passes):

1. the sha256 of each payload read (the integrity check a reader makes);
2. each payload decoded to fp32 (int4: atoll's one-lookup decode into memory already mapped;
   bf16 a conversion; fp32 none, the payload is read in place);
3. each delta's norm and the token-weighted sum of the deltas (radial-directional averaging weighs
   directions by norms), then the average's norm and one rescale;
4. the outer step: one pass at outer momentum 0, Nesterov's three otherwise;
5. the sha256 of the new fp32 master (the commit record names it, written or not);
6. with a compressed downlink, the update against the learners' view and the new view
   (:func:`atoll.core.compress.encode_residual`, one sweep).

Left out: listing and reading (the I/O bound has them), finiteness checks, serialization, the
commit record. The best of a few repeats, on torch's threads: a floor, not an estimate.
"""

from __future__ import annotations

import hashlib
import time

import torch

from atoll.core.compress import decode, encode, encode_residual

__all__ = ["ArithmeticFloor"]


class ArithmeticFloor:
    """Buffers for the largest fragment, reused for every size measured (cached by size)."""

    def __init__(self, max_numel: int, learners: int, uplink: str, downlink: str, outer_momentum: float,
                 block_size: int = 32, repeats: int = 3) -> None:
        self.learners, self.uplink, self.downlink = learners, uplink, downlink
        self.momentum, self.block_size, self.repeats = outer_momentum, block_size, repeats
        g = torch.Generator().manual_seed(2)
        self.source = torch.randn(max_numel, generator=g).mul_(1e-3)
        self.decoded = [torch.empty(max_numel) for _ in range(learners)] if uplink != "fp32" else []
        self.average = torch.empty(max_numel)
        self.master = torch.randn(max_numel, generator=g).mul_(0.02)
        self.velocity = torch.zeros(max_numel) if outer_momentum else None
        self.view = self.master.clone() if downlink != "fp32" else None
        self._seconds: dict[int, float] = {}

    def seconds(self, numel: int) -> float:
        """The floor of a round over a fragment of ``numel`` parameters (measured once per size)."""
        if numel not in self._seconds:
            self._seconds[numel] = self._measure(numel)
        return self._seconds[numel]

    def _measure(self, n: int) -> float:
        delta = self.source[:n]
        enc = encode(delta, self.uplink, block_size=self.block_size)
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in enc.parts.values())
        master = self.master[:n]
        best = float("inf")
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            for _ in range(self.learners):
                hashlib.sha256(payload).digest()
            deltas = ([decode(enc, out=d[:n]) for d in self.decoded] if self.decoded
                      else [enc.parts["data"]] * self.learners)
            norms = [torch.linalg.vector_norm(d) for d in deltas]
            average = torch.mul(deltas[0], 1 / self.learners, out=self.average[:n])
            for d in deltas[1:]:
                average.add_(d, alpha=1 / self.learners)
            average.mul_(sum(float(x) for x in norms) / self.learners / max(float(torch.linalg.vector_norm(average)), 1e-30))
            if self.velocity is None:
                master.add_(average, alpha=-0.7)
            else:
                v = self.velocity[:n].mul_(self.momentum).add_(average)
                master.add_(average, alpha=-0.7).add_(v, alpha=-0.7 * self.momentum)
            hashlib.sha256(master.numpy()).digest()
            if self.view is not None:
                encode_residual(master, self.view[:n], self.downlink, block_size=self.block_size)
            best = min(best, time.perf_counter() - t0)
        return best
