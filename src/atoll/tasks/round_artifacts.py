"""The artifacts a run's recorder writes: each round's summary, the run's progress, goodput and plots.

* a round's markdown artifact, with no key, on the round's flow run: its summary with the goodput
  so far, overall and per learner, the mean *steps since last sync* of the merged contributions
  (the effective H), the round's traffic, and the contributions table;
* the run's progress artifact and the ``<run>-goodput`` markdown (the whole run's goodput, per
  learner), at most every ``progress_every_s`` and after the last round;
* the ``<run>-plots`` artifact (:mod:`atoll.runs.plots`), every ``plots_every`` rounds and at the end.

Validation loss is measured after a round commits, by the run's evaluator, and read from its
evaluation records (:mod:`atoll.runs.losses`) whenever the run-level artifacts are due: a round's
artifact shows the newest loss known when it is written, with the round that loss measured.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

from atoll.runs.contributions import ContributionRow
from atoll.runs.goodput import GoodputReport, GoodputTracker
from atoll.runs.names import slug
from atoll.runs.render import figure_lines, learner_time_table, round_markdown
from atoll.storage.reader import RunReader

__all__ = ["RunArtifacts", "artifact_keys", "goodput_markdown"]


def artifact_keys(run_id: str) -> dict[str, str]:
    """Artifact keys of a run (lowercase and dashes, as Prefect requires). A round's own artifact has
    no key (see :meth:`RunArtifacts.write_round`)."""
    s = slug(run_id)
    return {"goodput": f"{s}-goodput", "plots": f"{s}-plots",
            "run": f"{s}-run-summary", "progress": f"{s}-run-summary-progress", "segment": f"{s}-segment"}


def goodput_markdown(run_id: str, round_: int, goodput: GoodputReport) -> str:
    return (f"# Goodput and merged-work share of run `{run_id}` after round {round_}\n\n"
            + "".join(f"* {line}\n" for line in figure_lines(goodput)) + "\n"
            + "\n".join(learner_time_table(goodput)) + "\n\n"
            "Goodput is the paper's figure: time in useful training steps over the time learners were "
            "available. The merged-work share is the part of that training that reached the model. "
            "From the bucket (docs/prefect.md).")


class RunArtifacts:
    """The artifacts of one run, written by its recorder's writer thread (see the module docstring).
    ``run_flow_run_id``: the training-run flow run, which the run-level artifacts are attached to."""

    def __init__(self, store: RunReader, tracker: GoodputTracker, *, run_id: str, max_rounds: int, inner_steps: int,
                 progress_artifact_id: str | None, progress_every_s: float, run_flow_run_id: UUID | None,
                 plots_every: int) -> None:
        self.store = store
        self.tracker = tracker
        self.run_id = run_id
        self.max_rounds = max_rounds
        self.inner_steps = inner_steps
        self.progress_artifact_id = progress_artifact_id
        self.progress_every_s = progress_every_s
        self.run_flow_run_id = run_flow_run_id
        self.plots_every = plots_every
        """The run's ``<run>-plots`` artifact is drawn again every this many rounds (and at the end)."""
        self.keys = artifact_keys(run_id)
        self._plotted = 0
        self._last_progress = 0.0
        self._progress_round = 0
        self._progress_written = 0

    def write_round(self, client: Any, round_: int, record: Any, rows: list[ContributionRow],
                    goodput: GoodputReport, flow_run_id: UUID | None) -> None:
        """Round ``round_``'s artifact, on its flow run ``flow_run_id``."""
        from prefect.client.schemas.actions import ArtifactCreate

        md = round_markdown(record, rows, run_id=self.run_id, run_url=self.store.url, max_rounds=self.max_rounds,
                            goodput=goodput, inner_steps=self.inner_steps, wire=self.tracker.wire,
                            val_loss=self.tracker.losses.latest())
        # One artifact per round, with no key: a keyed artifact costs the server ~65% more per
        # write (it moves the key's latest version) and a key would gather one version per
        # round, 10^5 on a long run. The round's flow run is where a person looks for it.
        client.create_artifact(ArtifactCreate(
            type="markdown", data=md, flow_run_id=flow_run_id,
            description=f"round {round_} (fragment {record.fragment}) of run {self.run_id}: "
                        "summary and contributions"))

    def note_recorded(self, round_: int) -> None:
        """Round ``round_`` is recorded: the run-level artifacts show it when next written."""
        self._progress_round = max(self._progress_round, round_)

    def write_run_level(self, client: Any, goodput: GoodputReport, *, final: bool) -> None:
        """The run's progress, ``<run>-goodput`` (at most every ``progress_every_s``) and
        ``<run>-plots`` (every ``plots_every`` rounds), and all three when ``final``."""
        now = time.monotonic()
        due = final or now - self._last_progress >= self.progress_every_s
        r = self._progress_round
        progress_due = bool(r and r != self._progress_written and due)
        plots_due = bool(r and r != self._plotted and (final or r - self._plotted >= self.plots_every))
        if progress_due or plots_due:  # one LIST of sync/evals/ at most this often, however many rounds
            self.tracker.refresh_losses()
        if progress_due:
            self._progress_written = r
            self._last_progress = now
            self._write_progress(client, r, goodput)
        if plots_due:
            self._plotted = r
            self.write_plots(client, goodput)

    def _write_progress(self, client: Any, r: int, goodput: GoodputReport) -> None:
        """The run's progress artifact (if it has one) and ``<run>-goodput``, after round ``r``."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        latest = self.tracker.losses.latest()
        if self.progress_artifact_id:
            client.update_artifact(UUID(str(self.progress_artifact_id)), ArtifactUpdate(
                data=min(100.0, 100.0 * r / self.max_rounds),
                description=f"round {r} of {self.max_rounds}"
                + (f"; validation loss {latest[1]:.4f} (round {latest[0]})" if latest is not None else "")
                + (f"; goodput {100 * goodput.goodput:.1f}%" if goodput.goodput is not None else "")
                + (f"; merged-work share {100 * goodput.merged_share:.1f}%"
                   if goodput.merged_share is not None else "")))
        client.create_artifact(ArtifactCreate(key=self.keys["goodput"], type="markdown",
                                              data=goodput_markdown(self.run_id, r, goodput),
                                              flow_run_id=self.run_flow_run_id,
                                              description=f"goodput and merged-work share so far of run {self.run_id}"))

    def write_plots(self, client: Any, goodput: GoodputReport | None = None) -> None:
        """Draw the run's plots and write them as ``<run>-plots`` on the training-run flow run."""
        from prefect.client.schemas.actions import ArtifactCreate

        from atoll.runs.plots import plots_markdown, render_plots

        report = goodput if goodput is not None else self.tracker.report()
        pngs = render_plots(self.tracker, report)
        if pngs:
            client.create_artifact(ArtifactCreate(
                key=self.keys["plots"], type="markdown", flow_run_id=self.run_flow_run_id,
                data=plots_markdown(self.run_id, self.tracker, pngs, report),
                description=f"plots of run {self.run_id}: loss, goodput, contributors, bytes, learners"))
