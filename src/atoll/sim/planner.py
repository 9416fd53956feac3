"""Bandwidth planner: what one learner sends per round and per second, against data-parallel.

Byte accounting matches :mod:`atoll.core.compress`: fp32 4 B/param, bf16 2 B/param, int4 one
nibble per element (blocks zero-padded) plus one fp32 scale per block. A learner fetches the
synchronizer's fp32 fragment (the downlink is fp32 unless told otherwise).

:func:`plan` is the link budget (payloads, per second, against DP, whether transfers hide);
:func:`plan_wire` is what a run of a given :class:`~atoll.core.config.DilocoConfig` puts on the
wire per round and per token, records and file headers included: the figure the object-store
counters (``atoll.storage.wire``) measure, which benchmarks print beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.core.config import DilocoConfig
from atoll.core.quorum import QuorumPolicy, TimingEstimates, grace_window_s

__all__ = ["Plan", "WirePlan", "encoded_bytes", "plan", "plan_wire"]


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
    download_precision: str = "fp32",
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

    * A learner uploads one fragment delta every H/P steps and downloads the merged fragment
      (``download_precision``, default fp32: the synchronizer's master copy, what learners fetch).
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
    down = encoded_bytes(frag, download_precision, block_size)
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


# What atoll's objects add around the tensors (measured on its records; JSON, so they vary by a
# few bytes with names and numbers). Tiny against a real model's fragments, not against a toy's.
SAFETENSORS_ENTRY_BYTES = 70
"""Header bytes of one stored array in a safetensors file, beside its name (dtype, shape, offsets)."""
CONTRIBUTION_RECORD_BYTES = 570
"""A contribution record without its tensor list (ids, counters, payload ref, digest, ``info``)."""
CONTRIBUTION_TENSOR_BYTES = 50
"""A contribution record's entry for one tensor, beside its name (codec, block size, shape)."""
COMMIT_RECORD_BYTES = 700
"""A commit record without its state table and contributors (round, chain, timings, stats)."""
COMMIT_FRAGMENT_BYTES = 225
"""A commit record's state-table entry for one fragment (version, params and momentum refs)."""
COMMIT_DOWNLINK_BYTES = 255
"""What a compressed downlink adds to a state-table entry (view and update refs, base, codec)."""
COMMIT_CONTRIBUTOR_BYTES = 380
"""A commit record's bytes per merged contributor (accepted entry, pool, loss, wire report)."""
HEAD_BYTES = 40
"""The ``sync/head.json`` hint the synchronizer writes after each commit."""
TENSOR_NAME_CHARS = 24
"""Assumed length of a parameter name when only the tensor count is known."""


