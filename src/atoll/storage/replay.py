"""Masters by replay: a fragment's fp32 master at a version whose object was never written.

With ``DilocoConfig.master_snapshot_every`` M > 2 the synchronizer writes a fragment's master
(and outer momentum) on two consecutive versions out of every M (``master_depth`` 0 and 1) and
only names it (sha256) on the others. A version at depth d >= 2 is rebuilt here by doing again
what the synchronizer did: start from the newest version at depth 1 (its master and momentum,
and the master of the version before it, which contributions of the next round may have been
computed against), then for each later version merge the contributions its commit record lists
as accepted, with the counters it weighed them by, and take the outer step
(:func:`atoll.core.synchronize.synchronize_fragment`, the synchronizer's own CPU path). Every
rebuilt version must hash to the sha256 its record names, so a replay is exact or refused,
never silently different: a contribution lost, overwritten or forged since, or another
numerical library, raises InvalidInput and the reader falls back as for a lost object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from atoll.core.config import DilocoConfig
from atoll.core.fragments import FragmentPlan
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.rejection import Rejection
from atoll.core.synchronize import FragmentContribution, MergePolicy, MergeWorkspace, synchronize_fragment
from atoll.core.weights import Counters
from atoll.storage.codec import bytes_to_tensors, tensors_sha256
from atoll.storage.records import BlobRef, CommitRecord, ContributionRecord, FragmentState, RunManifest
from atoll.storage.validation import InvalidInput, check_tensor_layout


class ReplaySource(Protocol):
    """What a replay reads (:class:`atoll.storage.reader.RunReader` is one)."""

    @property
    def config(self) -> DilocoConfig: ...
    @property
    def plan(self) -> FragmentPlan: ...
    @property
    def manifest(self) -> RunManifest: ...

    def fragment_state(self, fragment: int, version: int) -> FragmentState: ...
    def read_commit(self, round_: int) -> CommitRecord | None: ...
    def _read_fp32_blob(self, ref: BlobRef, shapes: Mapping[str, tuple[int, ...]], what: str) -> Tensors: ...
    def _read_blob_bytes(self, ref: BlobRef) -> bytes: ...
    def _read_contribution_record(self, key: str) -> ContributionRecord | Rejection: ...
    def load_contributions(self, records: Iterable[ContributionRecord]
                           ) -> tuple[list[FragmentContribution], dict[str, Rejection]]: ...

__all__ = ["ReplayChain", "Replayed", "replay_chain", "replay_master", "read_written_master", "read_written_momentum"]

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReplayChain:
    """What rebuilds fragment ``fragment`` at ``version``: the newest version at depth 1
    (``start``), the one before it (``before``) and the versions after ``start`` up to
    ``version``, oldest first."""

    fragment: int
    version: int
    start: FragmentState
    before: FragmentState
    rounds: tuple[int, ...]


def replay_chain(reader: ReplaySource, fragment: int, version: int) -> ReplayChain:
    """The chain that rebuilds ``version`` of ``fragment``; InvalidInput("corrupt") if the
    depths on the way do not count down by one to a version at depth 1."""
    st = reader.fragment_state(fragment, version)
    rounds: list[int] = []
    if st.master_written:
        return ReplayChain(fragment, version, st, st, ())
    for _ in range(reader.config.master_snapshot_every):
        if st.master_written:  # depth 1 (the count-down says so): its master and the one before it
            before = reader.fragment_state(fragment, _previous_version(reader, fragment, st.version))
            if before.master_written:
                return ReplayChain(fragment, version, st, before, tuple(reversed(rounds)))
            break
        rounds.append(st.version)
        below = reader.fragment_state(fragment, _previous_version(reader, fragment, st.version))
        if below.master_depth != st.master_depth - 1:
            break
        st = below
    raise InvalidInput("corrupt", f"fragment {fragment} v{version}: its master does not chain to a written pair "
                                  f"(master_depth counts down to {st.master_depth} at v{st.version})")


def read_written_master(reader: ReplaySource, fragment: int, st: FragmentState) -> Tensors:
    """The fp32 master object of a version that writes one."""
    return reader._read_fp32_blob(st.params, reader.manifest.fragment_shapes(fragment), f"fragment {fragment} v{st.version}")


def read_written_momentum(reader: ReplaySource, fragment: int, st: FragmentState) -> Tensors:
    """The outer momentum object of a version that writes one (empty buffers where it names none)."""
    if st.momentum is None:
        return {}
    shapes = {f"momentum.{n}": s for n, s in reader.manifest.fragment_shapes(fragment).items()}
    got = bytes_to_tensors(reader._read_blob_bytes(st.momentum))
    check_tensor_layout(got, shapes, what=f"fragment {fragment} momentum", dtype=torch.float32, allow_missing=True)
    return got


class Replayed(NamedTuple):
    """A rebuilt master: what :func:`replay_master` returns."""

    params: Tensors
    momentum: Tensors
    """The outer optimizer's state (empty at outer momentum 0)."""
    previous: tuple[int, Tensors] | None
    """(version, master) of the fragment's version before it, rebuilt or read on the way (the
    base a next round re-anchors against); None when nothing was replayed."""


