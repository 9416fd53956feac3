"""Property-based: hostile objects of every record kind, and every reader of bucket objects run on
them, on a local folder and on moto's S3 server. No reader raises anything but a typed skip.

Hypothesis generates, for each record kind, either a valid record of that kind with one field
replaced by a hostile value (400-digit integers, ``1e400``, NaN spelled in the text, strings where
numbers belong, deep or huge nesting, negative numbers), or raw bytes (binary, truncated JSON,
another kind). Each is written where that kind lives (a learner's own prefix; a commit slot, past
or next; the synchronizer's liveness, stop and retention records; a checkpoint's config), then
every reader reads the run, each command among them: the synchronizer's listing, the fleet
watch and ``atoll stop`` (liveness), the learner's fetcher, ``atoll status``, goodput and the
plots' tracker, the round recorder's read, ``verify``, retention's plan (``atoll prune``), the
recipe every process loads first (``load_recipe``), a resume's checks and state read, and
``load_checkpoint``. Each must return (a :class:`Skipped`, a rejection, a problem line, a void
slot) or raise atoll's own typed error where it must refuse (``load_checkpoint`` on a bad
checkpoint; ``load_recipe`` on a sealed round 1 naming another run.json; ``prune`` on a
non-plain object among the synchronizer's own folders), never anything else. The object's
original bytes are put back after each example. Example counts are small: the suite runs on 2 cores.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hostile_helpers import HONEST, Backend, HostileRun
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll.runs.goodput import GoodputTracker
from atoll.runs.plots import plots_markdown, render_plots
from atoll.runs.report import check_run, run_status
from atoll.storage import SynchronizerStore, paths
from atoll.storage.codec import dump_record
from atoll.storage.integrity import IntegrityError, seal
from atoll.storage.retention import RetentionPolicy, RetentionRefused, plan_prune
from atoll.storage.store import NotPlainObjectError
from atoll.storage.validation import StorageError
from atoll.train.fetcher import Fetcher
from atoll.train.run import load_recipe

EXAMPLES = int(os.environ.get("ATOLL_HOSTILE_EXAMPLES", "5"))
"""Examples per record kind on a local folder (small: ``make test`` runs on 2 cores)."""
S3_EXAMPLES = int(os.environ.get("ATOLL_HOSTILE_S3_EXAMPLES", "1"))
"""Examples per record kind on moto's S3 (every reader's every read is an HTTP call: at 5 a kind
the S3 half took 17 minutes on 2 cores; the readers' code path is the same as on a local folder)."""

HUGE = int("9" * 400)

hostile_scalar = st.one_of(
    st.just(HUGE), st.just(-HUGE), st.just(2**63), st.just(-1), st.just(2**53 + 1),
    st.floats(allow_nan=False, allow_infinity=False), st.just(1e300), st.just(-0.0),
    st.text(max_size=20), st.just(""), st.none(), st.booleans(), st.just("NaN"),
    st.integers(min_value=-(2**70), max_value=2**70),
)
hostile_value = st.recursive(
    hostile_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
RAW = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"[]", b"null", b"1e400", b'{"schema":"atoll/commit"}', b"\xff\xfe{}",
                     ("[" * 5000 + "]" * 5000).encode(), b'{"a":' + b"9" * 5000 + b"}",
                     b'{"schema":"atoll/heartbeat","schema_version":3,"time":NaN}']),
)

KINDS = ("contribution", "commit-next", "commit-past", "commit-first", "heartbeat", "lease", "sync-heartbeat",
         "stop", "prune", "head", "learner-state", "checkpoint")
LEARNER_OWNED = frozenset({"contribution", "heartbeat", "lease", "learner-state"})
"""Kinds under a learner's own prefix: no command may refuse the run for them (they are skipped)."""


def _spell(text: bytes) -> bytes:
    """JSON spelling of numbers a writer of ours never produces: a huge float as 1e400, NaN."""
    return text.replace(b"9" * 400, b"1e400", 1) if b"9" * 400 in text and len(text) % 3 == 0 else text


