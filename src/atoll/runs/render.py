"""A run's figures written for people: a round's markdown (the round flow run's artifact) and read
back, and the plain-text tables ``atoll status`` prints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from atoll.runs.contributions import LOST_CAUSES, ContributionRow, effective_h, steps_since_sync
from atoll.runs.goodput import GoodputReport, LearnerTime
from atoll.runs.numbers import fmt_bytes, fmt_int, fmt_num, fmt_pct, fmt_s, short
from atoll.runs.traffic import WireTracker
from atoll.storage.records import CommitRecord
from atoll.storage.wire import WireCounts, wire_from_report

__all__ = [
    "CONTRIBUTIONS_HEADING",
    "CONTRIBUTION_COLUMNS",
    "contributions_from_markdown",
    "effective_h_line",
    "figure_lines",
    "history_table",
    "learner_time_lines",
    "lost_work_line",
    "learner_time_table",
    "round_markdown",
]


CONTRIBUTIONS_HEADING = "## Contributions"
CONTRIBUTION_COLUMNS = ("learner", "pool", "tokens", "steps", "weight", "status")


def round_markdown(record: CommitRecord, rows: list[ContributionRow], *, run_id: str, run_url: str,
                   max_rounds: int | None, goodput: GoodputReport | None = None, inner_steps: int | None = None,
                   wire: WireTracker | None = None, val_loss: tuple[int, float] | None = None) -> str:
    """The round's summary as markdown (the round flow run's one artifact): the round, its
    contributions table (``rows``: learner, pool, tokens, steps, weight, accepted or why not); with
    ``goodput``, the goodput so far overall and per learner; with ``inner_steps`` (H), the effective
    H next to it; the synchronizer's traffic for the round and, with ``wire`` (fed this round), the
    learners'; with ``val_loss`` (round, loss), the newest validation loss known by then."""
    s = record.stats
    accepted = [r for r in rows if r.status == "accepted"]
    eff_h = steps_since_sync(rows)
    contributors = ", ".join(f"`{r.learner}` ({r.pool or '?'})" for r in accepted) or "none"
    lines = [
        f"# Round {record.round}" + (f" of {max_rounds}" if max_rounds else "") + f" — fragment {record.fragment}",
        "",
        f"Run `{run_id}` at `{run_url}`",
        "",
        "| | |",
        "|---|---|",
        f"| quorum reached after | {fmt_s(s.get('quorum_s'))} |",
        f"| grace window used | {fmt_s(s.get('grace_s'))} |",
        f"| round open for | {fmt_s(s.get('wait_s'))} |",
        f"| closed because | {short(s.get('reason', '-'))} |",
        f"| contributors ({len(accepted)}) | {contributors} |",
        f"| weight 0 | {len(rows) - len(accepted)} |",
        f"| tokens merged | {fmt_int(s.get('tokens', 0), ',')} |",
        f"| bytes in (deltas) | {fmt_int(s.get('bytes_in', 0), ',')} |",
        f"| bytes out per learner (new fragment) | {fmt_int(s.get('bytes_out_per_learner', 0), ',')} |",
        *_wire_rows(record, wire),
        f"| validation loss | {_loss_cell(record, val_loss)} |",
        f"| updated | {'yes' if record.updated else 'no (nothing mergeable)'} |",
        f"| effective H: steps since last sync (mean of merged) | {fmt_num(eff_h, '.1f')}"
        + (f" (H = {inner_steps})" if inner_steps else "") + " |",
    ]
    if goodput is not None and goodput.goodput is not None:
        lines.append(f"| goodput so far (time in useful training steps / time available) | "
                     f"{100 * goodput.goodput:.1f}% |")
        lines.append(f"| merged-work share so far (training the model kept) | {fmt_pct(goodput.merged_share)} |")
    if rows:
        lines += ["", CONTRIBUTIONS_HEADING, "", "| " + " | ".join(CONTRIBUTION_COLUMNS) + " |",
                  "|---" * len(CONTRIBUTION_COLUMNS) + "|"]
        lines += [f"| {r.learner} | {r.pool or '-'} | {r.tokens:,} | {r.steps} | {round(r.weight, 6)} | "
                  f"{short(r.status).replace('|', '/')} |" for r in rows]
    if goodput is not None and goodput.learners:
        lines += ["", *learner_time_table(goodput)]
    return "\n".join(lines) + "\n"


