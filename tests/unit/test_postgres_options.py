"""The stack's database options without a database: URL handling, finding the server binaries and the
error when there are none (the real cluster runs in tests/integration/test_postgres.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from atoll.cli import main
from atoll.ops.postgres import PostgresError, PostgresNotFound, find_postgres_bin, normalize_database_url, run_as_user
from atoll.ops.stack import LocalStack


@pytest.mark.parametrize("url", ["postgresql://u:p@h:5432/d", "postgres://u:p@h:5432/d",
                                 "postgresql+asyncpg://u:p@h:5432/d", "POSTGRESQL://u:p@h:5432/d"])
def test_postgres_urls_get_the_async_driver(url: str) -> None:
    assert normalize_database_url(url) == "postgresql+asyncpg://u:p@h:5432/d"


@pytest.mark.parametrize("url", ["postgresql+psycopg2://u@h/d", "mysql://u@h/d", "not a url"])
def test_urls_prefect_cannot_use_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="database-url"):
        normalize_database_url(url)


def test_a_given_url_wins_and_means_postgres() -> None:
    stack = LocalStack(database_url="postgresql://u:p@db:5432/prefect")
    assert stack.database == "postgres"
    assert stack.start_database() == "postgresql+asyncpg://u:p@db:5432/prefect"
    assert stack.postgres is None  # nothing of ours to start or stop


def test_unknown_database_is_refused() -> None:
    with pytest.raises(ValueError, match="sqlite.*postgres"):
        LocalStack(database="mysql")


def test_no_binaries_is_a_clear_error_naming_the_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOLL_POSTGRES_BIN", str(tmp_path))
    with pytest.raises(PostgresNotFound, match="ATOLL_POSTGRES_BIN.*apt-get install postgresql"):
        find_postgres_bin()
    stack = LocalStack(home=tmp_path / "home", database="postgres")
    with pytest.raises(PostgresNotFound):
        stack.start_database()  # before any server process is started


def test_a_folder_with_the_three_binaries_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("initdb", "pg_ctl", "postgres"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("ATOLL_POSTGRES_BIN", str(tmp_path))
    assert find_postgres_bin() == tmp_path


def test_root_runs_postgres_as_someone_else(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        assert run_as_user() is None
        return
    monkeypatch.setenv("ATOLL_POSTGRES_USER", "root")
    with pytest.raises(PostgresError, match="refuses to run as root"):
        run_as_user()
    monkeypatch.setenv("ATOLL_POSTGRES_USER", "nobody")
    user = run_as_user()
    assert user is not None and user.pw_name == "nobody"


def test_atoll_up_without_binaries_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATOLL_POSTGRES_BIN", str(tmp_path))
    assert main(["up", "--database", "postgres", "--home", str(tmp_path / "home"), "--no-deploy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atoll: error:") and "apt-get install postgresql" in err and "Traceback" not in err
    assert not (tmp_path / "home" / "postgres").exists()  # nothing was started or made
