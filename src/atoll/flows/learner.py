"""The learner flow: one long-lived flow run per learner (island).

Launched by the training run through ``run_deployment`` onto the learner's own work pool, or by
hand anywhere (``atoll learner <run-url> --learner-id ID``). It runs
:func:`atoll.train.inner.run_learner` unchanged (an island of ``ranks > 1``:
:func:`atoll.train.island.run_island`; a ``command``: the user's script, which joins with
``atoll.join``): the learner rebuilds everything from the run
URL, takes a new lease (fencing any older copy of itself), rejoins from the bucket (latest global
state + its own saved inner state) and heartbeats in its own prefix. It exits by itself, saving its
state first, once the run has committed its last round, when the run is marked stopped, when no
round has been committed for ``orphan_timeout_s``, or on SIGTERM; a newer incarnation of the same
learner makes it exit at once without saving (it is fenced). Progress shows as log lines (steps, loss,
publishes, alignments), a progress artifact (rounds committed, as this learner sees them) and a
summary artifact at the end.
"""

from __future__ import annotations

import contextvars
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.runtime import flow_run as prefect_flow_run

from atoll.flows.credentials import SECRET_BLOCK_ENV, export_secret_env
from atoll.runs.names import slug
from atoll.runs.options import FleetOptions, default_of
from atoll.storage.learner_side import LearnerStore
from atoll.storage.reader import RunReader
from atoll.train.hook import run_command
from atoll.train.inner import run_learner
from atoll.train.island import run_island
from atoll.train.learner import LearnerOptions, LearnerSummary
from atoll.train.run import load_recipe

__all__ = ["learner_flow"]


class _ProgressWriter:
    """Moves the learner's progress artifact from a background thread, latest line wins: the
    training loop only hands a line over (an API call under a loaded server can take a second)."""

    def __init__(self, artifact_id: UUID, store: Any, max_rounds: int) -> None:
        self.artifact_id, self.store, self.max_rounds = artifact_id, store, max_rounds
        self._line: str | None = None
        self._cv = threading.Condition()

    def start(self) -> _ProgressWriter:
        ctx = contextvars.copy_context()  # Prefect's settings (API URL) live in context variables
        threading.Thread(target=ctx.run, args=(self._work,), name="atoll-learner-progress", daemon=True).start()
        return self

    def post(self, line: str) -> None:
        with self._cv:
            self._line = line
            self._cv.notify()

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._line is None:
                    self._cv.wait()
                line, self._line = self._line, None
            try:
                latest = self.store.latest_round()
                update_progress_artifact(artifact_id=self.artifact_id,
                                         progress=100.0 * min(1.0, latest / self.max_rounds),
                                         description=f"{line} | round {latest} of {self.max_rounds}")
            except Exception:  # noqa: BLE001 - progress is cosmetic; training goes on
                pass