def replay_master(reader: ReplaySource, fragment: int, version: int) -> Replayed:
    """Master and outer momentum state of ``fragment`` at ``version``, rebuilt by replay and
    checked against the sha256 each record names; a written version is simply read."""
    chain = replay_chain(reader, fragment, version)
    current = read_written_master(reader, fragment, chain.start)
    momentum = read_written_momentum(reader, fragment, chain.start)
    if not chain.rounds:
        return Replayed(current, momentum, None)
    before = read_written_master(reader, fragment, chain.before)
    config = reader.config
    policy = dataclasses.replace(MergePolicy.from_config(config, embedding_names=reader.plan.embedding_names),
                                 outlier_norm_ratio=None)  # the record already says who was in
    versions = (chain.before.version, chain.start.version)
    shapes = reader.manifest.fragment_shapes(fragment)
    workspace = MergeWorkspace()  # the synchronizer's passes (blocked on the CPU), not only its values
    for r in chain.rounds:
        record = reader.read_commit(r)
        if record is None:
            raise InvalidInput("corrupt", f"fragment {fragment}: round {r} of its replay is not committed")
        optimizer = NesterovOuterOptimizer(lr=config.outer_lr, momentum=config.outer_momentum)
        optimizer.load_state_dict(momentum)
        result = synchronize_fragment(current=current, bases={versions[1]: current, versions[0]: before},
                                      contributions=_merged(reader, record), optimizer=optimizer, policy=policy,
                                      workspace=workspace)
        if result is None or set(result.weights) != {a.key for a in record.accepted}:
            raise InvalidInput("corrupt", f"fragment {fragment} v{r}: the replay does not merge what its record lists")
        named = record.state[fragment].params.sha256
        if tensors_sha256({n: result.new_params[n] for n in shapes})[0] != named:  # as it would be written
            raise InvalidInput("corrupt", f"fragment {fragment} v{r}: the replayed master does not hash to the "
                                          f"sha256 its record names ({named[:12]}...): an input changed since, or "
                                          "this CPU family or torch version rounds differently from the "
                                          "synchronizer's (docs/protocol.md, Masters by replay)")
        before, current = current, {n: t.clone() for n, t in result.new_params.items()}
        momentum = {n: t.clone() for n, t in optimizer.state_dict().items()} if config.outer_momentum else {}
        versions = (versions[1], r)
    return Replayed(current, momentum, (versions[0], before))


def _merged(reader: ReplaySource, record: CommitRecord) -> list[FragmentContribution]:
    """The contributions ``record`` merged, loaded, with the counters it weighed them by, in the
    synchronizer's merge order."""
    records: list[ContributionRecord] = []
    for a in record.accepted:
        got = reader._read_contribution_record(a.key)  # checked as a listing checks it
        if isinstance(got, Rejection):
            raise InvalidInput("missing_payload", f"round {record.round} replay: contribution {a.key} does not "
                                                  f"read ({got.kind.value}: {got.detail})")
        records.append(got)
    loaded, bad = reader.load_contributions(records)
    if bad:
        key, why = next(iter(bad.items()))
        raise InvalidInput("missing_payload", f"round {record.round} replay: contribution {key} does not load "
                                              f"({why.kind.value}: {why.detail})")
    weighed = {a.key: Counters(c_steps=a.c_steps, c_tokens=a.c_tokens) for a in record.accepted}
    out = [dataclasses.replace(c, counters=weighed[c.key]) for c in loaded]
    out.sort(key=lambda c: (c.learner_id, c.key))
    return out


def _previous_version(reader: ReplaySource, fragment: int, version: int) -> int:
    """The version of ``fragment`` before ``version`` (0 for the first)."""
    if version <= 1:
        return 0
    record = reader.read_commit(version - 1)
    if record is None:
        raise InvalidInput("corrupt", f"round {version - 1} is not committed")
    return record.state[fragment].version