@dataclass(frozen=True)
class WirePlan:
    """Predicted traffic of a run, per round and per token (bodies of PUTs and GETs, as counted by
    ``atoll.storage.wire``), with every learner contributing to every round at the nominal
    cadence: one round per H / P steps of each learner."""

    fragment_params: int
    """Parameters in one fragment (params / P, rounded up)."""
    payload_bytes: int
    """One contribution's payload: the encoded delta in a safetensors file."""
    contribution_record_bytes: int
    """One contribution's record."""
    fragment_bytes: int
    """One new global fragment version as a learner fetches it: the fp32 fragment, or with a
    compressed downlink the update against the learners' view."""
    commit_record_bytes: int
    """One commit record (every learner reads each one)."""
    momentum_bytes: int
    """The fragment's outer momentum (fp32), written by the synchronizer each round when the outer
    momentum is not 0; the fp32 master and, with a compressed downlink, the learners' view are
    the same size."""
    learners: int
    """M: learners contributing to each round."""
    steps_per_round: float
    """Each learner's inner steps per round: H / P."""
    tokens_per_step: int
    """Tokens one learner trains on per inner step."""
    dp_bytes_per_token: float
    """Data-parallel per member: a ring all-reduce of the full gradient every step."""
    save_bytes: int = 0
    """One save of a learner's inner state for rejoin (AdamW's two moments, fp32 or bf16, and its record)."""
    save_every_steps: int | None = 0
    """``Recipe.save_every_steps``: steps between two saves (0: not counted); None: saves paced by
    the budget (``save_uplink_share``, ``save_every_s``)."""
    save_uplink_share: float | None = None
    """``Recipe.save_uplink_share`` (with ``save_every_steps`` None): saves send at most this
    many bytes per byte of the learner's other uplink (here: its contributions)."""
    save_every_s: float = 0.0
    """``Recipe.save_every_s`` (with ``save_every_steps`` None): seconds between two saves at least;
    counted only with ``step_s``."""
    step_s: float | None = None
    """A learner's inner-step time, for ``save_every_s``."""
    downlink_compressed: bool = False
    """The synchronizer also writes the update each round, and the learners' view every
    ``view_every`` versions of a fragment."""
    momentum_written: bool = True
    """The synchronizer writes the outer momentum each round (False at outer momentum 0: the
    outer step never reads it)."""
    view_every: int = 1
    """``DilocoConfig.downlink_snapshot_every``: a fragment's view is written every this many
    versions (amortized here)."""
    master_every: int = 1
    """``DilocoConfig.master_snapshot_every``: a fragment's master (and momentum) is written on 2
    versions out of this many when it is above 2, else on every one (amortized here)."""

    @property
    def up_bytes_per_round(self) -> int:
        """One learner's uplink per round: its contribution's payload and record."""
        return self.payload_bytes + self.contribution_record_bytes

    @property
    def down_bytes_per_round(self) -> int:
        """One learner's downlink per round: the commit record and the new fragment."""
        return self.commit_record_bytes + self.fragment_bytes

    @property
    def up_requests_per_round(self) -> int:
        """One learner's PUTs per round (payload, record); polls and heartbeats come on top."""
        return 2

    @property
    def down_requests_per_round(self) -> int:
        """One learner's GETs per round that bring bytes (commit record, fragment); each poll that
        finds no new round adds one GET of nothing."""
        return 2

    @property
    def sync_up_bytes_per_round(self) -> int:
        """The synchronizer's uplink per round: the new fp32 fragment and its momentum (mu > 0),
        amortized over ``master_every`` versions; with a compressed downlink the update and the
        view (amortized over ``view_every`` versions); commit record, head (docs/protocol.md,
        what a round writes)."""
        downlink = self.momentum_bytes / self.view_every + self.fragment_bytes if self.downlink_compressed else 0
        share = 2 / self.master_every if self.master_every > 2 else 1.0
        master = self.momentum_bytes * (2 if self.momentum_written else 1) * share
        return round(master + downlink + self.commit_record_bytes + HEAD_BYTES)

    @property
    def sync_down_bytes_per_round(self) -> int:
        """The synchronizer's downlink per round: every contributor's record and payload."""
        return self.learners * (self.contribution_record_bytes + self.payload_bytes)

    def per_token(self, bytes_per_round: float) -> float:
        """Bytes per round of one learner as bytes per token that learner trains."""
        return bytes_per_round / (self.steps_per_round * self.tokens_per_step)

    @property
    def up_bytes_per_token(self) -> float:
        """Contributions only (:attr:`save_bytes_per_token` comes on top)."""
        return self.per_token(self.up_bytes_per_round)

    @property
    def save_bytes_per_token(self) -> float:
        """A learner's saves of its inner state, per token it trains: at ``save_every_steps``, or at
        the most the budget allows (saves are whole, so a run's saves approach it from below)."""
        if self.save_every_steps is not None:
            return self.save_bytes / (self.save_every_steps * self.tokens_per_step) if self.save_every_steps else 0.0
        rate = math.inf
        if self.save_uplink_share is not None:
            rate = self.save_uplink_share * self.up_bytes_per_token
        if self.save_every_s and self.step_s:
            rate = min(rate, self.save_bytes / (self.save_every_s / self.step_s * self.tokens_per_step))
        return rate if math.isfinite(rate) else 0.0

    @property
    def steps_per_save(self) -> float | None:
        """A learner's inner steps between two saves at that rate (None: no saves counted)."""
        per_token = self.save_bytes_per_token
        return self.save_bytes / (per_token * self.tokens_per_step) if per_token > 0 else None

    @property
    def down_bytes_per_token(self) -> float:
        return self.per_token(self.down_bytes_per_round)

    def lines(self) -> list[str]:
        return [
            f"per round, each learner:  up {self.up_bytes_per_round:,} B ({self.up_requests_per_round} PUT), "
            f"down {self.down_bytes_per_round:,} B ({self.down_requests_per_round} GET + polls)",
            f"per token trained:        up {self.up_bytes_per_token:,.1f} B, down {self.down_bytes_per_token:,.1f} B, "
            f"data-parallel {self.dp_bytes_per_token:,.1f} B"
            + (f"; saves {self.save_bytes_per_token:,.1f} B more up" if self.save_bytes_per_token else ""),
            f"synchronizer per round:   up {self.sync_up_bytes_per_round:,} B, down {self.sync_down_bytes_per_round:,} B",
            *self.save_lines(),
        ]

    def save_lines(self) -> list[str]:
        """What a learner's saves of its inner state cost, at their cadence."""
        steps = self.steps_per_save
        if steps is None:
            return []
        up = self.up_bytes_per_token
        share = f" ({self.save_bytes_per_token / up:.1%} of its contributions' bytes)" if up else ""
        return [f"saves (inner state):      {self.save_bytes / 2**20:,.1f} MiB each, every ~{steps:,.0f} steps: "
                f"{self.save_bytes_per_token:,.2f} B per token up{share}"]


