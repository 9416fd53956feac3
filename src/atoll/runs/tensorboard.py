"""A run's figures as TensorBoard event files, from its bucket (``atoll status --tensorboard DIR``).

For people who live in TensorBoard: the same numbers ``atoll status`` prints and its plots draw,
written with TensorBoard's own writer (``torch.utils.tensorboard.SummaryWriter``; needs the
``tensorboard`` package: ``pip install 'atoll[tensorboard]'``), one step per committed round:

* ``loss/val``: validation loss where a round was evaluated;
* ``run/tokens_merged``, ``run/bytes``: tokens of training merged so far, bytes moved for the round;
* ``run/goodput``, ``run/merged_share``: the run's figures where sampled;
* ``learner/<id>/tokens_per_s``, ``/mfu``, ``/peak_mem_gib``, ``/goodput``: each learner's speed
  and goodput as of the newest round (MFU and memory where its contributions reported them: CUDA).

Each export replaces the previous one in ``DIR`` (its event files end in ``.atoll``; nothing else
there is touched), so running it again after more rounds shows each point once.
"""

from __future__ import annotations

from pathlib import Path

from atoll.runs.goodput import GoodputTracker

__all__ = ["EVENT_SUFFIX", "write_tensorboard"]

EVENT_SUFFIX = ".atoll"
"""The suffix of the event files an export writes (and the next export replaces)."""


def write_tensorboard(directory: str | Path, tracker: GoodputTracker) -> Path | None:
    """Write the tracker's rounds (``series``) and its report as one event file under
    ``directory`` and return its path; None when no round is committed yet (nothing written). Raises ImportError,
    naming the extra to install, without the ``tensorboard`` package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer imports the tensorboard package
        raise ImportError("atoll status --tensorboard needs the tensorboard package: "
                          "pip install 'atoll[tensorboard]'") from e
    if not tracker.series:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"):
        old.unlink()
    report = tracker.report()
    writer = SummaryWriter(log_dir=str(out), filename_suffix=EVENT_SUFFIX)
    try:
        for p in tracker.series:
            at = p.at if p.at > 0 else None
            writer.add_scalar("run/tokens_merged", p.tokens, p.round, walltime=at)
            writer.add_scalar("run/bytes", p.bytes_, p.round, walltime=at)
            if p.val_loss is not None:
                writer.add_scalar("loss/val", p.val_loss, p.round, walltime=at)
            if p.goodput is not None:
                writer.add_scalar("run/goodput", p.goodput, p.round, walltime=at)
            if p.merged_share is not None:
                writer.add_scalar("run/merged_share", p.merged_share, p.round, walltime=at)
        last = tracker.series[-1].round
        for lid, t in sorted(report.learners.items()):
            figures = {"goodput": t.goodput, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
                       "peak_mem_gib": t.peak_mem_gib}
            for name, value in figures.items():
                if value is not None:
                    writer.add_scalar(f"learner/{lid}/{name}", value, last)
    finally:
        writer.close()
    return next(out.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"))
