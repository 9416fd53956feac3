"""The layout's pure functions (no storage)."""

from __future__ import annotations

import pytest

from atoll.storage import InvalidInput, paths


def test_keys_are_fixed_width_and_sort_numerically():
    keys = [paths.commit_key(r) for r in (1, 2, 10, 100, 99999999)]
    assert keys == sorted(keys)
    assert paths.commit_key(42) == "sync/commits/00000042.json"
    assert paths.parse_commit_key("s3://b/run/commits/00000042.json") == 42
    assert paths.parse_commit_key(".tmp-abc-00000042.json") is None
    assert paths.parse_commit_key("head.json") is None
    with pytest.raises(InvalidInput, match="rounds start at 1, got 0"):
        paths.commit_key(0)


def test_contribution_key_layout():
    sha = "ab" * 32
    key = paths.contribution_key(3, 12, "learner-0", 24, sha)
    assert key == "learners/learner-0/contributions/f0003/b00000012/learner-0.s0000000024.abababababababab.json"
    assert key.startswith(paths.contributions_prefix(3, 12, "learner-0"))
    assert paths.blob_key(sha) == f"sync/blobs/sha256/{sha}.safetensors"
    assert paths.blob_key(sha, "l-1") == f"learners/l-1/blobs/sha256/{sha}.safetensors"
    assert paths.learner_of_key(f"learners/l-1/blobs/sha256/{sha}.safetensors") == "l-1"
    assert paths.learner_of_key("sync/head.json") is None
    with pytest.raises(InvalidInput, match="not a sha256 hex digest: '../../etc'"):
        paths.blob_key("../../etc")
    assert paths.learner_state_key("l-1") == "learners/l-1/state.json"
    assert paths.checkpoint_model_key(100) == "sync/checkpoints/00000100/model.safetensors"


def test_join_url_never_uses_pathlib_semantics():
    assert paths.join_url("s3://bucket/prefix/", "/a/", "b.json") == "s3://bucket/prefix/a/b.json"
    assert paths.join_url("memory://x", "") == "memory://x"
    assert paths.run_url("gs://b/runs", "exp-1") == "gs://b/runs/exp-1"


def test_blob_and_contribution_names_parse_back() -> None:
    sha = "ab" * 32
    assert paths.parse_blob_name(paths.blob_key(sha, "l0").rsplit("/", 1)[1]) == sha
    assert paths.parse_contribution_sha16(paths.contribution_key(3, 12, "l0", 24, sha).rsplit("/", 1)[1]) == sha[:16]
    for junk in ("README", sha, f"{sha}.json", "x.safetensors", f"{'AB' * 32}.safetensors"):
        assert paths.parse_blob_name(junk) is None, junk
    for junk in ("x.json", "l0.s1.0123.json", "l0.s1.0123456789abcdeg.json", "0123456789abcdef.json", "a.b"):
        assert paths.parse_contribution_sha16(junk) is None, junk
