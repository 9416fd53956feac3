"""Bandwidth planner: what one learner sends per round and per second, against data-parallel.

Byte accounting matches :mod:`atoll.core.compress`: fp32 4 B/param, bf16 2 B/param, int4 one
nibble per element (blocks zero-padded) plus one fp32 scale per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.core.quorum import QuorumPolicy, TimingEstimates, grace_window_s

__all__ = ["Plan", "encoded_bytes", "plan"]


def encoded_bytes(n: int, precision: str, block_size: int = 32) -> int:
    """Wire bytes of an n-element tensor in ``precision`` (same formula as core.compress)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if precision == "fp32":
        return 4 * n
    if precision == "bf16":
        return 2 * n
    if precision == "int4":
        blocks = -(-n // block_size)
        return blocks * block_size // 2 + 4 * blocks
    raise ValueError(f"unknown precision {precision!r}; choose fp32, bf16 or int4")


@dataclass(frozen=True)
class Plan:
    fragment_params: int
    upload_bytes_per_round: int
    download_bytes_per_round: int
    rounds_per_second: float
    bytes_per_second: float
    dp_bytes_per_second: float
    ratio: float
    transfer_s: float
    hidden_s: float
    hides: bool
    utilisation: float
    grace_s: float

    def lines(self) -> list[str]:
        gb = lambda b: f"{b * 8 / 1e9:.3f} Gbit/s"  # noqa: E731
        return [
            f"fragment size:                 {self.fragment_params:,} params",
            f"per round per learner:         up {self.upload_bytes_per_round:,} B, down {self.download_bytes_per_round:,} B",
            f"rounds per second per learner: {self.rounds_per_second:.4g}",
            f"sustained per learner:         {self.bytes_per_second:,.0f} B/s = {gb(self.bytes_per_second)}",
            f"data-parallel would need:      {self.dp_bytes_per_second:,.0f} B/s = {gb(self.dp_bytes_per_second)}",
            f"ratio DP / decoupled:          {self.ratio:.1f}x",
            f"one round's transfer:          {self.transfer_s:.3f} s vs {self.hidden_s:.3f} s of overlap (tau steps)",
            f"link utilisation:              {100 * self.utilisation:.1f}%",
            f"communication hidden:          {'yes' if self.hides else 'NO'}",
            f"grace window (policy):         {self.grace_s:.3f} s",
        ]


def plan(
    *,
    params: int,
    num_fragments: int = 24,
    inner_steps: int = 24,
    overlap_steps: int = 2,
    precision: str = "bf16",
    download_precision: str | None = None,
    step_s: float,
    wan_gbps: float,
    learners: int = 8,
    dp_precision: str = "bf16",
    grace_factor: float = 0.5,
    quorum_s: float = 0.0,
    merge_s: float = 0.0,
    block_size: int = 32,
) -> Plan:
    """Per-learner traffic of Decoupled DiLoCo vs data-parallel at the same step time.

    * A learner uploads one fragment delta every H/P steps and downloads the merged fragment.
    * Data-parallel all-reduces the full gradient every step; a ring all-reduce moves
      ``2 (M - 1) / M`` gradient sizes through each member's link.
    * Communication hides if one round's upload + download fits in the τ overlap steps
      (``tau * step_s``) and the sustained rate fits in the link.
    * Grace: :func:`atoll.core.quorum.grace_window_s` with ξ_step = step_s, ξ_quorum = quorum_s,
      ξ_sync = merge_s + download time.
    """
    if params < 1 or not (1 <= num_fragments <= inner_steps) or not (0 <= overlap_steps < inner_steps):
        raise ValueError("need params >= 1, 1 <= P <= H and 0 <= tau < H")
    if not (step_s > 0 and wan_gbps > 0 and learners >= 1):
        raise ValueError("step_s, wan_gbps and learners must be > 0")
    frag = math.ceil(params / num_fragments)
    up = encoded_bytes(frag, precision, block_size)
    down = encoded_bytes(frag, download_precision or precision, block_size)
    steps_between = inner_steps / num_fragments
    rounds_per_s = 1.0 / (steps_between * step_s)
    bps = (up + down) * rounds_per_s
    dp = 2.0 * (learners - 1) / learners * encoded_bytes(params, dp_precision, block_size) / step_s if learners > 1 else 0.0
    link = wan_gbps * 1e9 / 8.0
    transfer = (up + down) / link
    hidden = overlap_steps * step_s
    util = bps / link
    policy = QuorumPolicy(grace_factor=grace_factor, overlap_steps=overlap_steps, steps_between_rounds=steps_between)
    grace = grace_window_s(policy, TimingEstimates(step_s=step_s, quorum_s=quorum_s, sync_s=merge_s + down / link))
    return Plan(
        fragment_params=frag,
        upload_bytes_per_round=up,
        download_bytes_per_round=down,
        rounds_per_second=rounds_per_s,
        bytes_per_second=bps,
        dp_bytes_per_second=dp,
        ratio=dp / bps if bps else math.inf,
        transfer_s=transfer,
        hidden_s=hidden,
        hides=transfer <= hidden and util <= 1.0,
        utilisation=util,
        grace_s=grace,
    )
