"""The retention flow (``atoll-prune``) on a real Prefect server: a dry run that deletes nothing,
then a prune, each with its task runs and a markdown artifact with the per-class table."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from atoll.runs.names import slug
from atoll.storage import RunReader
from atoll.storage.paths import to_url


def test_prune_flow_dry_run_then_prune_with_artifact_and_task_runs(smoke_run, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    from atoll.flows.prune import prune_flow

    # A copy of the session's smoke run (6 rounds, P = 2), everything in it written two hours ago.
    root = tmp_path / "run"
    shutil.copytree(Path(smoke_run.url.removeprefix("file://")), root)
    old = time.time() - 7200
    for f in root.rglob("*"):
        os.utime(f, (old, old))
    url = to_url(str(root))
    files = sorted(p for p in root.rglob("*") if p.is_file())

    with pytest.raises(ValueError, match="keep_rounds must be at least 2 x P = 4"):
        prune_flow(url, keep_rounds=2)
    dry = prune_flow(url, keep_rounds=4, dry_run=True)
    assert dry["would_delete"] > 0 and dry["deleted"] == 0 and dry["through_round"] == 2
    assert sorted(p for p in root.rglob("*") if p.is_file()) == files

    state = prune_flow(url, keep_rounds=4, return_state=True)
    result = state.result()
    assert result["deleted"] == dry["would_delete"] and result["deleted_bytes"] > 0
    store = RunReader.open(url)
    report = store.verify()
    assert report.ok, report.problems
    assert store.read_prune_record()[0] is not None
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        assert {t.name.rsplit("-", 1)[0] for t in tasks} == {"plan-retention", "apply-retention"}
        key = f"{slug(store.manifest.run_id)}-retention"
        [latest, *_] = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                             sort="CREATED_DESC")
        assert latest.flow_run_id == flow_run.id and "| global state |" in latest.data and "dry run" not in latest.data
