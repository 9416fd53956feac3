"""``atoll status`` and ``atoll resume`` on hostile run folders: they only read,
and every broken folder is one line on stderr, ``atoll: error: ...``, exit status 2: never a
traceback, never a hang.

One small real run (smoke recipe, a few committed rounds) is built once; each test breaks its own
copy. Most go through ``atoll.cli.main``; the FIFO cases (a hang must fail the test, not the suite)
and one plain case run ``python -m atoll.cli`` in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atoll import cli
from atoll.runs.render import history_table, round_markdown
from atoll.storage import LearnerStore, RunReader, SynchronizerStore, paths
from atoll.storage.records import CommitRecord
from atoll.storage.store import NotRegularFileError, ObjectStore
from atoll.train import synchronizer as sync_mod
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer

SUBPROCESS_TIMEOUT_S = 90

ODD_STATS = {"quorum_s": "abc", "grace_s": [1, 2], "wait_s": {"x": 1}, "val_loss": "nan?", "tokens": "lots",
             "bytes_in": 10**30, "bytes_out_per_learner": True, "reason": "x\ny" * 3}


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _build(root: Path, rounds: int = 4) -> str:
    config, recipe = smoke_recipe(2, max_rounds=1000)
    store = create_run(str(root), config.replace(initial_grace_s=0.0), recipe)
    learners = [RecipeLearner(LearnerStore.beside(store), s.learner_id, log=lambda _: None) for s in recipe.learners]
    clock = _Clock()
    sync = Synchronizer(SynchronizerStore.open(store.url), clock=clock)
    seen = 0
    done = 0
    while done < rounds:
        for lr in learners:
            lr.step()
        clock.t += 1.0
        while isinstance(sync.tick(), RoundSummary):
            done += 1
            for rec in store.poll_commits(seen):
                seen = rec.round
                for lr in learners:
                    if rec.updated:
                        lr.adopt(rec.round, rec.fragment, store.read_global_fragment(rec.fragment, rec.round))
    store.write_checkpoint(sync.round)
    return store.url


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "run"
    _build(root)
    return root


@pytest.fixture
def run_dir(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(pristine, dst, symlinks=True)
    return dst


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("atoll: error: ") and "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def _cli_subprocess(*args: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("ATOLL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "atoll.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture
def no_prefect_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`atoll resume` with the launcher replaced (no Prefect): records what it would launch."""
    launched: list[Any] = []
    fake = types.ModuleType("atoll.ops.client")
    fake.launch_training = lambda options, **kw: launched.append(options) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "atoll.ops.client", fake)
    return launched


