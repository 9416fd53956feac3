"""Public-key signatures, on a local folder and moto's S3 server: the synchronizer signs with its
Ed25519 key and pins the public half in run.json, each learner signs its contributions with its
own key, and every reader (a learner, the synchronizer, ``verify``, ``load_checkpoint``) verifies
with public keys only. A forger with write access and a key of its own gets nothing adopted,
obeyed or merged."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hostile_helpers import HONEST, Backend, Clock, HostileRun

from atoll.core.rejection import RejectionKind
from atoll.storage import LearnerStore, RunReader, SynchronizerStore, paths
from atoll.storage import liveness as lc
from atoll.storage.codec import dump_record, load_record, sha256_hex
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, IntegrityError, Keyring, seal
from atoll.storage.records import KIND_CHECKPOINT, KIND_COMMIT, KIND_RUN
from atoll.storage.signing import Ed25519Signer, new_private_key, run_context
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run, load_recipe
from atoll.train.synchronizer import Synchronizer

SYNC = new_private_key()
LEARNER_KEYS = {lid: new_private_key() for lid in HONEST}
FORGER = new_private_key()


class SignedRun(HostileRun):
    """A run signed with Ed25519 keys: the creator pins the synchronizer's and the learners' public
    keys; the synchronizer holds only its private key; each learner holds only its own."""

    def __init__(self, backend: Backend) -> None:  # noqa: D107 - replaces HostileRun's keying
        self.backend = backend
        config, recipe = smoke_recipe(len(HONEST), max_rounds=100_000)
        self.url = backend.url
        self.keys = {}
        creator = Keyring({SYNCHRONIZER_KEY_ID: SYNC, **{lid: k.public_key() for lid, k in LEARNER_KEYS.items()}})
        create_run(backend.open(keyring=creator), config.replace(initial_grace_s=0.0), recipe)
        self.store = backend.open(role=LearnerStore)  # a rogue writer's handle (no keys)
        self.learners = [RecipeLearner(self.learner_store(lid), lid, log=lambda _: None) for lid in HONEST]
        self.clock = Clock()
        self.sync = self.new_synchronizer()
        self._seen = {id(lr): 0 for lr in self.learners}

    def learner_store(self, lid: str, *, anchored: bool = False) -> LearnerStore:
        """Learner ``lid``'s handle: its own private key, and (``anchored``) the synchronizer's
        public key it was given out of band."""
        keys: dict[str, Any] = {lid: LEARNER_KEYS[lid]}
        if anchored:
            keys[SYNCHRONIZER_KEY_ID] = SYNC.public_key()
        return self.backend.open(keyring=Keyring(keys), role=LearnerStore)

    def new_synchronizer(self, *, fresh: bool = False) -> Synchronizer:
        return Synchronizer(self.backend.open(keyring=Keyring({SYNCHRONIZER_KEY_ID: SYNC}), fresh=fresh,
                                              role=SynchronizerStore), clock=self.clock)

    def forged(self, kind: str, body: dict[str, Any], key: Any = FORGER) -> bytes:
        """``body`` sealed and signed as ``kind`` by ``key`` (the forger's own Ed25519 key)."""
        run_id = self.store.manifest.run_id
        return dump_record(kind, seal(kind, body, Ed25519Signer(key, run_context(run_id))))

    def body(self, key: str, kind: str) -> dict[str, Any]:
        return load_record(self.store.store.get(key), kind)


@pytest.fixture
def signed(backend: Backend) -> SignedRun:
    run = SignedRun(backend)
    run.rounds(2)
    return run


def test_a_learner_holding_only_public_keys_verifies_everything(signed: SignedRun) -> None:
    """Every record the synchronizer writes carries an Ed25519 signature that a learner holding
    only its own private key verifies against the key run.json pins; the synchronizer, holding no
    learner key, merges contributions checked against the keys run.json pins for them."""
    merged = {a.learner_id for rec in signed.reader().history() for a in rec.accepted}
    assert merged == set(HONEST)
    for key in (paths.RUN_MANIFEST, paths.commit_key(1), paths.commit_key(2)):
        assert json.loads(signed.store.store.get(key))["signature"].startswith("ed25519:")
    sync = signed.backend.open(keyring=Keyring({SYNCHRONIZER_KEY_ID: SYNC}), role=SynchronizerStore)
    info = sync.write_checkpoint()
    sync.mark_stopped("done", by="operator")
    learner = signed.learner_store(HONEST[0])
    assert learner._verifier(SYNCHRONIZER_KEY_ID) is not None and learner.keyring.key(SYNCHRONIZER_KEY_ID) is None
    assert [r.round for r in learner.poll_commits(0)] == [1, 2]
    assert load_recipe(learner).learners
    assert learner.load_checkpoint(info.round)
    marker, why = learner.read_stop_marker()
    assert marker is not None and marker.stopped and why is None
    anchored = signed.learner_store(HONEST[1], anchored=True)
    assert anchored.latest_round() == 2 and anchored.stop_marker() is not None
    report = signed.reader().verify()  # no key at all: what run.json pins
    assert report.ok and report.verified == 2, report.problems
    # a synchronizer started with another private key refuses the run before it signs anything
    with pytest.raises(IntegrityError, match="pins another synchronizer key"):
        signed.backend.open(keyring=Keyring({SYNCHRONIZER_KEY_ID: FORGER}), role=SynchronizerStore).mark_stopped(
            "x", by="operator")


def test_a_learner_never_adopts_a_forged_commit(signed: SignedRun) -> None:
    """A commit for round 3, chained and sealed, signed with another Ed25519 key or an HMAC (a
    downgrade): the learner's handle finds the slot void; the synchronizer repairs the round and
    the learner adopts the repair."""
    body = signed.body(paths.commit_key(2), KIND_COMMIT)
    body.update(round=3, committed_by="forger", prev_sha256=sha256_hex(signed.commit_bytes(2)))
    for forged in (signed.forged(KIND_COMMIT, body),
                   dump_record(KIND_COMMIT, seal(KIND_COMMIT, body, b"h" * 32)),
                   dump_record(KIND_COMMIT, seal(KIND_COMMIT, body))):
        signed.put(paths.commit_key(3), forged)
        learner = signed.learner_store(HONEST[0])
        with pytest.raises(IntegrityError, match="signature does not verify|not signed"):
            learner.read_commit(3)
        assert learner.latest_round() == 2 and [r.round for r in learner.poll_commits(2)] == []
    signed.goes_on(2)
    learner = signed.learner_store(HONEST[0])
    assert learner.read_commit(3).committed_by == "synchronizer"
    assert learner.latest_round() >= 4


def test_a_learner_ignores_a_forged_stop_marker(signed: SignedRun) -> None:
    """stop.json written with another key, with an HMAC, with only a digest, or signed by the
    synchronizer for another run: a learner holding no synchronizer key ignores it with the reason
    (with HMAC it could not tell), and the run goes on."""
    stop = {"stopped": True, "reason": "forged", "by": "x", "time": time.time()}
    for forged in (signed.forged(lc.KIND_STOP, stop), dump_record(lc.KIND_STOP, seal(lc.KIND_STOP, stop, b"h" * 32)),
                   dump_record(lc.KIND_STOP, seal(lc.KIND_STOP, stop))):
        signed.put(paths.STOP, forged)
        marker, why = signed.learner_store(HONEST[0]).read_stop_marker()
        assert marker is None and why is not None and ("signature does not verify" in why or "not signed" in why), why
    signed.goes_on(1)
    # a marker the synchronizer signed for another run under the same key: not this run's
    other = SignedRun(Backend(signed.backend.name, signed.backend.root + "-b", signed.backend.storage_options))
    SynchronizerStore.open(other.url, other.backend.storage_options,
                           keyring=Keyring({SYNCHRONIZER_KEY_ID: SYNC})).mark_stopped("done", by="operator")
    signed.put(paths.STOP, other.store.store.get(paths.STOP))
    marker, why = signed.learner_store(HONEST[0]).read_stop_marker()
    assert marker is None and why is not None and "signature does not verify" in why, why
    assert other.learner_store(HONEST[0]).stop_marker() is not None


def test_a_forged_run_json_is_refused_before_round_1(backend: Backend) -> None:
    """Before any round links to it, run.json is checked by its signature alone: rewritten and
    re-signed with another key (pinning the real key, or the forger's, or none), a learner refuses
    it; load_recipe returns nothing of it."""
    run = SignedRun(backend)
    original = run.store.store.get(paths.RUN_MANIFEST)
    body = load_record(original, KIND_RUN)
    body["extra"]["recipe"]["model"] = "evil_module:build"
    pinned_forger = json.loads(json.dumps(body))
    pinned_forger["signing"]["synchronizer"] = FORGER.public_key().public_bytes_raw().hex()
    unsigned = {k: v for k, v in body.items() if k != "signing"}
    cases = [(run.forged(KIND_RUN, body), False), (run.forged(KIND_RUN, pinned_forger), True),
             (dump_record(KIND_RUN, seal(KIND_RUN, unsigned)), True)]
    for forged, needs_anchor in cases:
        run.put(paths.RUN_MANIFEST, forged)
        for anchored in (True,) if needs_anchor else (False, True):
            with pytest.raises(IntegrityError):
                load_recipe(run.learner_store(HONEST[0], anchored=anchored))
    run.put(paths.RUN_MANIFEST, original)
    assert load_recipe(run.learner_store(HONEST[0], anchored=True)).learners


def test_the_synchronizer_rejects_a_contribution_signed_by_another_learners_key(signed: SignedRun) -> None:
    """learner-1 writes a record as learner-0 signed with its own key, one as itself signed with
    learner-0's key (stolen), an unsigned one and an HMAC-signed one: each is a bad signature, and
    honest learners are still merged."""
    a, b = HONEST
    p, v = signed.next_fragment()
    run_id = signed.store.manifest.run_id
    keys = [
        signed.contribution(learner_id=a, sign_with=Ed25519Signer(LEARNER_KEYS[b], run_context(run_id)), fill=1.0),
        signed.contribution(learner_id=b, sign_with=Ed25519Signer(LEARNER_KEYS[a], run_context(run_id)), fill=2.0),
        signed.contribution(learner_id=b, fill=3.0),
        signed.contribution(learner_id=b, sign_with=b"h" * 32, fill=4.0),
    ]
    listing = signed.new_synchronizer().store.list_contributions(p, v)
    for key in keys:
        assert listing.rejected[key].kind is RejectionKind.BAD_SIGNATURE, listing.rejected.get(key)
    assert not set(keys) & {r.key for r in listing.records}
    signed.goes_on(2)


def test_verify_and_load_checkpoint_report_a_bad_signature(signed: SignedRun) -> None:
    """A forged commit signed with another key, and a checkpoint config re-signed with it: verify
    (holding no key) names the void slot and the bad signature; load_checkpoint refuses the config."""
    sync = signed.backend.open(keyring=Keyring({SYNCHRONIZER_KEY_ID: SYNC}), role=SynchronizerStore)
    info = sync.write_checkpoint()
    body = signed.body(paths.commit_key(2), KIND_COMMIT)
    body.update(committed_by="forger")
    signed.put(paths.commit_key(2), signed.forged(KIND_COMMIT, body))
    report = signed.reader(fresh=True).verify()
    assert not report.ok and 2 in report.void
    assert any("signature does not verify" in p for p in report.problems), report.problems
    cfg_key = paths.checkpoint_config_key(info.round)
    cfg = signed.body(cfg_key, KIND_CHECKPOINT)
    signed.put(cfg_key, signed.forged(KIND_CHECKPOINT, cfg))
    reader = RunReader.open(signed.url, signed.backend.storage_options, keyring=Keyring(), read_only=True)
    with pytest.raises(IntegrityError, match="signature does not verify"):
        reader.load_checkpoint(info.round)


def test_contributions_of_an_unregistered_learner_verify_with_the_synchronizers_own_entry(signed: SignedRun) -> None:
    """A learner the run was not created with (or one whose key was rotated) is verified with the
    public key in the synchronizer's own keyring; without that entry its records are bad signatures."""
    newcomer = new_private_key()
    p, v = signed.next_fragment()
    run_id = signed.store.manifest.run_id
    key = signed.contribution(learner_id="learner-9",
                              sign_with=Ed25519Signer(newcomer, run_context(run_id)))
    plain = signed.new_synchronizer().store.list_contributions(p, v)
    assert plain.rejected[key].kind is RejectionKind.BAD_SIGNATURE
    keyring = Keyring({SYNCHRONIZER_KEY_ID: SYNC, "learner-9": newcomer.public_key()})
    told = signed.backend.open(keyring=keyring, role=SynchronizerStore).list_contributions(p, v)
    assert key in {r.key for r in told.records}
