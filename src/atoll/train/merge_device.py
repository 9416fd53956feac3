"""The synchronizer's merges on its device, into buffers recycled from round to round.

:func:`merge_on_device` runs :func:`~atoll.core.synchronize.synchronize_fragment` on the
synchronizer's device (``SynchronizerOptions.device``) with its inputs and outputs on the host;
:class:`FragmentMerger` holds what a synchronizer's merges keep between rounds: the run's
:class:`~atoll.core.synchronize.MergePolicy`, the merge's scratch, the retired versions and
momentum buffers a round writes into, and each fragment's recent update norms (the outlier
guard's reference when a round is too small to compare within).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from atoll.core.compress import DecodeBuffers
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.rejection import Rejection
from atoll.core.synchronize import (
    MIN_NORM_HISTORY,
    FragmentContribution,
    FragmentRoundResult,
    MergePolicy,
    MergeWorkspace,
    synchronize_fragment,
)
from atoll.storage.reader import RunReader
from atoll.storage.validation import InvalidInput
from atoll.train.device import fragment_to_device, fragment_to_host

__all__ = ["FragmentMerger", "NORM_HISTORY", "fragment_bases", "merge_on_device"]

_HOST = torch.device("cpu")

NORM_HISTORY = 8
"""Merged update norms kept per fragment, and across the run: the outlier guard compares each
contribution with their median (:func:`~atoll.core.synchronize.synchronize_fragment`'s
``norm_history``, :meth:`FragmentMerger.norm_reference`)."""

Tensors = Mapping[str, torch.Tensor]


def merge_on_device(device: torch.device, *, current: Tensors, bases: Mapping[int, Tensors],
                    contributions: list[FragmentContribution], optimizer: NesterovOuterOptimizer,
                    policy: MergePolicy | None = None, workspace: MergeWorkspace | None = None,
                    out: Tensors | None = None, norm_history: Sequence[float] = (),
                    reasons: dict[str, Rejection] | None = None) -> FragmentRoundResult | None:
    """:func:`~atoll.core.synchronize.synchronize_fragment` on ``device``, inputs and outputs on the host.

    On the CPU this is exactly ``synchronize_fragment``. Elsewhere the inputs go to the device,
    the merge and outer step run there (fp32), and the new fragment, the merged update and the
    optimizer's momentum come back with one device-to-host copy each (``out``, host tensors for
    the new fragment, is then not used; a ``workspace`` holds device buffers). Contributions
    already on the device (the synchronizer decodes them there:
    :meth:`~atoll.storage.reader.RunReader.load_contributions` with ``device``) are not copied.
    """
    if device.type == "cpu":
        return synchronize_fragment(current=current, bases=bases, contributions=contributions,
                                    optimizer=optimizer, policy=policy, workspace=workspace, out=out,
                                    norm_history=norm_history, reasons=reasons)
    optimizer.buffers = fragment_to_device(optimizer.buffers, device)
    current_on = fragment_to_device(current, device)
    result = synchronize_fragment(
        current=current_on,  # the current version as a base is the same mapping (no re-anchoring needed)
        bases={v: current_on if b is current else fragment_to_device(b, device) for v, b in bases.items()},
        contributions=[dataclasses.replace(c, delta=fragment_to_device(c.delta, device)) for c in contributions],
        optimizer=optimizer, policy=policy, workspace=workspace, norm_history=norm_history, reasons=reasons,
    )
    optimizer.buffers = fragment_to_host(optimizer.buffers)
    if result is not None:
        result.new_params = fragment_to_host(result.new_params)
        result.update = fragment_to_host(result.update)
    return result


def fragment_bases(store: RunReader, p: int, *, version: int, current: dict[str, torch.Tensor],
                   contributions: list[FragmentContribution],
                   previous: tuple[int, dict[str, torch.Tensor]] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Fragment ``p`` at every base version the contributions name: ``current`` (in memory) for
    its own ``version``, ``previous`` (version, values) where held in memory, the others read
    from the bucket; a version whose object is gone is left out (its contributions get UNKNOWN_BASE)."""
    bases: dict[int, dict[str, torch.Tensor]] = {}
    missing: set[int] = set()
    for c in contributions:
        if c.base_version in bases or c.base_version in missing:
            continue
        if c.base_version == version:
            bases[c.base_version] = current
            continue
        if previous is not None and c.base_version == previous[0]:
            bases[c.base_version] = previous[1]
            continue
        try:
            bases[c.base_version] = store.read_global_fragment(p, c.base_version)
        except InvalidInput:  # that version's object is gone: its contributions get UNKNOWN_BASE
            missing.add(c.base_version)
    return bases


