"""`python -m atoll.train.local run` restarts a learner process that died, and it is merged again.

Real processes: the runner (synchronizer in-process, one child process per learner) on a folder
bucket. The run is lock-step (K = M, synchronous DiLoCo), so no round can commit without the dead
learner: rounds after the kill commit only if the runner restarts it and it rejoins. SIGTERM to
the runner then stops the synchronizer and every learner process (none is left orphaned).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atoll.core.config import synchronous_diloco
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.train.local import LearnerRestarts
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the learner's process in /proc"),
]

def children(parent: int) -> dict[int, str]:
    """pid -> command line of the live child processes of ``parent``."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def learner_pid(parent: int, learner_id: str) -> int | None:
    return next((pid for pid, cmd in children(parent).items() if f"--learner-id {learner_id} " in cmd + " "), None)


def wait_for(cond, timeout_s: float, what: str, proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the runner exited with {proc.returncode} waiting for {what}:\n" + \
            out.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + out.read_text()[-3000:]
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_dead_learner_is_restarted_and_merged_again_and_sigterm_stops_everything(tmp_path: Path) -> None:
    bucket, logs, out = tmp_path / "run", tmp_path / "logs", tmp_path / "runner.out"
    _, recipe = smoke_recipe(2, max_rounds=100_000)
    create_run(to_url(str(bucket)), synchronous_diloco(2, inner_steps=2), recipe.replace(eval_every_rounds=0))
    store = RunReader.open(to_url(str(bucket)))
    with open(out, "wb") as f:
        runner = subprocess.Popen(
            [sys.executable, "-m", "atoll.train.local", "run", "--preset", "smoke", "--bucket", str(bucket),
             "--log-dir", str(logs)],
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    learners: dict[int, str] = {}
    try:
        wait_for(lambda: store.latest_round() >= 2, 120, "round 2", runner, out)
        pid = learner_pid(runner.pid, "learner-1")
        assert pid is not None, children(runner.pid)
        os.kill(pid, signal.SIGKILL)
        killed_at = store.latest_round()
        # K = M: a round after the kill commits only once the restarted learner-1 is merged again.
        wait_for(lambda: store.latest_round() >= killed_at + 3, 120, "rounds after the restart", runner, out)
        learners = children(runner.pid)
        assert len(learners) == 2 and pid not in learners, learners
        runner.send_signal(signal.SIGTERM)  # the runner stops the synchronizer, then its learners
        assert runner.wait(timeout=60) == 0, out.read_text()[-3000:]
    finally:
        if runner.poll() is None:  # a failure above: stop the runner; it stops its learners
            runner.terminate()
            try:
                runner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.wait()
        for child in learners:  # never leave a learner behind, whatever happened
            if alive(child):
                os.kill(child, signal.SIGKILL)
    assert not [child for child in learners if alive(child)]  # stopped by the runner, not by the line above
    printed = out.read_text()
    assert "learner-1 exited with -9; restarting it" in printed, printed[-3000:]
    assert "learner-0 exited" not in printed and "done: " in printed
    # Two incarnations of learner-1 (the second "rejoined" if the first had saved its state yet).
    joined = re.findall(r"learner-1: (?:re)?joined at round (\d+)", (logs / "learner-1.log").read_text())
    assert len(joined) == 2, joined
    assert int(joined[0]) == 0 and killed_at <= int(joined[1]) <= killed_at + 1
    history = store.history()
    assert [r.round for r in history] == list(range(1, len(history) + 1)) and len(history) >= killed_at + 3
    # K = M: every round merged both learners, the ones after the restart included.
    assert all(sorted(a.learner_id for a in r.accepted) == ["learner-0", "learner-1"] for r in history)


class FakeProc:
    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


class FakeRun:
    """What LearnerRestarts uses of a LocalRun: the learner processes, and starting one."""

    def __init__(self, *ids: str) -> None:
        self.learners = {lid: FakeProc() for lid in ids}
        self.started: list[str] = []

    def start_learner(self, learner_id: str) -> FakeProc:
        self.started.append(learner_id)
        self.learners[learner_id] = FakeProc()
        return self.learners[learner_id]


def test_learner_restarts_back_off_for_a_learner_that_keeps_dying() -> None:
    run, now, lines = FakeRun("a", "b"), [100.0], []
    restarts = LearnerRestarts(run, clock=lambda: now[0], log=lines.append)  # type: ignore[arg-type]
    assert restarts.dead_learners() == []  # all alive
    run.learners["a"].returncode = 1
    assert restarts.dead_learners() == ["a"] and lines == ["a exited with 1; restarting it (it rejoins from the bucket)"]
    run.learners["a"].returncode = 1  # dies again at once
    waits = []
    for _ in range(8):  # each restart must wait twice as long as the one before, up to a minute
        t0 = now[0]
        while restarts.dead_learners() == []:
            now[0] += 0.25
        waits.append(now[0] - t0)
        run.learners["a"].returncode = -9
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert restarts.restarts == {"a": 9} and run.started == ["a"] * 9
    run.learners["b"].returncode = 0  # a learner that has never died is restarted at once
    assert restarts.dead_learners() == ["b"]
