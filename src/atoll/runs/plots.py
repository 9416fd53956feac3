"""The run's plots, from the bucket alone: what ``atoll status --plot DIR`` writes and what the
training run's ``<run>-plots`` artifact shows in the Prefect UI (PNGs embedded as data URIs).

Input is a :class:`~atoll.runs.goodput.GoodputTracker` that has been fed the run's commit records
(its ``series``, one :class:`~atoll.runs.goodput.RoundPoint` per round, and its report):

* ``loss``: validation loss against tokens merged and against wall time (the evaluator's records,
  as of the tracker's last :meth:`~atoll.runs.goodput.GoodputTracker.refresh_losses`);
* ``figures``: goodput and merged-work share so far, over wall time;
* ``contributors``: contributors merged per round, by pool;
* ``bytes``: bytes the synchronizer and the round's learners moved per round;
* ``learners``: per learner, tokens/s and where its time went (training, waiting, restarting).

Small PNGs (dpi :data:`DPI`, at most :data:`MAX_POINTS` points a line) keep the artifact far
under the server's limits. matplotlib runs on its Agg backend (no display).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atoll.runs.goodput import GoodputReport, GoodputTracker, RoundPoint
from atoll.runs.render import figure_lines

__all__ = ["DPI", "MAX_POINTS", "PLOTS", "render_plots", "plots_markdown", "write_plots"]

DPI = 80
MAX_POINTS = 1500
"""Rounds drawn per line (evenly thinned beyond this)."""


def _thin(points: list[RoundPoint]) -> list[RoundPoint]:
    step = max(1, -(-len(points) // MAX_POINTS))
    return points[::step] if step > 1 else points


def _minutes(points: list[RoundPoint]) -> list[float]:
    t0 = points[0].at if points else 0.0
    return [(p.at - t0) / 60 for p in points]


def _loss(ax: Any, points: list[RoundPoint], report: GoodputReport) -> None:
    got = [p for p in points if p.val_loss is not None]
    ax[0].plot([p.tokens / 1e6 for p in got], [p.val_loss for p in got], ".-", ms=3)
    ax[0].set_xlabel("tokens merged (M)")
    ax[0].set_ylabel("validation loss")
    ax[1].plot([m for m, p in zip(_minutes(points), points, strict=True) if p.val_loss is not None],
               [p.val_loss for p in got], ".-", ms=3, color="tab:orange")
    ax[1].set_xlabel("minutes since the first commit")


def _figures(ax: Any, points: list[RoundPoint], report: GoodputReport) -> None:
    mins = _minutes(points)
    for attr, label in (("goodput", "goodput (time in useful training steps / available)"),
                        ("merged_share", "merged-work share (training the model kept)")):
        got = [(m, getattr(p, attr)) for m, p in zip(mins, points, strict=True) if getattr(p, attr) is not None]
        ax[0].plot([m for m, _ in got], [100 * v for _, v in got], ".-", ms=3, label=label)
    ax[0].set_ylim(0, 105)
    ax[0].set_ylabel("% so far")
    ax[0].set_xlabel("minutes since the first commit")
    ax[0].legend(fontsize=7, loc="lower right")


def _contributors(ax: Any, points: list[RoundPoint], report: GoodputReport) -> None:
    pools = sorted({pool for p in points for pool in p.pools})
    rounds = [p.round for p in points]
    if pools:
        ax[0].stackplot(rounds, [[p.pools.get(pool, 0) for p in points] for pool in pools], labels=pools,
                        step="post")
        ax[0].legend(fontsize=7, loc="upper left", title="pool", title_fontsize=7)
    ax[0].set_xlabel("round")
    ax[0].set_ylabel("contributors merged")


def _bytes(ax: Any, points: list[RoundPoint], report: GoodputReport) -> None:
    ax[0].plot([p.round for p in points], [p.bytes_ / 1e6 for p in points], lw=1)
    ax[0].set_xlabel("round")
    ax[0].set_ylabel("MB moved (synchronizer + learners)")


def _learners(ax: Any, points: list[RoundPoint], report: GoodputReport) -> None:
    names = sorted(report.learners)
    times = [report.learners[n] for n in names]
    ax[0].barh(names, [t.tokens_per_s or 0.0 for t in times], color="tab:green")
    ax[0].set_xlabel("tokens/s (in steps)")
    left = [0.0] * len(names)
    for attr, color in (("useful_s", "tab:blue"), ("waiting_s", "tab:gray"), ("restarting_s", "tab:red")):
        vals = [getattr(t, attr) for t in times]
        label = {"useful_s": "training (useful)", "waiting_s": "waiting", "restarting_s": "restarting"}[attr]
        ax[1].barh(names, vals, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax[1].set_xlabel("seconds")
    ax[1].legend(fontsize=7, loc="lower right")
    ax[1].set_yticklabels([])


PLOTS: dict[str, tuple[str, int, Callable[[Any, list[RoundPoint], GoodputReport], None]]] = {
    "loss": ("Validation loss against tokens merged and wall time", 2, _loss),
    "figures": ("Goodput and merged-work share so far", 1, _figures),
    "contributors": ("Contributors merged per round, by pool", 1, _contributors),
    "bytes": ("Bytes moved per round", 1, _bytes),
    "learners": ("Per learner: tokens/s, and time training, waiting and restarting", 2, _learners),
}
"""Name -> (title, panels, drawer)."""


def render_plots(tracker: GoodputTracker, report: GoodputReport | None = None) -> dict[str, bytes]:
    """Each plot of :data:`PLOTS` as PNG bytes (none when no round is committed yet)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _thin(tracker.series)
    if not points:
        return {}
    report = report if report is not None else tracker.report()
    out: dict[str, bytes] = {}
    for name, (title, panels, draw) in PLOTS.items():
        if name == "learners" and not report.learners:
            continue
        fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels if panels > 1 else 7.5, 2.8), squeeze=False)
        try:
            draw(axes[0], points, report)
            fig.suptitle(title, fontsize=9)
            for a in axes[0]:
                a.tick_params(labelsize=7)
                a.xaxis.label.set_size(8)
                a.yaxis.label.set_size(8)
                a.grid(alpha=0.3)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=DPI)
            out[name] = buf.getvalue()
        finally:
            plt.close(fig)
    return out


def plots_markdown(run_id: str, tracker: GoodputTracker, pngs: dict[str, bytes],
                   report: GoodputReport | None = None) -> str:
    """The ``<run>-plots`` artifact: the run's two figures in words, then each plot inline."""
    report = report if report is not None else tracker.report()
    last = tracker.series[-1].round if tracker.series else 0
    lines = [f"# Run `{run_id}` after round {last}", "", *(f"* {line}" for line in figure_lines(report)), ""]
    for name, png in pngs.items():
        lines += [f"## {PLOTS[name][0]}", "",
                  f"![{name}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})", ""]
    return "\n".join(lines)


def write_plots(directory: str | Path, tracker: GoodputTracker) -> list[Path]:
    """Write each plot as ``<name>.png`` under ``directory`` (``atoll status --plot``)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, png in render_plots(tracker).items():
        path = out / f"{name}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths
