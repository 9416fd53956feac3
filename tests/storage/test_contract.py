"""The storage contract: the same tests on memory://, a local folder, S3 (moto) and GCS (emulator)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from storage_helpers import (
    SHAPES,
    FsProxy,
    counters,
    fragment_delta,
    init_run,
    plant_contribution,
    tiny_config,
    tiny_params,
    tiny_plan,
)

from atoll.core import NesterovOuterOptimizer, synchronize_fragment
from atoll.core.compress import encode
from atoll.core.rejection import RejectionKind
from atoll.storage import (
    AcceptedContribution,
    InvalidInput,
    LearnerStore,
    RoundOrderError,
    RunCreator,
    RunExistsError,
    RunNotFoundError,
    SynchronizerStore,
    UnsafeStoreError,
    paths,
)
from atoll.storage.codec import dump_record, encoded_to_bytes, load_record
from atoll.storage.integrity import IntegrityError
from atoll.storage.records import KIND_COMMIT, CommitRecord

GCS_NO_CREATE_ONCE = (
    "gcp-storage-emulator ignores ifGenerationMatch=0 (a second create overwrites), so GCS "
    "create-once cannot be proven locally; real GCS honours it"
)


# --- round trips --------------------------------------------------------------------------------

def test_manifest_and_initial_fragments_round_trip(backend):
    url = backend.new_url()
    params = init_run(backend.open(url))
    reader = backend.open(url)
    m = reader.manifest
    assert m.run_id == "test-run"
    assert m.config == tiny_config()
    assert m.plan == tiny_plan()
    assert dict(m.shapes) == SHAPES
    assert reader.latest_round() == 0
    for p in range(2):
        got = reader.read_global_fragment(p, 0)
        assert set(got) == set(reader.plan.fragments[p])
        for n, t in got.items():
            assert t.dtype == torch.float32
            torch.testing.assert_close(t, params[n], rtol=0, atol=0)
    state = reader.read_global_state()
    assert state.round == 0 and state.versions == (0, 0) and state.record is None
    assert set(state.params) == set(SHAPES)


def test_init_twice_is_refused_and_missing_run_is_clear(backend):
    url = backend.new_url()
    rs = backend.open(url)
    with pytest.raises(RunNotFoundError, match="run.json"):
        _ = rs.manifest
    init_run(rs)
    with pytest.raises(RunExistsError, match="a run already exists at "):
        init_run(backend.open(url))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int4"])
def test_contribution_round_trip_every_codec(backend, codec):
    url = backend.new_url()
    learner = backend.open(url, role=LearnerStore)
    init_run(learner, compression=codec, compression_block_size=4)
    delta = fragment_delta(learner, 1, scale=0.5)
    rec = learner.publish_contribution("learner-a", 1, 0, counters(3, 96), delta, info={"pool": "gpu-a", "loss": 2.5})
    assert all(m["codec"] == codec for m in rec.tensors.values())

    sync = backend.open(url)
    listing = sync.list_contributions(1, 0)
    assert listing.rejected == {}
    assert [r.key for r in listing.records] == [rec.key]
    got = listing.records[0]
    assert (got.learner_id, got.fragment, got.base_version, got.c_steps, got.c_tokens) == ("learner-a", 1, 0, 3, 96)
    assert got.info == {"pool": "gpu-a", "loss": 2.5}
    contrib = sync.load_contribution(got)
    assert contrib.key == rec.key and contrib.base_version == 0
    assert contrib.counters.c_steps == 3 and contrib.counters.c_tokens == 96
    tol = {"fp32": 0.0, "bf16": 0.01, "int4": 0.5 / 7}[codec]
    for n, t in delta.items():
        assert contrib.delta[n].dtype == torch.float32
        torch.testing.assert_close(contrib.delta[n], t, rtol=0, atol=tol + 1e-7)


def test_pre_encoded_delta(backend):
    url = backend.new_url()
    rs = backend.open(url, role=LearnerStore)
    init_run(rs)  # run codec fp32; an int4-encoded delta carries its own codec info
    delta = fragment_delta(rs, 0)
    enc = {n: encode(t, "int4", block_size=8) for n, t in delta.items()}
    rec = rs.publish_contribution("l1", 0, 0, counters(), enc)
    (got,) = backend.open(url).list_contributions(0, 0).records
    assert got.tensors == rec.tensors and all(m["codec"] == "int4" for m in got.tensors.values())
    contrib = backend.open(url).load_contribution(got)
    for n, t in delta.items():
        torch.testing.assert_close(contrib.delta[n], t, rtol=0, atol=float(t.abs().max()) / 14 + 1e-7)


def test_republish_keeps_the_first_record(backend, request):
    if backend.name == "gcs":
        request.applymarker(pytest.mark.xfail(reason=GCS_NO_CREATE_ONCE, strict=True))
    url = backend.new_url()
    rs = backend.open(url, role=LearnerStore)
    init_run(rs)
    delta = fragment_delta(rs, 0)
    r1 = rs.publish_contribution("l1", 0, 0, counters(), delta)
    r2 = backend.open(url, role=LearnerStore).publish_contribution("l1", 0, 0, counters(), delta)  # same key
    assert r1.key == r2.key and r2.created_at == r1.created_at
    assert len(backend.open(url).list_contributions(0, 0).records) == 1


# --- create-once ----------------------------------------------------------------------------------

def _commit_args(rs, p: int, seed: int):
    cur = rs.read_global_fragment(p, 0)
    params = {n: t + seed for n, t in cur.items()}
    return dict(params=params, momentum={f"momentum.{n}": torch.full_like(t, float(seed)) for n, t in cur.items()})


def test_create_once_race_exactly_one_wins(backend, request):
    if backend.name == "gcs":
        request.applymarker(pytest.mark.xfail(reason=GCS_NO_CREATE_ONCE, strict=True))
    url = backend.new_url()
    init_run(backend.open(url))
    n = 4
    stores = [backend.open(url, fresh=True, role=SynchronizerStore) for _ in range(n)]
    args = [_commit_args(s, 0, i + 1) for i, s in enumerate(stores)]
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def go(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = stores[i].commit_round(1, 0, committed_by=f"sync-{i}", **args[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    winners = [r for r in results if r.won]
    assert len(winners) == 1, [r.record.committed_by for r in results]
    nonce = winners[0].record.nonce
    assert all(r.record.nonce == nonce for r in results), "losers must be told who won"
    # What is committed is the winner's state, for every reader.
    i = int(winners[0].record.committed_by.split("-")[1])
    state = backend.open(url).read_global_state()
    assert state.round == 1 and state.record.nonce == nonce
    for name, t in args[i]["params"].items():
        torch.testing.assert_close(state.params[name], t)


def test_second_commit_of_a_round_loses(backend, request, monkeypatch):
    if backend.name == "gcs":
        request.applymarker(pytest.mark.xfail(reason=GCS_NO_CREATE_ONCE, strict=True))
    url = backend.new_url()
    init_run(backend.open(url))
    a, b = backend.open(url, role=SynchronizerStore), backend.open(url, role=SynchronizerStore)
    args_a, args_b = _commit_args(a, 0, 1), _commit_args(b, 0, 2)
    assert a.commit_round(1, 0, committed_by="a", **args_a).won
    assert b.store.create(paths.commit_key(1), b"{}") is False
    # b looks for round 1 just before a's record lands (it sees nothing), writes its payloads, and
    # its create-once of the record is refused: it must lose and report a's record, not its own.
    real_get, looked = b.store.get_or_none, []

    def racing_get(key, **kwargs):
        if key == paths.commit_key(1) and not looked:
            looked.append(key)
            return None
        return real_get(key, **kwargs)

    monkeypatch.setattr(b.store, "get_or_none", racing_get)
    lost = b.commit_round(1, 0, committed_by="b", **args_b)
    assert looked and not lost.won and lost.record.committed_by == "a"
    assert backend.open(url, fresh=True).read_commit(1).committed_by == "a"


def test_capability_probe(backend):
    """Stores that honour create-once open; the GCS emulator (which does not) is refused by name."""
    url = backend.new_url()
    if backend.name == "gcs":
        with pytest.raises(UnsafeStoreError, match=r"gs://.*unsafe_allow_overwrite"):
            backend.open(url, unsafe_allow_overwrite=False)
        backend.open(url, unsafe_allow_overwrite=True)  # the documented opt-out
    else:
        backend.open(url, check_create_once=True)
    assert backend.open(url).store.list("_probe/") == []  # the probe cleans up


def test_rounds_commit_in_order(backend):
    url = backend.new_url()
    rs = backend.open(url, role=SynchronizerStore)
    init_run(rs)
    with pytest.raises(RoundOrderError, match="round 1 is not committed in "):
        rs.commit_round(2, 1, **_commit_args(rs, 1, 1))
    assert rs.latest_round() == 0


# --- polling --------------------------------------------------------------------------------------

def test_polling_sees_new_contributions_and_commits(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    sync = backend.open(url, fresh=True, role=SynchronizerStore)
    learner = backend.open(url, fresh=True, role=LearnerStore)
    assert sync.list_contributions(0, 0).records == []
    assert learner.latest_round() == 0 and learner.poll_commits(0) == []

    learner.publish_contribution("l1", 0, 0, counters(), fragment_delta(learner, 0))
    assert [r.learner_id for r in sync.list_contributions(0, 0).records] == ["l1"]
    learner.publish_contribution("l2", 0, 0, counters(), fragment_delta(learner, 0, seed=2))
    assert [r.learner_id for r in sync.list_contributions(0, 0).records] == ["l1", "l2"]

    contribs, rejected = sync.load_contributions(sync.list_contributions(0, 0).records)
    assert rejected == {}
    assert sync.commit_round(1, 0, **_commit_args(sync, 0, 1)).won
    assert [r.round for r in learner.poll_commits(0)] == [1]
    assert learner.latest_round() == 1
    assert learner.read_global_fragment(0).keys() == set(learner.plan.fragments[0])


def test_list_calls_per_poll_are_bounded(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    writer = backend.open(url, fresh=True, role=LearnerStore)
    proxies: list = []
    reader = backend.open(url, fresh=True, wrap=lambda fs: proxies.append(FsProxy(fs)) or proxies[-1])
    px = proxies[0]

    base_lists = px.lists
    assert reader.latest_round() == 0  # first call: at most one LIST of commits/ (no head hint yet)
    assert px.lists - base_lists <= 1
    for i in range(3):
        writer.publish_contribution(f"l{i}", 0, 0, counters(), fragment_delta(writer, 0, seed=i))
        before = px.lists
        # One poll of one base version: one LIST of learners/, then one per learner's prefix.
        listing = reader.list_contributions(0, 0)
        assert px.lists - before == 1 + (i + 1) and len(listing.records) == i + 1
        before = px.lists
        listing = reader.list_contributions(0, 0, learner_ids=[f"l{j}" for j in range(i + 1)])  # ids known
        assert px.lists - before == i + 1 and len(listing.records) == i + 1
    before = px.lists
    reader.list_contributions(0, [0, 1], learner_ids=["l0", "l1", "l2"])  # two base versions x 3 learners
    assert px.lists - before == 6
    assert SynchronizerStore.beside(writer).commit_round(1, 0, **_commit_args(writer, 0, 1)).won
    before = px.lists
    for _ in range(3):
        reader.latest_round()
        reader.poll_commits(reader.latest_round())
    assert px.lists == before, "polling for commits must GET the next key, not LIST"
    assert reader.latest_round() == 1

    # A fresh reader finds the latest round through head.json: no LIST at all.
    fresh_px: list = []
    fresh = backend.open(url, wrap=lambda fs: fresh_px.append(FsProxy(fs)) or fresh_px[-1])
    assert fresh.latest_round() == 1 and fresh_px[0].lists == 0


def test_a_capped_listing_is_one_request_and_leaves_no_partial_cache(backend):
    """``list(prefix, limit=n)``: the first n names in key order, one LIST request however many
    the prefix holds; a later lookup of a name it did not return, and a full listing, still see
    every object (a partial listing never answers from fsspec's cache)."""
    url = backend.new_url()
    init_run(backend.open(url))
    proxies: list = []
    rs = backend.open(url, fresh=True, wrap=lambda fs: proxies.append(FsProxy(fs)) or proxies[-1])
    store, px = rs.store, proxies[0]
    names = [f"n{i:03d}.json" for i in range(30)]
    for n in names:
        store.put(f"flood/{n}", n.encode())
    before = px.lists
    assert store.list("flood/", limit=10) == names[:10]
    assert px.lists - before == 1
    assert store.get("flood/n029.json") == b"n029.json"
    assert store.list("flood/") == names
    assert store.list("nothing-here/", limit=10) == []


# --- resume ---------------------------------------------------------------------------------------

def _run_rounds(backend, url, rounds: int):
    """A miniature synchronizer: two learners per round, real merge and Nesterov step."""
    rs = backend.open(url, role=SynchronizerStore)
    params = init_run(rs)
    learners = LearnerStore.beside(rs)
    P = rs.plan.num_fragments
    opts = {p: NesterovOuterOptimizer(lr=0.7, momentum=0.9) for p in range(P)}
    current = {p: rs.read_global_fragment(p, 0) for p in range(P)}
    bases = {p: {0: current[p]} for p in range(P)}
    for r in range(1, rounds + 1):
        p = (r - 1) % P
        version = rs.read_global_state().versions[p]
        for i, lid in enumerate(("l0", "l1")):
            learners.publish_contribution(lid, p, version, counters(2, 64 * (i + 1)),
                                          fragment_delta(rs, p, seed=10 * r + i))
        listing = rs.list_contributions(p, version)
        contribs, rejected = rs.load_contributions(listing.records)
        res = synchronize_fragment(current=current[p], bases=bases[p], contributions=contribs, optimizer=opts[p])
        accepted = [AcceptedContribution(key=c.key, learner_id=c.learner_id, weight=res.weights[c.key],
                                         base_version=c.base_version, c_steps=c.counters.c_steps,
                                         c_tokens=c.counters.c_tokens) for c in contribs]
        out = rs.commit_round(r, p, params=res.new_params, momentum=opts[p].state_dict(), accepted=accepted,
                              rejected={**res.rejected, **rejected}, timings={"step_s": 0.1 * r},
                              stats={"quorum_s": 0.5, "update_norm": res.update_norm})
        assert out.won
        current[p] = res.new_params
        bases[p][r] = res.new_params
    return rs, params, current, opts


def test_resume_reads_exactly_the_committed_state(backend):
    url = backend.new_url()
    rs, _, current, opts = _run_rounds(backend, url, rounds=3)
    # An uncommitted contribution must not change what resume reads.
    LearnerStore.beside(rs).publish_contribution("straggler", 0, 3, counters(), fragment_delta(rs, 0, scale=9.0))

    fresh = backend.open(url)
    assert fresh.latest_round() == 3
    state = fresh.read_global_state()
    assert state.round == 3 and state.versions == (3, 2)
    assert state.timings == {"step_s": pytest.approx(0.3)}
    for p in range(2):
        for n, t in current[p].items():
            torch.testing.assert_close(state.params[n], t, rtol=0, atol=0)
        restored = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
        restored.load_state_dict(state.momentum[p])
        for k, v in opts[p].state_dict().items():
            torch.testing.assert_close(restored.state_dict()[k], v, rtol=0, atol=0)
    hist = fresh.history()
    assert [h.round for h in hist] == [1, 2, 3] and [h.fragment for h in hist] == [0, 1, 0]
    assert all(len(h.accepted) == 2 and abs(sum(a.weight for a in h.accepted) - 1) < 1e-9 for h in hist)
    # Any earlier round's state (resume or fork): round 1 has fragment 0 at v1, fragment 1 initial.
    r1 = fresh.read_global_state(1)
    assert r1.versions == (1, 0) and r1.momentum[1] == {}
    torch.testing.assert_close(r1.params, {**fresh.read_global_fragment(0, 1), **fresh.read_global_fragment(1, 0)})
    with pytest.raises(ValueError, match="did not write fragment 1"):
        fresh.read_global_fragment(1, 1)


def test_learner_state_round_trip(backend):
    url = backend.new_url()
    rs = backend.open(url, role=LearnerStore)
    init_run(rs)
    assert rs.load_learner_state("l1") is None
    t = {"param.blk.0.w": torch.randn(4, 3), "adam.exp_avg.blk.0.w": torch.randn(4, 3),
         "step": torch.tensor([17], dtype=torch.int64)}
    rs.save_learner_state("l1", t, {"step": 17, "counters": [{"base_version": 0, "c_steps": 3, "c_tokens": 9}]})
    rs.save_learner_state("l1", {**t, "step": torch.tensor([18])}, {"step": 18})
    got = backend.open(url).load_learner_state("l1")
    assert got is not None and got.meta == {"step": 18}
    assert int(got.tensors["step"]) == 18
    torch.testing.assert_close(got.tensors["adam.exp_avg.blk.0.w"], t["adam.exp_avg.blk.0.w"])


# --- consolidated checkpoint ---------------------------------------------------------------------

def test_checkpoint_loads_with_plain_safetensors(backend, tmp_path):
    url = backend.new_url()
    rs, _, current, _ = _run_rounds(backend, url, rounds=2)
    assert rs.list_checkpoints() == []
    info = rs.write_checkpoint(2)
    assert info.round == 2
    assert rs.list_checkpoints() == [2]
    expected = {**current[0], **current[1]}
    torch.testing.assert_close(rs.load_checkpoint(2), expected, rtol=0, atol=0)

    local = tmp_path / "model.safetensors"
    local.write_bytes(backend.raw_get(url, paths.checkpoint_model_key(2)))
    cfg = backend.raw_get(url, paths.checkpoint_config_key(2))
    (tmp_path / "config.json").write_bytes(cfg)
    torch.save(expected, tmp_path / "expected.pt")
    script = (
        "import json, sys, torch\n"
        "from safetensors.torch import load_file\n"
        "t = load_file(sys.argv[1])\n"
        "e = torch.load(sys.argv[2])\n"
        "assert set(t) == set(e), (sorted(t), sorted(e))\n"
        "assert all(torch.equal(t[k], e[k]) for k in t)\n"
        "c = json.load(open(sys.argv[3]))\n"
        "assert c['round'] == 2 and c['config']['num_fragments'] == 2, c\n"
        "assert not any(m == 'atoll' or m.startswith('atoll.') for m in sys.modules), 'atoll was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(local), str(tmp_path / "expected.pt"), str(tmp_path / "config.json")],
        capture_output=True, text=True, timeout=90, cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- bad input ------------------------------------------------------------------------------------

@pytest.fixture
def committed(backend):
    """A run with one committed round; tests plant bad input and check it stays undisturbed."""
    url = backend.new_url()
    rs = backend.open(url, role=SynchronizerStore)
    init_run(rs)
    assert rs.commit_round(1, 0, **_commit_args(rs, 0, 1)).won
    before = rs.read_global_state()
    yield backend, url, rs
    after = backend.open(url).read_global_state()
    assert after.round == 1 and after.record.nonce == before.record.nonce
    torch.testing.assert_close(after.params, before.params, rtol=0, atol=0)


def _reject(rs, key: str, kind: str, match: str | None = None) -> InvalidInput:
    listing = rs.list_contributions(0, 0)
    (rec,) = [r for r in listing.records if r.key == key]
    with pytest.raises(InvalidInput, match=rf"^\[{kind}\] ") as ei:
        rs.load_contribution(rec)
    assert ei.value.kind == kind, str(ei.value)
    if match:
        assert match in str(ei.value)
    contribs, rejected = rs.load_contributions(listing.records)
    assert key in rejected and key not in {c.key for c in contribs}
    return ei.value


def test_bad_truncated_payload(committed):
    backend, url, rs = committed
    rec = LearnerStore.beside(rs).publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    blob = paths.blob_key(rec.payload.sha256, rec.learner_id)
    backend.raw_put(url, blob, backend.raw_get(url, blob)[:-7])
    err = _reject(backend.open(url), rec.key, "truncated")
    assert url.rstrip("/").split("://")[-1] in err.url


def test_bad_checksum(committed):
    backend, url, rs = committed
    rec = LearnerStore.beside(rs).publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    blob = paths.blob_key(rec.payload.sha256, rec.learner_id)
    data = bytearray(backend.raw_get(url, blob))
    data[-1] ^= 0xFF
    backend.raw_put(url, blob, bytes(data))
    _reject(backend.open(url), rec.key, "checksum", "sha256")


def test_bad_corrupt_safetensors(committed):
    backend, url, rs = committed
    meta = {n: {"codec": "fp32", "shape": list(SHAPES[n])} for n in rs.plan.fragments[0]}
    key = plant_contribution(backend, url, fragment=0, payload=b"\x07" * 40, meta=meta)
    _reject(backend.open(url), key, "corrupt")


@pytest.mark.parametrize("what", ["missing_name", "extra_name", "shape", "declared_shape", "dtype"])
def test_bad_layout(committed, what):
    backend, url, rs = committed
    names = rs.plan.fragments[0]
    good = {n: torch.zeros(SHAPES[n]) for n in names}
    meta = None
    payload = None
    if what == "missing_name":
        tensors = dict(list(good.items())[1:])
    elif what == "extra_name":
        tensors = {**good, "not.a.param": torch.zeros(2)}
    elif what == "shape":
        n0 = names[0]
        tensors = {**good, n0: torch.zeros(SHAPES[n0][0] + 1, *SHAPES[n0][1:])}
    elif what == "declared_shape":
        tensors = good
        _, meta = encoded_to_bytes({n: encode(t) for n, t in good.items()})
        meta[names[0]]["shape"] = [1, 2, 3]
    else:  # float64 data where fp32 is declared
        from atoll.storage.codec import tensors_to_bytes
        payload = tensors_to_bytes({f"{n}::data": t.double() for n, t in good.items()})
        _, meta = encoded_to_bytes({n: encode(t) for n, t in good.items()})
        tensors = None
    key = plant_contribution(backend, url, fragment=0, tensors=tensors, payload=payload, meta=meta)
    _reject(backend.open(url), key, "layout")


def test_bad_non_finite(committed):
    backend, url, rs = committed
    delta = fragment_delta(rs, 0)
    n0 = next(iter(delta))
    bad = {**delta, n0: delta[n0].clone().index_fill_(0, torch.tensor([0]), float("nan"))}
    with pytest.raises(InvalidInput, match=rf"^\[non_finite\] delta '{n0}': ") as ei:
        LearnerStore.beside(rs).publish_contribution("l1", 0, 0, counters(), bad)
    assert ei.value.kind == "non_finite"
    from atoll.storage.codec import tensors_to_bytes
    payload = tensors_to_bytes({f"{n}::data": t for n, t in {**delta, n0: torch.full_like(delta[n0], float("inf"))}.items()})
    _, meta = encoded_to_bytes({n: encode(t) for n, t in delta.items()})
    key = plant_contribution(backend, url, fragment=0, payload=payload, meta=meta)
    _reject(backend.open(url), key, "non_finite")
    with pytest.raises(InvalidInput, match=r"^\[non_finite\] round 2 params") as ei:
        rs.commit_round(2, 1, params={n: torch.full(SHAPES[n], float("nan")) for n in rs.plan.fragments[1]})
    assert ei.value.kind == "non_finite"


def test_bad_unknown_schema_version(committed):
    backend, url, rs = committed
    key = plant_contribution(backend, url, fragment=0, tensors=fragment_delta(rs, 0), schema_version=99)
    listing = backend.open(url).list_contributions(0, 0)
    assert key in listing.rejected and listing.rejected[key].kind is RejectionKind.SCHEMA
    assert "schema_version 99" in listing.rejected[key].detail
    assert key not in {r.key for r in listing.records}
    # A commit record of an unknown version is refused too, with the reason: its slot is void.
    data = backend.raw_get(url, paths.commit_key(1)).replace(b'"schema_version":3', b'"schema_version":4')
    backend.raw_put(url, "sync/commits/00000099.json", data)
    with pytest.raises(IntegrityError, match="unknown schema_version 4"):
        backend.open(url).read_commit(99)
    fs, root = backend.fs_and_root(url)
    fs.rm_file(f"{root}/sync/commits/00000099.json")


def test_schema_1_commit_records_stay_readable(committed):
    """Schema 1 stored rejections as bare text; they parse back typed ('late:' text stays LATE).
    (A layout-1 run cannot be continued, but its records still parse, e.g. for inspection.)"""
    backend, url, rs = committed
    record = rs.read_commit(1)
    body = record.to_dict()
    body["rejected"] = {"contributions/f0000/b00000000/x.json": "late: arrived 0.50s after the grace window closed",
                        "contributions/f0000/b00000000/y.json": "outlier: norm 9 > 5 x median 1"}
    data = dump_record(KIND_COMMIT, body).replace(b'"schema_version":3', b'"schema_version":1')
    old = CommitRecord.from_body(load_record(data, KIND_COMMIT), rs.plan.num_fragments)
    late = old.rejected["contributions/f0000/b00000000/x.json"]
    assert late.kind is RejectionKind.LATE and not late.final and late.detail.startswith("arrived 0.50s")
    other = old.rejected["contributions/f0000/b00000000/y.json"]
    assert other.kind is RejectionKind.UNSPECIFIED and other.final and other.detail.startswith("outlier")


def test_bad_missing_payload(committed):
    backend, url, rs = committed
    key = plant_contribution(backend, url, fragment=0, tensors=fragment_delta(rs, 0), write_payload=False)
    _reject(backend.open(url), key, "missing_payload")


BAD_IDS = ["../escape", "a/b", "a\\b", "..", "x..y", "", "white space", "ünïcode", "a" * 129, "-lead", "a\nb"]


def test_bad_ids(committed):
    backend, url, rs = committed
    for bad_id in BAD_IDS:
        with pytest.raises(InvalidInput, match=r"^\[bad_id\] learner id ") as ei:
            LearnerStore.beside(rs).publish_contribution(bad_id, 0, 0, counters(), fragment_delta(rs, 0))
        assert ei.value.kind == "bad_id", bad_id
        with pytest.raises(InvalidInput, match=r"^\[bad_id\] learner id ") as ei:
            LearnerStore.beside(rs).save_learner_state(bad_id, {"x": torch.zeros(1)})
        assert ei.value.kind == "bad_id", bad_id
        with pytest.raises(InvalidInput, match=r"^\[bad_id\] run id ") as ei:
            paths.run_url(backend.base_url, bad_id)
        assert ei.value.kind == "bad_id", bad_id
        with pytest.raises(InvalidInput, match=r"^\[bad_id\] learner id ") as ei:
            rs.load_learner_state(bad_id)
        assert ei.value.kind == "bad_id", bad_id
    with pytest.raises(InvalidInput, match=r"^\[bad_id\] run id '\.\./up' contains a path separator") as ei:
        backend.open(backend.new_url(), role=RunCreator).init_run(tiny_config(), tiny_plan(), tiny_params(),
                                                                  run_id="../up")
    assert ei.value.kind == "bad_id"
    assert rs.list_contributions(0, 0).records == []


def test_bad_planted_learner_id_in_record(committed):
    backend, url, rs = committed
    key = plant_contribution(backend, url, fragment=0, tensors=fragment_delta(rs, 0), learner_id="ok-id")
    data = backend.raw_get(url, key).replace(b'"learner_id":"ok-id"', b'"learner_id":"../../commits"')
    backend.raw_put(url, key, data)
    listing = backend.open(url).list_contributions(0, 0)
    assert listing.rejected[key].kind is RejectionKind.BAD_ID


def test_bad_oversize(committed):
    backend, url, rs = committed
    small = backend.open(url, max_payload_bytes=200, role=LearnerStore)
    with pytest.raises(InvalidInput, match=r"^\[oversize\] delta payload is \d+ bytes, cap is 200$") as ei:
        small.publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    assert ei.value.kind == "oversize"
    rec = LearnerStore.beside(rs).publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    _reject(small, rec.key, "oversize")
    # A record that lies about the size is caught by the capped read.
    from atoll.storage.codec import tensors_to_bytes
    big = tensors_to_bytes({"blk.0.w::data": torch.zeros(400)})
    key = plant_contribution(backend, url, fragment=0, payload=big, nbytes=100,
                             meta={n: {"codec": "fp32", "shape": list(SHAPES[n])} for n in rs.plan.fragments[0]},
                             learner_id="liar")
    listing = small.list_contributions(0, 0)
    (r,) = [x for x in listing.records if x.key == key]
    with pytest.raises(InvalidInput, match=r"^\[oversize\] payload is larger than the cap of 200 bytes") as ei:
        small.load_contribution(r)
    assert ei.value.kind == "oversize"
