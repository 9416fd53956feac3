"""How a reader rebuilds what learners hold of a fragment version (its *view*) when the version
publishes only its compressed update: from the newest snapshot at or below it (a version that
publishes its fp32 view, or version 0) and the updates after it, in order (docs/protocol.md,
the downlink). :func:`view_chain` walks the state-table entries; :class:`ViewChain` is the plan
a reader follows (``RunReader.read_fragment_view``), retention keeps and ``atoll verify`` checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atoll.storage.records import BlobRef, FragmentState
from atoll.storage.validation import InvalidInput

__all__ = ["ViewChain", "view_chain", "MAX_CHAIN"]

MAX_CHAIN = 4096
"""Longest chain of updates a reader follows (``DilocoConfig.downlink_snapshot_every`` is far
below; a longer one is refused as ``schema``)."""


@dataclass(frozen=True)
class ViewChain:
    """The objects that rebuild ``view_version`` of ``fragment``: ``start`` (the fp32 view of
    ``snapshot``), then the update of each of ``updates`` in order (``view_v = view_base +
    decode(update_v)``)."""

    fragment: int
    version: int
    snapshot: int
    """The newest version at or below ``version`` whose view is published whole (0: ``run.json``)."""
    start: BlobRef
    """That view: the snapshot's ``downlink.view``, or its ``params`` where it publishes no
    downlink (version 0, an fp32 downlink)."""
    updates: tuple[tuple[int, BlobRef], ...] = ()
    """(version, its update), oldest first: the versions after the snapshot up to ``version``."""

    @property
    def nbytes(self) -> int:
        """Bytes a reader downloads to rebuild the view this way."""
        return self.start.nbytes + sum(ref.nbytes for _, ref in self.updates)

    @property
    def refs(self) -> list[BlobRef]:
        return [self.start] + [ref for _, ref in self.updates]


def view_chain(fragment: int, version: int, state_of: Callable[[int], FragmentState]) -> ViewChain:
    """The chain that rebuilds ``version`` of ``fragment``; ``state_of(v)`` is the state-table
    entry that published version ``v`` of the fragment (0: its initial entry). Each entry without a
    view must name its base, at depth one less, down to a snapshot: anything else is refused as
    InvalidInput (``schema``), so a reader never follows a chain that does not add up."""
    updates: list[tuple[int, BlobRef]] = []
    st = state_of(version)
    while st.downlink is not None and st.downlink.view is None:
        dl = st.downlink
        if dl.update is None or len(updates) >= MAX_CHAIN:  # from_body refuses the first already
            raise InvalidInput("schema", f"fragment {fragment} v{st.version}: no view and no usable chain")
        updates.append((st.version, dl.update))
        base = state_of(dl.base)
        depth = 0 if base.downlink is None else base.downlink.depth
        if base.version != dl.base or depth != dl.depth - 1:
            raise InvalidInput("schema", f"fragment {fragment} v{st.version} (depth {dl.depth}) chains to v{dl.base}, "
                                         f"whose depth is {depth}: the chain to its snapshot is broken")
        st = base
    start = st.params if st.downlink is None else st.downlink.view
    assert start is not None  # the loop ends at an entry with a view or without a downlink
    return ViewChain(fragment, version, st.version, start, tuple(reversed(updates)))
