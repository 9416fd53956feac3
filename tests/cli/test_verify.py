"""`atoll verify`: reads only, exit 0 on a sound run, 1 with the named problem on a forged one."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.cli import main
from atoll.storage import RunReader, paths
from atoll.storage.integrity import IntegrityError


def test_verify_a_sound_and_a_forged_run(tmp_path: Path, capsys, committed_run) -> None:
    url = committed_run()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["verify", url]) == 0
    assert "2 of 2 round(s) verified" in capsys.readouterr().out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # wrote nothing
    commit = tmp_path / "run" / paths.commit_key(1)
    commit.write_bytes(commit.read_bytes().replace(b'"committed_by":"synchronizer"', b'"committed_by":"someone"'))
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "00000001.json: digest does not match" in out and "void slots: [1]" in out
    reader = RunReader.open(url, read_only=True)
    assert reader.latest_round() == 2  # the latest commit verifies on its own; round 1 is never used
    with pytest.raises(IntegrityError, match="digest does not match"):
        reader.read_commit(1)
