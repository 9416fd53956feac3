"""`atoll keys`: a private key file per writer and its public key; a run created from those files
through the environment pins the public keys, and `atoll verify`, holding none, reports a commit
signed with another key."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from atoll.cli import main
from atoll.storage import paths
from atoll.storage.codec import dump_record, load_record
from atoll.storage.integrity import KEYRING_ENV, PUBLIC_KEYS_ENV, SYNCHRONIZER_KEY_ID, Keyring, seal
from atoll.storage.paths import to_url
from atoll.storage.records import KIND_COMMIT
from atoll.storage.signing import Ed25519Signer, new_private_key, private_text, public_text, run_context
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


def _new(tmp_path: Path, writer: str, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    path = tmp_path / f"{writer}.key"
    assert main(["keys", "new", writer, "--out", str(path)]) == 0
    return path, capsys.readouterr().out.strip()


def test_keys_new_writes_a_private_file_and_prints_the_public_key(tmp_path: Path, capsys) -> None:
    path, public = _new(tmp_path, "learner-0", capsys)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    private = json.loads(path.read_text())
    assert private["learner-0"].startswith("ed25519-private:")
    assert json.loads(public)["learner-0"].startswith("ed25519-public:")
    assert main(["keys", "public", str(path)]) == 0
    assert capsys.readouterr().out.strip() == public
    before = path.read_text()
    assert main(["keys", "new", "learner-0", "--out", str(path)]) == 2  # never overwritten
    assert path.read_text() == before
    assert main(["keys", "new", "sync", "--out", str(tmp_path / "x.key")]) == 2  # a reserved id
    keyring = Keyring.from_json(path.read_text())
    assert keyring.private("learner-0") is not None and keyring.key("learner-0") is None


def test_public_keys_env_holds_public_keys_only(tmp_path: Path, capsys) -> None:
    path, public = _new(tmp_path, "learner-0", capsys)
    _, other = _new(tmp_path, "learner-1", capsys)
    with pytest.raises(ValueError, match="public keys only"):
        Keyring.from_env({PUBLIC_KEYS_ENV: path.read_text()})
    mine = {KEYRING_ENV: path.read_text()}
    assert Keyring.from_env({**mine, PUBLIC_KEYS_ENV: public}).private("learner-0") is not None
    with pytest.raises(ValueError, match="not the public half"):
        Keyring.from_env({**mine, PUBLIC_KEYS_ENV: json.dumps({"learner-0": json.loads(other)["learner-1"]})})


def test_a_run_from_key_files_and_verify_without_keys(tmp_path: Path, capsys, monkeypatch, committed_run) -> None:
    sync_file, sync_public = _new(tmp_path, SYNCHRONIZER_KEY_ID, capsys)
    _, learner_public = _new(tmp_path, "learner-0", capsys)
    forger_file, _ = _new(tmp_path, "learner-1", capsys)
    monkeypatch.setenv(KEYRING_ENV, sync_file.read_text())
    monkeypatch.setenv(PUBLIC_KEYS_ENV, learner_public)
    url = committed_run()
    monkeypatch.delenv(KEYRING_ENV)
    monkeypatch.delenv(PUBLIC_KEYS_ENV)
    signing = json.loads((tmp_path / "run" / paths.RUN_MANIFEST).read_text())["signing"]
    assert "ed25519-public:" + signing["synchronizer"] == json.loads(sync_public)[SYNCHRONIZER_KEY_ID]
    assert "ed25519-public:" + signing["learners"]["learner-0"] == json.loads(learner_public)["learner-0"]
    assert main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert "ed25519" in out and "2 of 2 round(s) verified" in out
    commit = tmp_path / "run" / paths.commit_key(2)
    body = load_record(commit.read_bytes(), KIND_COMMIT)
    body["committed_by"] = "forger"
    forger = Keyring.from_json(forger_file.read_text()).private("learner-1")
    assert forger is not None
    commit.write_bytes(dump_record(KIND_COMMIT, seal(KIND_COMMIT, body, Ed25519Signer(forger, run_context("run")))))
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "signature does not verify" in out and "void slots: [2]" in out


def test_a_secret_block_with_an_unusable_keyring_is_refused_without_its_value(tmp_path: Path, capsys) -> None:
    from atoll.flows import credentials

    path, _ = _new(tmp_path, "learner-0", capsys)
    assert credentials.KEYRING_ENV == KEYRING_ENV
    good = json.dumps({KEYRING_ENV: path.read_text(), "AWS_ACCESS_KEY_ID": "a"})
    assert credentials.secret_env_values(good, block="b")[KEYRING_ENV] == path.read_text()
    bad_value = "ed25519-private:" + "zz" * 32
    with pytest.raises(ValueError, match="Secret block 'b': ATOLL_KEYRING is not a keyring") as e:
        credentials.secret_env_values(json.dumps({KEYRING_ENV: json.dumps({"learner-0": bad_value})}), block="b")
    assert bad_value not in str(e.value) and e.value.__cause__ is None


def test_a_new_synchronizer_key_forks_the_run(tmp_path: Path, capsys, monkeypatch) -> None:
    """Rotation (or a lost key): the run is forked into a new run pinned to the new key; the fork
    reads its source against the key the source pins, and both verify without any key."""
    from atoll.runs.manage import prepare_run

    old_file, _ = _new(tmp_path, SYNCHRONIZER_KEY_ID, capsys)
    new_key = new_private_key()
    monkeypatch.setenv(KEYRING_ENV, old_file.read_text())
    config, recipe = smoke_recipe(2, max_rounds=4)
    old_url, new_url = to_url(str(tmp_path / "old")), to_url(str(tmp_path / "new"))
    store = create_run(old_url, config, recipe)
    assert store.commit_round(1, 0, params=store.read_global_fragment(0)).won
    monkeypatch.setenv(KEYRING_ENV, json.dumps({SYNCHRONIZER_KEY_ID: private_text(new_key)}))
    assert prepare_run(new_url, resume_from=old_url, fork_round=1).action == "forked"
    pinned = json.loads((tmp_path / "new" / paths.RUN_MANIFEST).read_text())["signing"]["synchronizer"]
    assert "ed25519-public:" + pinned == public_text(new_key)
    monkeypatch.delenv(KEYRING_ENV)
    assert main(["verify", old_url]) == 0 and main(["verify", new_url]) == 0
