"""Run configuration: frozen, keyword-only dataclasses, validated, with paper presets.

Every field carries a docstring; every validation error names the knob to change.
Presets are plain functions (torchtitan style) so they can be read, diffed and composed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from atoll.core.quorum import QuorumPolicy

__all__ = [
    "ConfigError",
    "DilocoConfig",
    "MergeRule",
    "Weighting",
    "Codec",
    "paper",
    "synchronous_diloco",
    "data_parallel",
]

MergeRule = Literal["rda", "mean"]
Weighting = Literal["tokens", "uniform"]
Codec = Literal["fp32", "bf16", "int4"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the knob."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """Decoupled DiLoCo hyper-parameters. Defaults follow the paper (H = P = 24, tau = 2, K = 1)."""

    num_learners: int = 4
    """M: number of learners (islands) expected in the run."""

    num_fragments: int = 24
    """P: parameter fragments; each is synchronized in its own outer round."""

    inner_steps: int = 24
    """H: inner steps between two syncs of the same fragment (H >= P)."""

    overlap_steps: int = 2
    """tau: inner steps a learner keeps training before it must apply a merged fragment."""

    min_quorum: int = 1
    """K: minimum contributions before a round may close (1 <= K <= M)."""

    grace_factor: float = 0.5
    """gamma in [0, 1): fraction of the slack spent in the grace window after quorum."""

    outer_lr: float = 0.7
    """eta: Nesterov outer learning rate."""

    outer_momentum: float = 0.9
    """mu: Nesterov outer momentum in [0, 1). With very few inner steps per round (H of 2-4) and
    stale contributions (K = 1, each re-anchored to the current version), 0.9 can overshoot for a
    few rounds (validation loss 3.1 -> 8, then back); 0.5 trains smoothly there."""

    merge: MergeRule = "rda"
    """How outer gradients are merged: 'rda' (radial-directional averaging, paper) or 'mean'."""

    weighting: Weighting = "tokens"
    """Contribution weights: 'tokens' (c_tokens^2 / c_steps, paper) or 'uniform'."""

    rda_embeddings: bool = False
    """Apply RDA to embedding tensors too (paper: no, embeddings use the weighted mean)."""

    ema_decay: float = 0.9
    """Decay of the EMA timing estimates (xi_step, xi_quorum, xi_sync) behind the grace window."""

    initial_grace_s: float = 0.0
    """Grace window used before any step time has been measured."""

    compression: Codec = "fp32"
    """Precision of deltas on the wire: 'fp32', 'bf16' or 'int4' (one fp32 scale per block)."""

    compression_block_size: int = 32
    """Elements per scale block for 'int4' (even, >= 2), on the uplink and the downlink."""

    downlink_compression: Codec = "fp32"
    """Precision of what learners download per new fragment version: 'fp32' (the synchronizer's
    master copy), 'bf16' or 'int4'. Compressed, the synchronizer keeps its fp32 master and also
    publishes the version-to-version update with error feedback against what learners hold (their
    view), so a learner's copy stays within one quantization error of the master and the error
    does not accumulate (docs/protocol.md, downlink). A run whose manifest has no such field
    reads as 'fp32'."""

    downlink_snapshot_every: int = 8
    """With a compressed downlink, write a fragment's fp32 view (4 bytes a parameter) only every
    this many versions of the fragment (a snapshot), and at every version that has no update;
    the versions between publish only their compressed update, and readers (joiners, far-behind
    learners, a restarted synchronizer) rebuild the view from the newest snapshot at or below the
    version they want and the updates after it, bit for bit (docs/protocol.md, downlink). 8: with
    int4 the views then cost 0.5 bytes a parameter per version, under the update's 0.625, while
    a joiner reads at most a snapshot and 7 updates (4 + 4.4 bytes a parameter, about two views);
    with bf16 (2 bytes an update) 2 to 4 keeps that read near two views. 1 writes the view with
    every version. Learners and the master are the same for every value."""

    master_snapshot_every: int = 1
    """Write a fragment's fp32 master (and its outer momentum) on two consecutive versions out of
    every this many; the versions between name the master's sha256 but write no object, and
    readers (a restarted synchronizer, the evaluator, checkpoints) rebuild it by replaying those
    rounds' merges from the contributions their records name, bit for bit, checked against that
    sha256 (docs/protocol.md, "Masters by replay"). Two, because a round re-anchors contributions
    computed against the version before the current one. 1 or 2 write the master with every
    version. Only with a compressed downlink: with 'fp32' learners read the master itself, and
    every master is written whatever this says. At 16 with int4 the masters cost 0.5 bytes a
    parameter per version instead of 4, and a rebuild replays at most 14 rounds of the fragment.
    A synchronizer merging off the CPU writes every master too: its merges are not
    bit-reproducible on another device. Keep the
    processes that rebuild masters on one CPU family and torch version (AVX2 and AVX-512 hosts
    reproduce each other): a replay that does not reproduce is refused, never used."""

    max_wait_s: float | None = None
    """Close a round below quorum (with >= 1 valid contribution) once it has been open this long;
    None waits for the quorum K indefinitely (the paper's rule)."""

    outlier_norm_ratio: float | None = 100.0
    """Reject a contribution whose outer-gradient norm exceeds this multiple of the round's median
    (with >= 3 contributions) or of the median of the fragment's recent merged update norms (with
    >= 3 of them: the guard that works with K = 1); None disables the guard."""

    round_pacing: float = 0.0
    """Round pacing in [0, 1]: once K is met, a round also waits until its valid contributions
    carry round_pacing x H inner steps per live learner (their c_steps summed: the work since
    each last adopted the fragment), for at most round_pacing x H step times (xi_step) after it
    opened; then the grace window runs. 0 (the paper's rule) closes on quorum + grace alone, and
    with K = 1 every arrival can close a round, so a merged contribution carries far fewer than H
    steps; 1 makes it carry about H. A run whose manifest has no such field reads as 0."""

    keep_local_progress: bool = False
    """On adopting a new global version of a fragment, keep the learner's progress on it that no
    contribution carries yet (its steps since it last published the fragment: at least the
    overlap tau): the fragment becomes the new version plus that progress, and the counters carry
    those steps into the next contribution. False overwrites the fragment (the paper), and that
    progress is lost: with H = 8 and tau = 2, a quarter of every learner's work at least. Applies
    to one-process learners and DDP islands (FSDP2 islands overwrite). A run whose manifest has no
    such field reads as False."""

    kept_progress_share: float = 1.0
    """With keep_local_progress: the part of that progress an adoption keeps, in (0, 1]; the
    counters carry the same share of its steps and tokens. 1 keeps all of it (exact: the next
    contribution delivers that work). Below 1 the fragment lands between the new version and the
    learner's own values, as Streaming DiLoCo mixes an arriving fragment with the local one: the
    learners drift apart less, and that share of the steps counts as kept. A run whose manifest
    has no such field reads as 1."""

    kept_progress_into: str = "params"
    """With keep_local_progress, where the kept progress goes: 'params' adds it to the adopted
    fragment (the learner's values carry it on); 'delta' leaves the fragment at the adopted
    version and adds the progress to the learner's next contribution of it instead, so the work
    is merged without the learners drifting apart; it keeps all of it (kept_progress_share 1). A
    run whose manifest has no such field reads as 'params'."""

    max_weight_share: float | None = None
    """Largest normalised weight one contribution may get in a round with two or more (at least
    1/n with n contributions): a heavier one is capped and the others scaled up in proportion.
    Weights come from counters the learners report, so this bounds what one learner's claims
    can buy. Off (None) by default: an honest island with many more ranks than the others
    legitimately carries more than 0.9 of a round (two ranks beside one, at token weighting,
    already 0.901); counters are bounded by observed time (``max_learner_speedup``) either way.
    A fleet of equal learners can set e.g. 0.9 (docs/threat-model.md). ``max_step_share``, on
    by default, is the cap that knows the recipe's islands."""

    max_step_share: float | None = 0.9
    """Largest share of a round's inner steps one contribution may carry, with two or more
    contributions (counted as weighed: after the clip of ``max_learner_speedup``): a claim above
    it is clipped to ``max_step_share / (1 - max_step_share)`` times the others' steps together,
    tokens in proportion (:func:`~atoll.core.weights.cap_step_share`). Steps, not weights: an
    island's ranks multiply its tokens per step (the recipe's batch), never its steps, so an
    honest multi-rank island is no nearer the cap than a one-rank learner, while one learner's
    claims can buy at most this share of a round's steps whatever was observed before
    (docs/threat-model.md has the worst cases). In [0.5, 1); None turns it off. 0.9: the demo's
    honest rounds carry at most 0.82 (``benchmarks/trust_guards.py``)."""

    max_learner_speedup: float | None = 4.0
    """How much faster than the fastest other learner (its step time as the synchronizer
    observes it) a learner may step: a contribution's steps count for weighting at most
    H + max_learner_speedup x (time since its base version was committed) / that step time;
    a claim above it is clipped, not rejected (docs/threat-model.md). Until another learner's
    step time has been observed (a new run; a restarted synchronizer reads back the ones its
    predecessor observed), the bound is the prior 2 x H steps. None turns the clip and the
    prior off."""

    def __post_init__(self) -> None:
        # Checked in field order, so the first knob named is the first one out of range.
        self._check_schedule()
        self._check_outer_step()
        self._check_codecs()
        self._check_guards()

    def _need(self, ok: bool, knob: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{knob}: {msg} (got {getattr(self, knob)!r})")

    def _check_schedule(self) -> None:
        """M, P, H, tau, K: every fragment gets a slot and a round can close."""
        need = self._need
        need(_is_int(self.num_learners) and self.num_learners >= 1, "num_learners", "M must be an integer >= 1")
        need(_is_int(self.num_fragments) and self.num_fragments >= 1, "num_fragments", "P must be an integer >= 1")
        need(_is_int(self.inner_steps) and self.inner_steps >= 1, "inner_steps", "H must be an integer >= 1")
        need(
            self.inner_steps >= self.num_fragments,
            "inner_steps",
            f"H must be >= num_fragments (P={self.num_fragments}) so every fragment gets a slot",
        )
        need(
            _is_int(self.overlap_steps) and 0 <= self.overlap_steps < self.inner_steps,
            "overlap_steps",
            f"tau must be an integer in [0, H={self.inner_steps})",
        )
        need(_is_int(self.min_quorum) and self.min_quorum >= 1, "min_quorum", "K must be an integer >= 1")
        need(
            self.min_quorum <= self.num_learners,
            "min_quorum",
            f"K cannot exceed num_learners (M={self.num_learners}); the round could never close",
        )

    def _check_outer_step(self) -> None:
        """gamma, eta, mu, the merge rule, the weights and the timing EMA."""
        need = self._need
        need(0.0 <= self.grace_factor < 1.0, "grace_factor", "gamma must be in [0, 1)")
        need(math.isfinite(self.outer_lr) and self.outer_lr > 0, "outer_lr", "eta must be finite and > 0")
        need(0.0 <= self.outer_momentum < 1.0, "outer_momentum", "mu must be in [0, 1)")
        need(self.merge in ("rda", "mean"), "merge", "choose 'rda' or 'mean'")
        need(self.weighting in ("tokens", "uniform"), "weighting", "choose 'tokens' or 'uniform'")
        need(0.0 <= self.ema_decay < 1.0, "ema_decay", "must be in [0, 1)")
        need(
            math.isfinite(self.initial_grace_s) and self.initial_grace_s >= 0,
            "initial_grace_s",
            "must be finite and >= 0",
        )

    def _check_codecs(self) -> None:
        """Uplink and downlink precision, the int4 block."""
        need = self._need
        need(self.compression in ("fp32", "bf16", "int4"), "compression", "choose 'fp32', 'bf16' or 'int4'")
        need(self.downlink_compression in ("fp32", "bf16", "int4"), "downlink_compression",
             "choose 'fp32', 'bf16' or 'int4'")
        need(_is_int(self.downlink_snapshot_every) and self.downlink_snapshot_every >= 1,
             "downlink_snapshot_every", "must be an integer >= 1 (versions between two views)")
        need(_is_int(self.master_snapshot_every) and self.master_snapshot_every >= 1,
             "master_snapshot_every", "must be an integer >= 1 (versions between two written masters)")
        need(
            _is_int(self.compression_block_size)
            and self.compression_block_size >= 2
            and self.compression_block_size % 2 == 0,
            "compression_block_size",
            "must be an even integer >= 2 (two 4-bit codes share a byte)",
        )

    def _check_guards(self) -> None:
        """Round deadline, outlier guard, round pacing, kept progress, weight and step caps, speed clip."""
        need = self._need
        need(
            self.max_wait_s is None or (math.isfinite(self.max_wait_s) and self.max_wait_s > 0),
            "max_wait_s",
            "must be None or a finite number of seconds > 0",
        )
        need(
            self.outlier_norm_ratio is None or (math.isfinite(self.outlier_norm_ratio) and self.outlier_norm_ratio > 1),
            "outlier_norm_ratio",
            "must be None or a finite ratio > 1",
        )
        need(
            isinstance(self.round_pacing, int | float) and not isinstance(self.round_pacing, bool)
            and 0.0 <= self.round_pacing <= 1.0,
            "round_pacing",
            "must be a fraction of H in [0, 1] (0: off)",
        )
        need(isinstance(self.keep_local_progress, bool), "keep_local_progress", "must be True or False")
        need(isinstance(self.kept_progress_share, int | float) and not isinstance(self.kept_progress_share, bool)
             and 0.0 < self.kept_progress_share <= 1.0, "kept_progress_share", "must be a share in (0, 1]")
        need(self.kept_progress_into in ("params", "delta"), "kept_progress_into", "must be 'params' or 'delta'")
        need(self.kept_progress_into == "params" or self.kept_progress_share == 1.0, "kept_progress_share",
             "must be 1 with kept_progress_into='delta' (the delta keeps all of the progress)")
        need(self.max_weight_share is None or (isinstance(self.max_weight_share, int | float)
                                               and 0.0 < self.max_weight_share <= 1.0),
             "max_weight_share", "must be None or a share in (0, 1]")
        need(self.max_learner_speedup is None or (isinstance(self.max_learner_speedup, int | float)
                                                  and math.isfinite(self.max_learner_speedup)
                                                  and self.max_learner_speedup >= 1.0),
             "max_learner_speedup", "must be None or a finite ratio >= 1")
        need(self.max_step_share is None or (isinstance(self.max_step_share, int | float)
                                             and not isinstance(self.max_step_share, bool)
                                             and 0.5 <= self.max_step_share < 1.0),
             "max_step_share", "must be None or a share in [0.5, 1)")

    @property
    def steps_between_rounds(self) -> float:
        """Inner steps between two consecutive outer rounds: H / P."""
        return self.inner_steps / self.num_fragments

    def quorum_policy(self, *, poll_interval_s: float = 1.0) -> QuorumPolicy:
        """The quorum/grace policy this config implies."""
        return QuorumPolicy(
            min_quorum=self.min_quorum,
            grace_factor=self.grace_factor,
            overlap_steps=self.overlap_steps,
            steps_between_rounds=self.steps_between_rounds,
            initial_grace_s=self.initial_grace_s,
            poll_interval_s=poll_interval_s,
            max_wait_s=self.max_wait_s,
            pace_steps=self.round_pacing * self.inner_steps,
        )

    def replace(self, **changes: Any) -> DilocoConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DilocoConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def paper(num_learners: int = 8) -> DilocoConfig:
    """The paper's setting: H = P = 24, tau = 2, K = 1, gamma = 0.5, Nesterov(0.7, 0.9), RDA."""
    return DilocoConfig(num_learners=num_learners)


def synchronous_diloco(num_learners: int, inner_steps: int = 24, **overrides: Any) -> DilocoConfig:
    """Classic synchronous DiLoCo: K = M, P = 1, tau = 0, uniform weights, plain mean."""
    return DilocoConfig(
        num_learners=num_learners,
        num_fragments=1,
        inner_steps=inner_steps,
        overlap_steps=0,
        min_quorum=num_learners,
        grace_factor=0.0,
        merge="mean",
        weighting="uniform",
        **overrides,
    )


def data_parallel(num_learners: int) -> DilocoConfig:
    """Synchronous data-parallel SGD: synchronous DiLoCo with H = 1, eta = 1, mu = 0.

    With plain SGD as the inner optimizer this is exactly one SGD step on the union of batches.
    """
    return synchronous_diloco(num_learners, inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