class ReadersRun:
    """One run with committed rounds and a checkpoint, where each example plants one object."""

    def __init__(self, backend: Backend) -> None:
        self.run = HostileRun(backend)
        self.run.rounds(3)
        self.store = self.run.store
        sync = SynchronizerStore.beside(self.store)
        sync.write_checkpoint()
        self.evil_lease = self.store.take_learner_lease("evil")
        self.store.write_heartbeat(self.evil_lease)
        self.sync_lease = sync.take_synchronizer_lease()
        sync.write_heartbeat(self.sync_lease)
        sync.mark_stopped("x", "test")
        sync.clear_stopped()
        self.latest = self.run.sync.round

    def target(self, kind: str) -> tuple[str, dict[str, Any] | None, str]:
        """(key, a valid body to mutate or None, the record kind) for ``kind``."""
        s = self.store.store
        if kind == "contribution":
            key = self.run.contribution()
            return key, _body(s.get(key)), "atoll/contribution"
        keys = {
            "commit-next": paths.commit_key(self.latest + 1), "commit-past": paths.commit_key(2),
            "commit-first": paths.commit_key(1),
            "heartbeat": paths.learner_heartbeat_key("evil", 1), "lease": paths.learner_lease_key("evil", 1),
            "sync-heartbeat": paths.sync_heartbeat_key(1), "stop": paths.STOP, "prune": paths.PRUNE,
            "head": paths.HEAD, "learner-state": paths.learner_state_key("evil"),
            "checkpoint": paths.checkpoint_config_key(self.latest),
        }
        key = keys[kind]
        like = paths.commit_key(self.latest) if kind == "commit-next" else key
        data = s.get_or_none(like)
        schema = json.loads(data)["schema"] if data else {"learner-state": "atoll/learner-state",
                                                          "prune": "atoll/prune"}[kind]
        return key, _body(data) if data else None, schema


def _body(data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    body.pop("schema"), body.pop("schema_version")
    return dict(body)


def _hostile_bytes(draw: Any, body: dict[str, Any] | None, schema: str) -> bytes:
    if body is None or draw(st.integers(0, 3)) == 0:
        return bytes(draw(RAW))
    body = dict(body)
    field = draw(st.sampled_from(sorted(body) or ["x"]))
    body[field] = draw(hostile_value)
    resealed = seal(schema, body) if draw(st.booleans()) else body  # a rogue writer can reseal
    try:
        text = json.dumps({"schema": schema, "schema_version": 3, **resealed}, sort_keys=True).encode()
    except (ValueError, TypeError):
        text = dump_record(schema, {})
    return _spell(text)


@st.composite
def planted(draw: Any, readers: ReadersRun) -> tuple[str, str, bytes]:
    kind = draw(st.sampled_from(KINDS))
    key, body, schema = readers.target(kind)
    return kind, key, _hostile_bytes(draw, body, schema)


def read_everything(readers: ReadersRun, kind: str | None = None) -> None:
    """Every reader of bucket objects, each command among them, each on a fresh handle; none may
    raise but the typed refusals named in the module's docstring (none for a learner's object)."""
    run = readers.run
    try:
        load_recipe(run.reader(fresh=True))  # every process's first read
        check_run(run.reader(fresh=True))  # the supervisor's resume check
    except IntegrityError:
        assert kind == "commit-first", "only a sealed round 1 naming another run.json may refuse the recipe"
    fresh = run.reader(fresh=True)
    p, v = run.next_fragment()
    fresh.list_contributions(p, [v, max(0, v - 1)])  # the synchronizer's poll
    fresh.learners_liveness([*HONEST, "evil"])  # the fleet watch; atoll stop reads the same
    fresh.synchronizer_liveness()
    fresh.read_stop_marker()
    fresh.read_prune_record()
    latest = fresh.latest_round()
    fresh.poll_commits(0)
    fresh.history()
    for r in range(1, latest + 2):
        fresh.readable_commit(r)  # the round recorder
    fetcher = Fetcher(run.reader(fresh=True), 0, 0.01, versions=[0] * fresh.plan.num_fragments, log=lambda _: None)
    fetcher.poll_once()
    run_status(run.reader(fresh=True))  # atoll status
    tracker = GoodputTracker(run.reader(fresh=True))
    tracker.update()
    plots_markdown("run", tracker, {})  # atoll status --plot: what it reads (rendering is matplotlib's)
    run.reader(fresh=True).verify()
    try:
        plan_prune(run.reader(fresh=True), RetentionPolicy(keep_rounds=4, keep_checkpoints=1), now=time.time())
    except (RetentionRefused, NotPlainObjectError):
        # a typed refusal: retention never deletes what it cannot prove; one learner's object is skipped
        assert kind not in LEARNER_OWNED, f"prune refused the run for a learner's own object ({kind})"
    fresh.read_global_state()  # resume
    fresh.load_learner_state_record(HONEST[0])
    for r in run.reader(fresh=True).list_checkpoints():
        try:
            run.reader(fresh=True).load_checkpoint(r)
        except (StorageError, FileNotFoundError):
            pass  # typed: a checkpoint that does not verify is refused, never a raw error


@pytest.fixture(scope="module", params=["local", "s3"])
def readers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadersRun]:
    if request.param == "local":
        backend = Backend("local", str(tmp_path_factory.mktemp("readers") / "run"), {})
    else:
        import boto3

        endpoint = request.getfixturevalue("hostile_moto_endpoint")
        bucket = f"atoll-readers-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        backend = Backend("s3", f"s3://{bucket}/run", {
            "key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}})
    yield ReadersRun(backend)