@pytest.fixture
def writes_refused(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A read-only bucket (tests run as root, so chmod cannot say no): every write raises
    PermissionError and is recorded."""
    attempts: list[str] = []

    def refuse(name: str) -> Any:
        def write(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> Any:
            attempts.append(f"{name} {key}")
            raise PermissionError(13, "Permission denied (read-only bucket)", self.key_url(key))
        return write

    for name in ("put", "create", "delete"):
        monkeypatch.setattr(ObjectStore, name, refuse(name))
    return attempts


# -- a healthy run, for reference ----------------------------------------------------------------


def test_status_of_a_healthy_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(["status", str(run_dir)], capsys)
    assert rc == 0, err
    assert "rounds committed" in out and "checkpoints at rounds: 4" in out


# -- a read-only run folder -----------------------------------------------------------------------


def test_status_of_a_read_only_run_writes_nothing(run_dir: Path, writes_refused: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(["status", str(run_dir)], capsys)
    assert rc == 0, err
    assert writes_refused == []  # not even the create-once probe
    assert "4 of 1000 rounds committed" in out


def test_resume_opens_a_read_only_source_without_writing(run_dir: Path, writes_refused: list[str],
                                                         no_prefect_launch: list[Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _main(["resume", str(run_dir)], capsys)
    assert rc == 0, err
    assert writes_refused == [] and len(no_prefect_launch) == 1


def test_a_write_through_a_read_only_bucket_is_one_line(run_dir: Path, writes_refused: list[str],
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a command to write (here: status forced through the write probe), the refusal is a
    one-line error, not a traceback."""
    writable = RunReader.open
    monkeypatch.setattr(RunReader, "open", staticmethod(lambda url, opts=None, read_only=False: writable(url, opts)))
    rc, _, err = _main(["status", str(run_dir)], capsys)
    _assert_one_line_error(rc, err, "PermissionError", "read-only bucket")
    assert writes_refused  # the probe was attempted, and refused


# -- odd values and names -----------------------------------------------------------------------


def test_non_numeric_stats_are_shown_as_dashes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Stats are free-form JSON for people: a synchronizer (or anything that writes commits) can
    put any JSON there; status prints what it can."""
    real = sync_mod.round_stats
    monkeypatch.setattr(sync_mod, "round_stats", lambda *a, **kw: {**real(*a, **kw), **ODD_STATS})
    _build(tmp_path / "run", rounds=2)
    monkeypatch.undo()
    rc, out, err = _main(["status", str(tmp_path / "run")], capsys)
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert row.split()[4:8] == ["-", "-", "-", "-"], row


@pytest.mark.parametrize("value", ["abc", None, [1], {"a": 1}, True, 10**400, -(10**30), 1e308, float("inf")])
def test_stats_formatting_takes_any_json(value: Any) -> None:
    stats = {k: value for k in ("quorum_s", "grace_s", "wait_s", "val_loss", "tokens", "bytes_in",
                                "bytes_out_per_learner", "reason")}
    record = CommitRecord(round=1, fragment=0, updated=False, state=(), accepted=(), rejected={}, timings={},
                          stats=stats, committed_by="s", nonce="n", created_at=0.0)
    assert len(history_table([record])) == 2
    assert "# Round 1" in round_markdown(record, [], run_id="r", run_url="u", max_rounds=None)


def test_odd_checkpoint_folder_names_are_ignored(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for prefix in {paths.checkpoints_prefix(), "checkpoints/", "sync/checkpoints/"}:
        for name in ("abc", "\u00b2", "12x", "9" * 40, "-1", ".hidden"):
            (run_dir / prefix / name).mkdir(parents=True, exist_ok=True)
        (run_dir / prefix / "file-not-folder").write_text("x")
    rc, out, err = _main(["status", str(run_dir)], capsys)
    assert rc == 0, err
    assert "checkpoints at rounds: 4" in out


# -- missing or garbage runs ----------------------------------------------------------------------


def test_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_prefect_launch: list[Any]) -> None:
    for cmd in ("status", "resume"):
        rc, _, err = _main([cmd, str(tmp_path / "nope")], capsys)
        _assert_one_line_error(rc, err, "no run at", "nope")
    assert no_prefect_launch == []
    assert not (tmp_path / "nope").exists()  # looking did not create it


@pytest.mark.parametrize("garbage", [b"\x00\xffgarbage", b"[1, 2]", b'{"schema": "atoll.run", "schema_version": 99}',
                                     b'{"schema": "atoll.run"' + b" " * 10, b""])
def test_garbage_run_json(run_dir: Path, garbage: bytes, capsys: pytest.CaptureFixture[str],
                          no_prefect_launch: list[Any]) -> None:
    (run_dir / "run.json").write_bytes(garbage)
    for cmd in ("status", "resume"):
        rc, _, err = _main([cmd, str(run_dir)], capsys)
        _assert_one_line_error(rc, err)
    assert no_prefect_launch == []


def test_garbage_commit_record(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A garbage past commit record is a void slot: status skips it and shows the other rounds."""
    (run_dir / paths.commit_key(2)).write_bytes(b"{not json\n\n at all")
    rc, out, err = _main(["status", str(run_dir)], capsys)
    assert rc == 0, err
    assert "4 of" in out


def test_a_directory_named_run_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "run.json").unlink()
    (run_dir / "run.json").mkdir()
    rc, _, err = _main(["status", str(run_dir)], capsys)
    _assert_one_line_error(rc, err, "a directory")