def figure_lines(report: GoodputReport) -> list[str]:
    """The run's two figures, each with what it means (``atoll status``)."""
    if report.goodput is None:
        return [report.line()]
    return [f"goodput {100 * report.goodput:.1f}%: time in useful training steps over time available "
            f"({report.useful_s:.1f} s of {report.available_s:.1f} learner-s; not waiting, not restarting)",
            f"merged-work share {fmt_pct(report.merged_share)}: the part of that training the model kept "
            f"({report.merged_s:.1f} s of {report.training_s:.1f} s merged in committed rounds)", lost_work_line(report)]


def lost_work_line(report: GoodputReport) -> str:
    """The training no committed round merged, by cause (``atoll status``; share of training s),
    and the part of the merged share that ``keep_local_progress`` kept through an adoption."""
    def share(s: float) -> str:
        return fmt_pct(s / report.training_s if report.training_s > 0 else None)
    causes = ", ".join(f"{c} {share(report.lost_s.get(c, 0.0))}" for c in LOST_CAUSES)
    return (f"lost work: {causes} of training (overlap: steps between a publish and the next adoption, "
            f"overwritten by it); kept through adoption: {share(report.kept_s)} (inside the merged share)")


def learner_time_table(goodput: GoodputReport) -> list[str]:
    """Per learner, as markdown: goodput, merged-work share, where its time went, and its speed."""
    out = ["| learner | goodput so far | merged-work share | training s | waiting s | restarting s | tokens/s | "
           "MFU | peak mem |", "|---|---|---|---|---|---|---|---|---|"]
    for lid, t in sorted(goodput.learners.items()):
        tps, mfu, mem = _speed_cells(t)
        out.append(f"| {lid} | {100 * t.goodput:.1f}% | {100 * t.merged_share:.1f}% | {t.training_s:.1f} | "
                   f"{t.waiting_s:.1f} | {t.restarting_s:.1f} | {tps} | {mfu} | {mem} |")
    return out


def _speed_cells(t: LearnerTime) -> tuple[str, str, str]:
    """A learner's tokens/s (in its steps), MFU and peak device memory as its contributions
    reported them ('-' where unknown: MFU and memory are measured on CUDA only)."""
    return (f"{t.tokens_per_s:,.0f}" if t.tokens_per_s is not None else "-",
            f"{t.mfu:.1%}" if t.mfu is not None else "-",
            f"{t.peak_mem_gib:.1f} GiB" if t.peak_mem_gib is not None else "-")


def _wire_rows(record: CommitRecord, wire: WireTracker | None) -> list[str]:
    """The round's traffic: synchronizer and learners, requests, bytes, bytes per token merged."""
    got = wire.rounds.get(record.round) if wire is not None else None
    sync = got.synchronizer if got is not None else wire_from_report(record.stats.get("wire"))
    merged = got.tokens_merged if got is not None else 0
    rows = []
    if sync is not None and sync.requests:
        rows.append(f"| wire, synchronizer (since its previous commit) | {_wire_cell(sync, merged)} |")
    if got is not None and got.learners.requests:
        rows.append(f"| wire, learners (since their previous report) | {_wire_cell(got.learners, merged)} |")
    return rows


def _wire_cell(c: WireCounts, merged: float) -> str:
    per = f"; {c.bytes_total / merged:,.1f} B per token merged" if merged > 0 else ""
    return f"{c.requests:,} requests, up {fmt_bytes(c.bytes_up)}, down {fmt_bytes(c.bytes_down)}{per}"