@pytest.mark.timeout(900)  # every reader on each example object: minutes on moto under 2 busy cores
def test_no_reader_raises_on_any_hostile_object(readers: ReadersRun) -> None:
    per_kind = EXAMPLES if readers.store.store.is_local else S3_EXAMPLES

    @settings(max_examples=per_kind * len(KINDS), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        kind, key, hostile = data.draw(planted(readers))
        s = readers.store.store
        original = s.get_or_none(key)
        s.put(key, hostile)
        try:
            read_everything(readers, kind)
        finally:
            if original is None:
                s.delete(key)
            else:
                s.put(key, original)

    check()


def test_the_readers_run_reads_clean(readers: ReadersRun) -> None:
    """The control: with nothing planted, every reader sees the run as committed, and the plots render."""
    read_everything(readers)
    assert readers.run.reader(fresh=True).verify().ok
    tracker = GoodputTracker(readers.run.reader(fresh=True))
    tracker.update()
    assert render_plots(tracker)


@pytest.mark.parametrize("what", ["fifo", "folder", "link-out", "link-in"])
def test_no_reader_raises_on_a_non_regular_object(readers: ReadersRun, what: str, tmp_path: Any) -> None:
    """A FIFO, a folder, a link out of the run or to another object inside it, where each record
    kind belongs (local folders only: object stores have none of these)."""
    if readers.run.backend.name != "local":
        pytest.skip("a local-filesystem attack: object stores have no FIFOs, folders or links as objects")
    for kind in KINDS:
        key, _, _ = readers.target(kind)
        path = readers.run.backend.path(key)
        original = path.read_bytes() if path.exists() else None
        if path.exists():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        if what == "fifo":
            os.mkfifo(path)
        elif what == "folder":
            path.mkdir()
            (path / "x").write_bytes(b"{}")
        elif what == "link-out":
            (tmp_path / "outside.json").write_bytes(b"{}")
            os.symlink(tmp_path / "outside.json", path)
        else:
            os.symlink(readers.run.backend.path(paths.RUN_MANIFEST), path)
        try:
            read_everything(readers, kind)
        finally:
            if path.is_dir() and not path.is_symlink():
                (path / "x").unlink()
                path.rmdir()
            else:
                path.unlink()
            if original is not None:
                path.write_bytes(original)
