"""A round that commits with nothing merged (``updated=False``), on every backend.

Such a round happens when every contribution the quorum let in is then refused (non-finite,
wrong layout, unknown base ...). It is still a committed round: it advances the round counter and
records its rejections, but writes no tensors and leaves every fragment's version, value and
outer-optimizer momentum exactly where the previous round left them.
"""

from __future__ import annotations

import pytest
import torch
from storage_helpers import init_run

from atoll.core.rejection import Rejection, RejectionKind
from atoll.storage import SynchronizerStore, paths

BLOBS = paths.blob_key("0" * 64).rsplit("/", 1)[0]  # blobs/sha256
from atoll.storage.records import AcceptedContribution


def test_a_round_with_nothing_merged_writes_no_tensors_and_keeps_the_state(backend) -> None:
    url = backend.new_url()
    rs = backend.open(url, role=SynchronizerStore)
    init_run(rs)
    frag0 = rs.read_global_fragment(0, 0)
    new0 = {n: t + 1 for n, t in frag0.items()}
    momentum0 = {f"momentum.{n}": torch.full_like(t, 0.5) for n, t in frag0.items()}
    r1 = rs.commit_round(1, 0, params=new0, momentum=momentum0,
                         accepted=[AcceptedContribution("k1", "l1", 1.0, 0, 2, 64)])
    assert r1.won and r1.record.updated and r1.record.versions == (1, 0)
    blobs = set(rs.store.list(BLOBS))

    refused = {"contributions/f1/b0/l2.s2.x.json": Rejection(RejectionKind.NON_FINITE, "outer gradient has NaN")}
    r2 = rs.commit_round(2, 1, params=None, rejected=refused, timings={"decay": 0.9, "sync_s": 0.25},
                         stats={"reason": "nothing mergeable"})
    r3 = rs.commit_round(3, 0, params=None, momentum={k: t + 1 for k, t in momentum0.items()})
    for res in (r2, r3):
        assert res.won and not res.record.updated and res.record.accepted == ()
        assert res.record.state == r1.record.state  # the very same payloads, versions and momentum
    assert set(rs.store.list(BLOBS)) == blobs  # not a byte of tensors written
    assert r2.record.rejected == refused

    reader = backend.open(url, fresh=True)  # another process: nothing cached
    assert reader.latest_round() == 3
    assert [(r.round, r.updated) for r in reader.poll_commits(0)] == [(1, True), (2, False), (3, False)]
    state = reader.read_global_state()
    assert state.round == 3 and state.versions == (1, 0)
    assert state.record is not None and state.record.round == 3 and not state.record.updated
    after_r1 = reader.read_global_state(1)
    for name in state.params:
        assert torch.equal(state.params[name], after_r1.params[name])
    for name, t in new0.items():
        assert torch.equal(state.params[name], t)
    assert state.momentum[0].keys() == momentum0.keys()
    for k, t in momentum0.items():  # the momentum passed with params=None was not taken
        assert torch.equal(state.momentum[0][k], t)
    assert state.momentum[1] == {}
    assert reader.read_global_state(2).timings == {"decay": 0.9, "sync_s": 0.25}

    # A fragment's version names the round that wrote it; an empty round wrote none.
    for p in (0, 1):
        latest = reader.read_global_fragment(p)
        assert all(torch.equal(latest[n], state.params[n]) for n in latest)
    with pytest.raises(ValueError, match=r"round 2 did not write fragment 1 \(it holds version 0\)"):
        reader.read_global_fragment(1, 2)
    with pytest.raises(ValueError, match=r"round 3 did not write fragment 0 \(it holds version 1\)"):
        reader.read_global_fragment(0, 3)