@flow(name="atoll-learner", persist_result=False, log_prints=False)
def learner_flow(
    run_url: str,
    learner_id: str,
    storage_options: dict[str, Any] | None = None,
    threads: int = default_of(FleetOptions, "threads"),
    poll_interval_s: float = default_of(FleetOptions, "poll_interval_s"),
    log_every_steps: int = 50,
    max_steps: int | None = None,
    orphan_timeout_s: float | None = default_of(FleetOptions, "orphan_timeout_s"),
    heartbeat_interval_s: float = LearnerOptions.heartbeat_interval_s,
    device: str | None = None,
    autocast: str | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """Train as ``learner_id`` of the run at ``run_url`` until the run is finished.

    ``device`` ('auto', 'cpu', 'cuda', 'cuda:N', 'mps') and ``autocast`` ('' or 'bf16') override the
    recipe's ``LearnerSpec.device`` / ``.autocast`` for this launch (None: the recipe's).
    ``command`` (argv) runs a user's own training script that joins with ``atoll.join`` instead of
    atoll's loop (None: the recipe's ``LearnerSpec.command``; empty there too: atoll's loop).
    ``threads``, ``poll_interval_s`` and ``orphan_timeout_s`` default to :class:`FleetOptions`' (a
    learner started by hand runs as one the training run launches)."""
    logger = get_run_logger()
    if exported := export_secret_env():  # bucket credentials from the Secret block in $ATOLL_SECRET_BLOCK
        logger.info(f"bucket credentials from Secret block {os.environ[SECRET_BLOCK_ENV]!r}: {', '.join(exported)}")
    store = LearnerStore.open(run_url, storage_options)
    recipe = load_recipe(store)
    _, spec = recipe.learner(learner_id)
    logger.info(f"{learner_id}: pid {os.getpid()} on {socket.gethostname()}, pool {spec.pool}, run {store.url}")
    log = _progress_log(logger.info, store, learner_id, recipe.max_rounds)
    options = LearnerOptions(threads=threads, poll_interval_s=poll_interval_s, log_every_steps=log_every_steps,
                             max_steps=max_steps, orphan_timeout_s=orphan_timeout_s,
                             heartbeat_interval_s=heartbeat_interval_s,
                             flow_run_id=str(prefect_flow_run.id) if prefect_flow_run.id else None,
                             device=device, autocast=autocast)
    user_command = list(command) if command else list(spec.command)
    if user_command:  # the user's own loop (atoll.join): same lease, heartbeats, stop and fencing
        return _run_user_command(store, learner_id, user_command, options, log)
    if spec.ranks > 1:  # an island: spec.ranks processes doing DDP, rank 0 doing the bucket I/O
        summary = run_island(store, learner_id, options=options, storage_options=storage_options, log=log)
    else:
        summary = run_learner(store, learner_id, log=log, options=options)
    _summary_artifact(store.manifest.run_id, learner_id, spec.pool, summary)
    return {"learner_id": learner_id, "steps": summary.steps, "tokens": summary.tokens,
            "published": summary.published, "aligned": summary.aligned, "last_loss": summary.last_loss,
            "exit_reason": summary.exit_reason}


def _progress_log(info: Callable[[str], None], store: LearnerStore, learner_id: str,
                  max_rounds: int) -> Callable[[str], None]:
    """The learner's log: each line to the run logger and, as its latest line, to the learner's
    progress artifact (rounds committed as this learner sees them)."""
    progress_id = cast(UUID | None, create_progress_artifact(  # sync call in a sync flow: a UUID, not a coroutine
        progress=100.0 * min(1.0, store.latest_round() / max_rounds),
        description=f"{learner_id}: rounds committed of run {store.manifest.run_id}",
    ))

    progress = _ProgressWriter(progress_id, store, max_rounds).start() if progress_id is not None else None

    def log(line: str) -> None:
        info(line)
        if progress is not None:
            progress.post(line)  # written by a background thread: no API call inside the training step

    return log


def _summary_artifact(run_id: str, learner_id: str, pool: str, summary: LearnerSummary) -> None:
    """What this flow run of the learner did, as a markdown artifact keyed by run and learner."""
    create_markdown_artifact(
        key=f"{slug(run_id)}-{slug(learner_id)}",
        description=f"learner {learner_id} of run {run_id}",
        markdown=(
            f"# Learner `{learner_id}` (pool `{pool}`)\n\n| | |\n|---|---|\n"
            f"| started from round | {summary.started_from_round} |\n"
            f"| resumed its inner state | {'yes' if summary.resumed_inner_state else 'no'} |\n"
            f"| steps this flow run | {summary.steps} |\n| tokens this flow run | {summary.tokens:,} |\n"
            f"| contributions published | {summary.published} |\n| global versions aligned | {summary.aligned} |\n"
            f"| last training loss | {summary.last_loss:.4f} |\n"
            f"| exit | {summary.exit_reason} |\n"
        ),
    )


def _run_user_command(store: RunReader, learner_id: str, command: list[str], options: LearnerOptions,
                      log: Any) -> dict[str, Any]:
    """Run the user's script; its exit reason comes from the bucket (its last heartbeat). A
    non-zero exit fails the flow run, so the training run's healing relaunches it."""
    code = run_command(command, run_url=store.url, learner_id=learner_id, flow_run_id=options.flow_run_id, log=log)
    beat = store.learner_liveness(learner_id).heartbeat
    reason = beat.reason if beat is not None and beat.status == "exited" else ""
    if code != 0:
        raise RuntimeError(f"{learner_id}: the user's command {command!r} exited with code {code}"
                           + (f" ({reason})" if reason else ""))
    return {"learner_id": learner_id, "command": command, "exit_code": code, "exit_detail": reason}