def _safetensors_bytes(n: int, precision: str, tensors: int, block_size: int) -> int:
    arrays = tensors * (2 if precision == "int4" else 1)  # int4: codes and scales
    return encoded_bytes(n, precision, block_size) + 8 + arrays * (SAFETENSORS_ENTRY_BYTES + TENSOR_NAME_CHARS)


def plan_wire(config: DilocoConfig, *, params: int, tokens_per_step: int, tensors: int | None = None,
              download_precision: str | None = None, dp_precision: str = "bf16",
              save_every_steps: int | None = 0, save_uplink_share: float | None = None, save_every_s: float = 0.0,
              step_s: float | None = None, save_moments: str = "fp32") -> WirePlan:
    """What a run of ``config`` on a model of ``params`` parameters in ``tensors`` tensors (default:
    one per fragment) puts on the wire, per round and per token; ``tokens_per_step``: tokens one
    learner trains on per inner step. Deltas travel in ``config.compression``, new versions in
    ``download_precision`` (default ``config.downlink_compression``: the fp32 master, or a
    compressed update a learner applies to its view). The recipe's inner-state saves:
    ``save_every_steps`` (0: leave them out; None: paced by ``save_uplink_share`` and
    ``save_every_s`` at ``step_s`` seconds a step), moments in ``save_moments`` ('fp32', 'bf16')."""
    if params < 1 or tokens_per_step < 1:
        raise ValueError("need params >= 1 and tokens_per_step >= 1")
    if save_moments not in ("fp32", "bf16"):
        raise ValueError(f"save_moments must be 'fp32' or 'bf16' (got {save_moments!r})")
    p, m = config.num_fragments, config.num_learners
    per_fragment = max(1, math.ceil((tensors if tensors is not None else p) / p))
    frag = math.ceil(params / p)
    block = config.compression_block_size
    dp = 2.0 * (m - 1) / m * encoded_bytes(params, dp_precision, block) / tokens_per_step if m > 1 else 0.0
    down = download_precision or config.downlink_compression
    compressed = down != "fp32"
    return WirePlan(
        fragment_params=frag,
        payload_bytes=_safetensors_bytes(frag, config.compression, per_fragment, block),
        contribution_record_bytes=CONTRIBUTION_RECORD_BYTES
        + per_fragment * (CONTRIBUTION_TENSOR_BYTES + TENSOR_NAME_CHARS),
        fragment_bytes=_safetensors_bytes(frag, down, per_fragment, block),
        commit_record_bytes=COMMIT_RECORD_BYTES + p * (COMMIT_FRAGMENT_BYTES + compressed * COMMIT_DOWNLINK_BYTES)
        + m * COMMIT_CONTRIBUTOR_BYTES,
        momentum_bytes=_safetensors_bytes(frag, "fp32", per_fragment, block),
        learners=m,
        steps_per_round=config.inner_steps / p,
        tokens_per_step=tokens_per_step,
        dp_bytes_per_token=dp,
        save_bytes=2 * _safetensors_bytes(params, save_moments, tensors if tensors is not None else p, block)
        + CONTRIBUTION_RECORD_BYTES,  # two moments per parameter, and the state record
        save_every_steps=None if save_every_steps is None else max(0, save_every_steps),
        save_uplink_share=save_uplink_share, save_every_s=save_every_s, step_s=step_s,
        downlink_compressed=compressed,
        momentum_written=config.outer_momentum > 0,
        view_every=config.downlink_snapshot_every,
        master_every=config.master_snapshot_every if compressed else 1,  # learners read every fp32 master
    )