def contributions_from_markdown(md: str) -> list[dict[str, str]]:
    """The contributions table of a round's markdown (:func:`round_markdown`) read back as one dict
    of strings per row, keyed by :data:`CONTRIBUTION_COLUMNS`: what a script that reads a round's
    artifact from the Prefect API gets. Empty if the round had no contributions."""
    if CONTRIBUTIONS_HEADING not in md:
        return []
    block = md[md.index(CONTRIBUTIONS_HEADING):].split("\n\n")[1].splitlines()[2:]  # past header + rule
    return [dict(zip(CONTRIBUTION_COLUMNS, (c.strip() for c in line.strip().strip("|").split("|")), strict=True))
            for line in block if line.startswith("|")]


def _loss_cell(record: CommitRecord, val_loss: tuple[int, float] | None) -> str:
    """A round artifact's loss: its commit's own (older runs), else the newest evaluation known when
    the artifact was written, with the round it measured (evaluation runs after the commit)."""
    own = record.stats.get("val_loss")
    if own is not None:
        return fmt_num(own, ".4f", "not measured this round")
    if val_loss is None:
        return "not measured yet"
    r, loss = val_loss
    return f"{loss:.4f} (round {r}{', this round' if r == record.round else ''})"


def history_table(records: Iterable[CommitRecord], losses: Mapping[int, float] | None = None) -> list[str]:
    """Plain-text round history (what ``atoll status`` prints); ``losses``: validation loss by
    round (:class:`~atoll.runs.losses.ValLosses`), else the commits' own stats (older runs)."""
    out = [f"{'round':>6} {'frag':>4} {'in':>3} {'out':>3} {'quorum_s':>8} {'grace_s':>7} {'tokens':>8} "
           f"{'val_loss':>8}  learners"]
    for r in records:
        s = r.stats
        who = ",".join(a.learner_id for a in r.accepted) or "-"
        out.append(f"{r.round:>6} {r.fragment:>4} {len(r.accepted):>3} {len(r.rejected):>3} "
                   f"{fmt_num(s.get('quorum_s', 0), '.2f'):>8} {fmt_num(s.get('grace_s', 0), '.2f'):>7} "
                   f"{fmt_int(s.get('tokens', 0)):>8} "
                   f"{fmt_num(losses.get(r.round) if losses is not None else s.get('val_loss'), '.4f'):>8}  {who}")
    return out


def effective_h_line(records: Iterable[CommitRecord], inner_steps: int, round_pacing: float) -> str:
    """``atoll status``'s effective H line, next to H and the round pacing that aims at it."""
    got = effective_h(records)
    pacing = f"round pacing {round_pacing:g}" if round_pacing > 0 else "round pacing off"
    if got is None:
        return f"effective H: - (nothing merged yet; H = {inner_steps}, {pacing})"
    return (f"effective H: {got[0]:.1f} inner steps per merged contribution (H = {inner_steps}, {pacing}; "
            f"{got[1]} contributions): {got[0] / max(1, inner_steps):.2f} x H")


def learner_time_lines(report: GoodputReport) -> list[str]:
    """Per learner, as plain text (``atoll status``): goodput, merged-work share, where its time
    went, and its speed: tokens/s in its steps, MFU and peak device memory (CUDA; '-' elsewhere)."""
    lines = [f"{'learner':<16} {'goodput':>8} {'merged':>7} {'training s':>10} {'waiting s':>9} "
             f"{'restarting s':>12} {'tokens/s':>9} {'MFU':>6} {'peak mem':>10}"]
    for lid, t in sorted(report.learners.items()):
        tps, mfu, mem = _speed_cells(t)
        lines.append(f"{lid:<16} {100 * t.goodput:>7.1f}% {100 * t.merged_share:>6.1f}% {t.training_s:>10.1f} "
                     f"{t.waiting_s:>9.1f} {t.restarting_s:>12.1f} {tps:>9} {mfu:>6} {mem:>10}")
    return lines