def test_a_symlink_out_of_the_run_folder(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((run_dir / "run.json").read_bytes())  # even a valid record is not read
    (run_dir / "run.json").unlink()
    (run_dir / "run.json").symlink_to(outside)
    rc, _, err = _main(["status", str(run_dir)], capsys)
    _assert_one_line_error(rc, err, "symlink", "outside the run folder")


def test_a_symlink_inside_the_run_folder_is_followed(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "run.json").rename(run_dir / "run.copy.json")
    (run_dir / "run.json").symlink_to(run_dir / "run.copy.json")
    rc, _, err = _main(["status", str(run_dir)], capsys)
    assert rc == 0, err


def test_a_huge_error_is_cut_to_one_short_line(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.storage.validation import InvalidInput

    def boom(args: Any) -> int:
        raise InvalidInput("bad_id", "x\n" * 100_000)

    monkeypatch.setattr(cli.run_bucket, "_status", boom)
    rc, _, err = _main(["status", "anything"], capsys)
    _assert_one_line_error(rc, err)
    assert len(err) <= cli.MAX_ERROR_CHARS + 40


def test_debug_keeps_the_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        cli.main(["--debug", "status", str(tmp_path / "nope")])
    monkeypatch.setenv("ATOLL_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["status", str(tmp_path / "nope")])


def test_bad_storage_option_is_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _main(["status", str(run_dir), "--storage-option", "novalue"], capsys)
    _assert_one_line_error(rc, err, "KEY=VALUE")


# -- FIFOs: must not hang (subprocesses with a timeout) -------------------------------------------


@pytest.fixture
def fifo_run(run_dir: Path) -> Iterator[Path]:
    (run_dir / "run.json").unlink()
    os.mkfifo(run_dir / "run.json")
    yield run_dir


def test_fifo_named_run_json_does_not_hang_status(fifo_run: Path) -> None:
    done = _cli_subprocess("status", str(fifo_run))
    _assert_one_line_error(done.returncode, done.stderr, "FIFO")
    assert done.stdout == ""


def test_fifo_named_run_json_does_not_hang_resume(fifo_run: Path) -> None:
    done = _cli_subprocess("resume", str(fifo_run), "--in-process")
    _assert_one_line_error(done.returncode, done.stderr, "FIFO")


def test_fifo_as_a_commit_record(run_dir: Path) -> None:
    """A FIFO in a past commit slot is a void slot: status skips it (never opens it) and shows the rest."""
    (run_dir / paths.commit_key(3)).unlink()
    os.mkfifo(run_dir / paths.commit_key(3))
    done = _cli_subprocess("status", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "4 of" in done.stdout and "Traceback" not in done.stderr


def test_missing_run_through_a_real_process(tmp_path: Path) -> None:
    done = _cli_subprocess("status", str(tmp_path / "nope"))
    _assert_one_line_error(done.returncode, done.stderr, "no run at")


def test_store_refuses_a_fifo_before_opening_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    store = ObjectStore.open(str(tmp_path))
    with pytest.raises(NotRegularFileError, match="FIFO"):
        store.get("pipe")
    with pytest.raises(NotRegularFileError, match="FIFO"):
        store.get_or_none("pipe", max_bytes=10)
    assert store.get_or_none("absent") is None


def test_round_markdown_keeps_its_contributions_table_parseable() -> None:
    """A reason with a pipe or a newline (a hostile learner's text ends up in a rejection reason)
    cannot add a column or a row to the round's contributions table."""
    from atoll.runs.contributions import ContributionRow
    from atoll.runs.render import contributions_from_markdown

    record = CommitRecord(round=3, fragment=1, updated=True, state=(), accepted=(), rejected={}, timings={},
                          stats={}, committed_by="s", nonce="n", created_at=0.0)
    rows = [ContributionRow("learner-0", "cpu-fast", 1024, 8, 0.75, "accepted"),
            ContributionRow("learner-1", "", 0, 0, 0.0, "bad payload | x\n| injected | row |")]
    md = round_markdown(record, rows, run_id="r", run_url="u", max_rounds=None)
    table = md[md.index("## Contributions"):].split("\n\n")[1].splitlines()
    assert table[0] == "| learner | pool | tokens | steps | weight | status |"
    assert [list(r.values()) for r in contributions_from_markdown(md)] == [
        ["learner-0", "cpu-fast", "1,024", "8", "0.75", "accepted"],
        ["learner-1", "-", "0", "0", "0.0", "bad payload / x / injected / row /"]]
    assert contributions_from_markdown(round_markdown(record, [], run_id="r", run_url="u", max_rounds=None)) == []
