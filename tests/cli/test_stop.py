"""`atoll stop` with real learner processes (no Prefect: `--no-prefect`): the stop marker makes
them save and exit by themselves within the grace; `atoll resume` clears the stop."""

from __future__ import annotations

import time
from pathlib import Path

from atoll.cli import main
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.train.local import LocalRun
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


def test_stop_lets_learners_save_and_exit_and_resume_clears_it(tmp_path: Path, capsys, monkeypatch) -> None:
    url = to_url(str(tmp_path / "run-stop"))
    create_run(url, *smoke_recipe(2, max_rounds=50))
    store = RunReader.open(url)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        procs = [run.start_learner(lid, "--heartbeat-interval-s", "0.5") for lid in ("learner-0", "learner-1")]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            lives = [store.learner_liveness(lid) for lid in ("learner-0", "learner-1")]
            if all(lv.heartbeat is not None and lv.heartbeat.step for lv in lives):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("learners never heartbeated")
        assert main(["stop", url, "--no-prefect", "--grace-s", "60", "--reason", "test stop"]) == 0
        out = capsys.readouterr().out
        assert "learner-0: exited (stopped" in out and "learner-1: exited (stopped" in out, out
        for p in procs:
            assert p.wait(timeout=30) == 0
    marker = store.stop_marker()
    assert marker is not None and marker.stopped and marker.reason == "test stop"
    for lid in ("learner-0", "learner-1"):
        assert store.load_learner_state(lid) is not None  # saved before exiting

    # resume clears the stop before launching (the launch itself is not under test here)
    import atoll.ops.client as client_mod

    monkeypatch.setattr(client_mod, "launch_training", lambda options, **kw: 0)
    assert main(["resume", url]) == 0
    marker = store.stop_marker()
    assert marker is not None and not marker.stopped
