"""A run's report gathered from the bucket alone: everything ``atoll status`` prints (the run, its
round history, loss, goodput and merged-work share, traffic, checkpoints, retention), and the
read-only checks ``atoll status`` and resuming rely on. No Prefect import: ``atoll status`` must
work with no Prefect at all."""

from __future__ import annotations

import time
from collections.abc import Mapping

from atoll.runs.goodput import GoodputTracker
from atoll.runs.losses import last_val_loss
from atoll.runs.numbers import fmt_int, short
from atoll.runs.render import effective_h_line, figure_lines, history_table, learner_time_lines
from atoll.storage import paths
from atoll.storage.reader import RunReader

__all__ = ["check_run", "checkpoint_rounds", "last_val_loss", "run_status"]


def checkpoint_rounds(store: RunReader) -> list[int]:
    """Rounds with a checkpoint folder; any other name in the folder (``abc``, ``²``, a 40-digit
    number) is ignored, never an error."""
    names = store.store.list(paths.checkpoints_prefix())
    return sorted(int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 12)


def check_run(store: RunReader) -> None:
    """Read what resuming the run needs (manifest, recipe, latest commit); raise atoll's own
    errors (StorageError, ValueError) on a broken run, never write."""
    from atoll.train.run import load_recipe

    _ = store.manifest
    load_recipe(store)
    latest = store.latest_round()
    if latest:
        store.read_global_state(latest)


def run_status(store: RunReader, *, last: int | None = None, tracker: GoodputTracker | None = None) -> list[str]:
    """Everything ``atoll status`` prints: the run, its round history, loss, goodput and merged-work
    share. Bucket only. ``tracker``: a fresh tracker to fill (its ``series`` and report then make
    the run's plots, :mod:`atoll.runs.plots`)."""
    m = store.manifest
    latest = store.latest_round()
    recipe = m.extra.get("recipe", {}) if isinstance(m.extra, Mapping) else {}
    max_rounds = recipe.get("max_rounds") if isinstance(recipe, Mapping) else None
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        max_rounds = None
    records = store.history(1, latest) if latest else []
    c = m.config
    lines = [
        f"run {m.run_id} at {store.url}",
        f"  M={c.num_learners} P={c.num_fragments} H={c.inner_steps} tau={c.overlap_steps} K={c.min_quorum}; "
        f"{latest} of {max_rounds if max_rounds else '?'} rounds committed"
        + ("" if not max_rounds or latest < max_rounds else " (finished)"),
    ]
    fork = m.extra.get("forked_from") if isinstance(m.extra, Mapping) else None
    if isinstance(fork, Mapping):
        lines.append(f"  forked from {short(fork.get('url'))} at round {fmt_int(fork.get('round'), '', '?')}")
    shown = records[-last:] if last else records
    if records:
        tracker = tracker if tracker is not None else GoodputTracker(store)
        tracker.sample_every = max(1, len(records) // 200)
        tracker.add(records)
        tracker.refresh_losses()
        lines += ["", *history_table(shown, tracker.losses.by_round)]
        measured = tracker.losses.latest()
        report = tracker.report()
        lines += ["", f"latest validation loss: {measured[1]:.4f} (round {measured[0]})" if measured is not None
                  else "latest validation loss: -",
                  *figure_lines(report), effective_h_line(records, c.inner_steps, c.round_pacing)]
        if report.learners:
            lines += ["", *learner_time_lines(report)]
        wire = tracker.wire.lines()
        lines += ["", *wire] if wire else []
    ckpts = checkpoint_rounds(store)
    if ckpts:
        lines.append(f"checkpoints at rounds: {', '.join(map(str, ckpts))}")
    pruned, why = store.read_prune_record()
    if pruned is not None:
        lines.append(f"retention: the global state of rounds 1..{pruned.through_round} is deleted ({pruned.by}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(pruned.pruned_at))}; "
                     f"{pruned.deleted_objects} objects, {pruned.deleted_bytes / 2**20:.1f} MiB so far)")
    elif why is not None:
        lines.append(why)
    return lines
