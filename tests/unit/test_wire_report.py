"""A run's traffic from its commit records, by hand: the synchronizer's per-round counts, and the
learners' cumulative reports turned into per-round differences (a new meter, i.e. a restarted
process, counts from zero; an older report of a known meter adds nothing).

=====  ======================================  =====================================  ==============
round  a reports (puts gets up down tokens)    b reports                              synchronizer
=====  ======================================  =====================================  ==============
1      2 3 100 500 64 (meter a1)               2 3 110 500 64 (meter b1)              5 GET 3 LIST, down 1000
2      4 6 200 1000 128 (+2 +3 +100 +500 +64)  1 2 50 400 32 (meter b2: all of it)    3 PUT 4 GET, up 700, down 900
3      1 1 10 10 8 (a1 again: older, +0)       -                                      (no counts)
=====  ======================================  =====================================  ==============

Learners: 7 PUT, 11 GET, up 360, down 1900, 224 tokens trained; 224 tokens merged (128 + 96):
(360 + 1900) / 224 = 10.1 bytes per token either way; the synchronizer (700 + 1900) / 224 = 11.6.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from atoll.runs.render import round_markdown
from atoll.runs.traffic import WireTracker
from atoll.storage.wire import WireCounts


def _report(puts: int, gets: int, up: int, down: int, tokens: int, meter: str) -> dict[str, Any]:
    return {"puts": puts, "gets": gets, "heads": 0, "lists": 0, "deletes": 0, "bytes_up": up, "bytes_down": down,
            "tokens": tokens, "meter": meter}


ROUNDS: list[dict[str, Any]] = [
    {"tokens": 128, "wire": {"gets": 5, "lists": 3, "bytes_down": 1000},
     "learner_wire": {"a": _report(2, 3, 100, 500, 64, "a1"), "b": _report(2, 3, 110, 500, 64, "b1")}},
    {"tokens": 96, "wire": {"puts": 3, "gets": 4, "bytes_up": 700, "bytes_down": 900},
     "learner_wire": {"a": _report(4, 6, 200, 1000, 128, "a1"), "b": _report(1, 2, 50, 400, 32, "b2"), "c": "junk",
                      7: {}}},
    {"tokens": True, "wire": "not counts", "learner_wire": {"a": _report(1, 1, 10, 10, 8, "a1")}},
]


def _records() -> list[Any]:
    return [SimpleNamespace(round=r, fragment=(r - 1) % 2, stats=stats) for r, stats in enumerate(ROUNDS, start=1)]


def test_traffic_by_hand_with_a_restarted_learner() -> None:
    tracker = WireTracker()
    got = [tracker.add(rec) for rec in _records()]
    assert got[0].learners == WireCounts(puts=4, gets=6, bytes_up=210, bytes_down=1000)
    assert got[1].learners == WireCounts(puts=3, gets=5, bytes_up=150, bytes_down=900)  # a's difference + b2's all
    assert (got[1].learner_tokens, got[2].learner_tokens, got[2].tokens_merged) == (96, 0, 0)
    assert got[2].synchronizer == WireCounts() and got[2].learners == WireCounts()
    assert tracker.learners == WireCounts(puts=7, gets=11, bytes_up=360, bytes_down=1900)
    assert tracker.synchronizer == WireCounts(puts=3, gets=9, lists=3, bytes_up=700, bytes_down=1900)
    assert (tracker.learner_tokens, tracker.tokens_merged, tracker.reporting) == (224, 224, 2)
    assert tracker.lines() == [
        "wire             req/round   up/round down/round B/token trained B/token merged",
        "learners (2)           6.0      120 B      633 B            10.1           10.1",
        "synchronizer           5.0      233 B      633 B            11.6           11.6",
        "  over 3 rounds; up and down, all requests; a learner's traffic as it reports it",
    ]


def test_a_tracker_keeps_only_its_last_rounds() -> None:
    tracker = WireTracker(keep=2)
    for rec in _records():
        tracker.add(rec)
    assert sorted(tracker.rounds) == [2, 3] and tracker.count == 3


def test_no_counts_no_lines() -> None:
    tracker = WireTracker()
    tracker.add(SimpleNamespace(round=1, stats={"tokens": 5}))
    assert tracker.lines() == []


def test_the_round_artifact_shows_the_round_s_traffic() -> None:
    records = _records()
    tracker = WireTracker()
    for rec in records:
        tracker.add(rec)
    full = SimpleNamespace(**vars(records[1]), accepted=(), rejected={}, updated=True)
    md = round_markdown(full, [], run_id="r", run_url="file:///r", max_rounds=None, wire=tracker)  # type: ignore[arg-type]
    assert ("| wire, synchronizer (since its previous commit) | 7 requests, up 700 B, down 900 B; "
            "16.7 B per token merged |") in md
    assert "| wire, learners (since their previous report) | 8 requests, up 150 B, down 900 B; 10.9 B per token merged |" in md
    alone = round_markdown(full, [], run_id="r", run_url="file:///r", max_rounds=None)  # type: ignore[arg-type]
    assert "| wire, synchronizer (since its previous commit) | 7 requests, up 700 B, down 900 B |" in alone
    assert "wire, learners" not in alone
    bare = SimpleNamespace(**vars(records[2]), accepted=(), rejected={}, updated=False)
    assert "wire" not in round_markdown(bare, [], run_id="r", run_url="file:///r", max_rounds=None)  # type: ignore[arg-type]
