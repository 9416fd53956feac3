"""Long-running commands stop every process they started, on SIGTERM as on Ctrl-C (atoll.ops.signals).

Each case runs the real command in a process group of its own, waits until its children are up,
sends one signal to the command alone (not to its group: a process manager or ``kill`` signals one
pid, and the stack's processes run in sessions of their own anyway) and asserts that every process
that carries the case's marker in its environment (the command, the Prefect server, the workers,
the flow-run processes they started, an ephemeral server) is gone soon after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from atoll.ops.observe import processes_with
from atoll.ops.procs import descendants, free_port
from atoll.ops.stack import QUIET_PREFECT_ENV
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run

pytestmark = pytest.mark.timeout(300)

MARKER_VAR = "ATOLL_SHUTDOWN_MARKER"
"""Every process a case starts inherits this variable (servers and flow processes included)."""

GONE_TIMEOUT_S = 60.0
"""How long the command and everything it started may take to stop (the stack waits up to 20 s for
its workers and server, then kills them)."""


class Command:
    """One ``atoll`` command in a process group of its own, its output in a file, its processes marked."""

    def __init__(self, args: list[str], tmp_path: Path) -> None:
        self.marker = uuid.uuid4().hex
        self.log = tmp_path / "command.log"
        env = {**os.environ, **QUIET_PREFECT_ENV, "PREFECT_HOME": str(tmp_path / "prefect-home"),
               MARKER_VAR: self.marker}
        env.pop("PREFECT_API_URL", None)
        with open(self.log, "wb") as out:
            # SIGINT at its default even where pytest was started with it ignored (a background job).
            self.proc = subprocess.Popen([sys.executable, "-m", "atoll.cli", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=tmp_path, process_group=0,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def marked(self) -> list[int]:
        return processes_with(MARKER_VAR, self.marker)

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the command exited ({self.proc.returncode}) before {what}:\n{self.output()}")
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{self.output()[-3000:]}")

    def stop_with(self, sig: int) -> tuple[int, list[int]]:
        """Send ``sig`` to the command; its exit status and what is left of its processes after
        GONE_TIMEOUT_S (pid list, empty when all are gone)."""
        self.proc.send_signal(sig)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        try:
            rc = self.proc.wait(timeout=GONE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = -999
        while (left := self.marked()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return rc, left

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.marked()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)


@pytest.fixture
def command(tmp_path: Path) -> Iterator[Callable[[list[str]], Command]]:
    started: list[Command] = []

    def start(args: list[str]) -> Command:
        started.append(Command(args, tmp_path))
        return started[-1]

    yield start
    for c in started:  # a failed case leaves nothing behind either
        c.kill_all()


def _described(cmd: Command, pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            argv = "(gone)"
        lines.append(f"{pid}: {argv[:160]}")
    return "\n".join(lines) + "\n--- output\n" + cmd.output()[-3000:]


def _flow_processes(pid: int) -> list[int]:
    """Flow-run processes (``prefect.engine``) under ``pid``: the training run's, the learners'."""
    out = []
    for child in descendants(pid):
        try:
            if b"prefect.engine" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            pass
    return out


@pytest.mark.timeout(600)
def test_demo_kept_up_stops_its_stack_and_flow_runs_on_sigterm(command, tmp_path: Path) -> None:
    """Mid-training: the server, a worker per pool, and the flow-run processes the workers started
    (the training run, the learners) all go; the kept-up wait after training unwinds the same way."""
    cmd = command(["demo", "--dir", str(tmp_path / "demo"), "--learners", "2", "--rounds", "50",
                   "--port", str(free_port()), "--keep-up"])
    cmd.wait_for(lambda: "training run:" in cmd.output() and len(_flow_processes(cmd.proc.pid)) >= 2, 420,
                 "the training run and a learner to run under the workers")
    children = descendants(cmd.proc.pid)
    assert len(children) >= 5, _described(cmd, children)  # server, 2 workers, training run, a learner
    assert set(children) <= set(cmd.marked())
    rc, left = cmd.stop_with(signal.SIGTERM)
    assert not left, "left running after SIGTERM:\n" + _described(cmd, left)
    assert rc == 128 + signal.SIGTERM, cmd.output()
    assert "stopping the local stack" in cmd.output()


def test_up_stops_its_server_and_workers_on_sigterm(command) -> None:
    cmd = command(["up", "--no-deploy", "--port", str(free_port()), "--pools", "p-one"])
    cmd.wait_for(lambda: "Prefect UI:" in cmd.output() and len(descendants(cmd.proc.pid)) >= 2, 180,
                 "the server and the worker")
    rc, left = cmd.stop_with(signal.SIGTERM)
    assert not left, "left running after SIGTERM:\n" + _described(cmd, left)
    assert rc == 0, cmd.output()


def test_learner_with_an_ephemeral_server_stops_it_on_sigint(command, tmp_path: Path) -> None:
    """No PREFECT_API_URL: the learner flow runs on an ephemeral Prefect server, a child process
    that only the unwinding stops (atexit). Ctrl-C lands in the middle of training."""
    url = to_url(str(tmp_path / "run"))
    create_run(url, *smoke_recipe(1, max_rounds=50))
    store = RunReader.open(url)
    cmd = command(["learner", url, "--learner-id", "learner-0", "--threads", "1"])

    def training() -> bool:
        hb = store.learner_liveness("learner-0").heartbeat
        return hb is not None and bool(hb.step) and bool(descendants(cmd.proc.pid))

    cmd.wait_for(training, 180, "the learner to train on its ephemeral server")
    rc, left = cmd.stop_with(signal.SIGINT)
    assert not left, "left running after SIGINT:\n" + _described(cmd, left)
    assert rc == 130, cmd.output()