class FragmentMerger:
    """One synchronizer's merges: by its run's policy, on its device, reusing buffers.

    Buffers reused from round to round (no fresh fragment-sized, page-faulting buffers): the
    merge's scratch, the decoded contributions (:attr:`decoded`: the synchronizer gives them back
    once merged), and the versions and momentum won rounds retired (:attr:`spares`). Only tensors
    this process allocated are recycled.
    """

    def __init__(self, device: torch.device, policy: MergePolicy, *, fragment_numel: Sequence[int],
                 keep_previous: bool = False) -> None:
        self.device = device
        self.keep_previous = keep_previous
        """Hold each fragment's previous version in memory (:meth:`previous`): with masters rebuilt
        by replay, reading it from the bucket would replay."""
        self._previous: dict[int, tuple[int, dict[str, torch.Tensor], bool]] = {}
        self.policy = policy
        self.workspace = MergeWorkspace()
        self.decoded = DecodeBuffers()
        """What the round's contributions are decoded into (``RunReader.load_contributions(into=...)``)."""
        self.spares = DecodeBuffers()
        """Host tensors of retired versions and momentum, for any fragment's next new version or
        momentum copy of the same shapes (a fragment's layers share their shapes with the other
        fragments'). Shared, about one fragment's worth waits here; one spare set per fragment
        would hold another copy of the model and of its momentum."""
        self._merged_here: set[int] = set()
        self._numel = list(fragment_numel)
        self._norms: dict[int, deque[float]] = {p: deque(maxlen=NORM_HISTORY) for p in range(len(self._numel))}
        self._recent: deque[tuple[int, float]] = deque(maxlen=NORM_HISTORY)
        """(fragment, norm) of the run's last merged rounds, whichever fragment each updated."""

    def remember_norm(self, fragment: int, norm: Any) -> None:
        """A merged round's update norm (rounds in order): the outlier guard's reference with K = 1."""
        if isinstance(norm, int | float) and not isinstance(norm, bool) and math.isfinite(norm) and norm > 0:
            self._norms[fragment].append(float(norm))
            self._recent.append((fragment, float(norm)))

    def norm_reference(self, p: int) -> tuple[float, ...]:
        """What fragment ``p``'s outlier guard compares a lone contribution with: its own recent
        merged update norms once it has :data:`~atoll.core.synchronize.MIN_NORM_HISTORY` of them;
        before that the run's recent ones (other fragments'), each rescaled to ``p``'s size by
        sqrt(numel_p / numel_q). Fragments of one model move by similar amounts per parameter, so
        a lone liar is bounded from the run's third merged round on, not from the fragment's
        third (3P rounds later); the run's first rounds have no reference at all."""
        own = tuple(self._norms[p])
        if len(own) >= MIN_NORM_HISTORY:
            return own
        scaled = tuple(n * math.sqrt(self._numel[p] / self._numel[q]) for q, n in self._recent)
        return scaled if len(scaled) >= MIN_NORM_HISTORY else own

    def optimizer_copy(self, p: int, optimizer: NesterovOuterOptimizer) -> NesterovOuterOptimizer:
        """A copy of fragment ``p``'s outer optimizer for one round (if another synchronizer wins the
        commit, the copy is discarded), its momentum in spare buffers (:attr:`spares`). At outer
        momentum 0 there is none to copy: the step replaces the buffers."""
        if not optimizer.momentum:
            return optimizer.fork()
        shapes = {n: tuple(b.shape) for n, b in optimizer.buffers.items() if b.device.type == "cpu"}
        return optimizer.fork(reuse=self.spares.take(shapes, _HOST))

    def merge(self, p: int, *, current: dict[str, torch.Tensor], bases: Mapping[int, Tensors],
              contributions: list[FragmentContribution], optimizer: NesterovOuterOptimizer,
              reasons: dict[str, Rejection]) -> FragmentRoundResult | None:
        """Merge ``contributions`` into fragment ``p`` (``current``) with one step of ``optimizer``,
        the new version written into spare buffers (on the CPU; elsewhere it comes back from the device)."""
        out = self.spares.take({n: tuple(t.shape) for n, t in current.items()}, _HOST) if self.device.type == "cpu" else None
        return merge_on_device(
            self.device, current=current, bases=bases, contributions=contributions, optimizer=optimizer,
            policy=self.policy, workspace=self.workspace, out=out,
            norm_history=self.norm_reference(p), reasons=reasons,
        )

    def retire(self, p: int, params: dict[str, torch.Tensor], optimizer: NesterovOuterOptimizer, *,
               version: int) -> None:
        """Fragment ``p`` has a new version: its old one (``version``) and its old optimizer's
        momentum are free. Call it once the new version's optimizer has taken its momentum (its
        fork's copies made: :attr:`~atoll.core.outer.NesterovOuterOptimizer.buffers`), since
        another fragment's round may write into the old buffers next.

        Without ``keep_previous`` the retired version is nobody's base in memory (older bases are
        read from the bucket): it becomes spare, if this process allocated it. With it, the
        retired version stays as the base of the next round's re-anchored contributions
        (:meth:`previous`; its master may be written nowhere), and the version it replaces there
        becomes spare."""
        recyclable = p in self._merged_here
        self._merged_here.add(p)
        if optimizer.momentum:  # at 0 its buffers are the merge's updates, not its own
            self.spares.give_back(optimizer.buffers.values())
        if self.keep_previous:
            held = self._previous.get(p)
            self._previous[p] = (version, params, recyclable)
            if held is None:
                return
            _, params, recyclable = held
        if recyclable:
            self.spares.give_back(params.values())

    def hold_previous(self, p: int, version: int, params: dict[str, torch.Tensor]) -> None:
        """Fragment ``p``'s version before its current one, known already (a replay rebuilt it)."""
        if self.keep_previous:
            self._previous[p] = (version, params, False)

    def previous(self, p: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, values) of fragment ``p``'s version before its current one, when kept."""
        held = self._previous.get(p)
        return None if held is None else (held[0], held[1])
