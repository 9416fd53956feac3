"""What learners report about the wire, and the planner's bytes per token against a real run.

A small run on the virtual clock, each learner on its own object store (counted apart, reading
every new version itself, as a process of its own would): the bytes its store sent and fetched
per token trained, against :func:`atoll.sim.planner.plan_wire` for the same configuration.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from atoll.runs.goodput import GoodputTracker
from atoll.runs.report import run_status
from atoll.sim.planner import plan, plan_wire
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.storage.wire import WireCounts
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual

STEPS = 24
"""Inner steps per learner."""


def test_each_contribution_reports_everything_its_learner_sent_before_it(tmp_path: Path) -> None:
    """Publishing on the background writer's thread, fetching from the training thread: one store,
    one total. Contribution k reports the k - 1 before it (payload and record each) and the join."""
    config, recipe = smoke_recipe(3, max_rounds=10_000)
    url = to_url(str(tmp_path / "run"))
    create_run(url, config, recipe)
    store = LearnerStore.open(url, check_create_once=False)
    learner = RecipeLearner(store, recipe.learners[0].learner_id, log=lambda _: None, publish_in_background=True)
    joined = store.store.wire_counts()
    assert joined.puts == 0 and joined.bytes_down > 0
    for _ in range(4):
        learner.step()
        learner.flush()
        learner.store.sibling().read_global_fragment(0, 0)  # a fetcher-like read on a sibling handle
    records = sorted(store.list_contributions(0, 0, [learner.learner_id]).records
                     + store.list_contributions(1, 0, [learner.learner_id]).records, key=lambda r: r.info["step"])
    assert [r.info["step"] for r in records] == [1, 2, 3, 4]
    sent = 0
    for k, rec in enumerate(records):
        reported = WireCounts(**{f: rec.info["wire"][f] for f in WireCounts().to_dict()})
        assert reported.puts == 2 * k and reported.bytes_up == sent
        assert reported.gets == joined.gets + k  # one fragment read after each step before it
        assert rec.info["wire"]["tokens"] == (k + 1) * 256
        sent += rec.payload.nbytes + len(store.store.get(rec.key))


@pytest.mark.parametrize("inner_steps,codec,downlink", [(2, "fp32", "fp32"), (4, "int4", "fp32"), (4, "int4", "int4")],
                         ids=["H=P-fp32", "H=2P-int4-up", "H=2P-int4-both"])
def test_measured_bytes_per_token_match_the_plan(tmp_path: Path, inner_steps: int, codec: str, downlink: str) -> None:
    config, recipe = smoke_recipe(3, max_rounds=10_000)
    config = dataclasses.replace(config, inner_steps=inner_steps, compression=codec, downlink_compression=downlink)
    url = to_url(str(tmp_path / "run"))
    store = create_run(url, config, recipe)
    params = store.read_global_state(0).params
    tokens_per_step = recipe.learners[0].batch_size * 64  # every smoke learner: batch 4, context 64
    assert {s.batch_size for s in recipe.learners} == {recipe.learners[0].batch_size}

    result = run_virtual(SynchronizerStore.open(url), token_budget=STEPS * tokens_per_step * config.num_learners,
                         own_stores=True)
    planned = plan_wire(config, params=sum(t.numel() for t in params.values()), tokens_per_step=tokens_per_step,
                        tensors=len(params))

    learners = [w for who, w in result.wire.items() if who != "synchronizer"]
    assert len(learners) == config.num_learners and result.tokens == STEPS * tokens_per_step * config.num_learners
    total = sum(learners, WireCounts())
    assert total.bytes_up / result.tokens == pytest.approx(planned.up_bytes_per_token, rel=0.10)
    assert total.bytes_down / result.tokens == pytest.approx(planned.down_bytes_per_token, rel=0.10)
    # Each publish is two PUTs (payload, record): P / H publishes per step, nothing else goes up.
    assert total.puts == config.num_learners * STEPS * config.num_fragments // inner_steps * 2
    sync = result.wire["synchronizer"]
    assert sync.bytes_up / result.rounds == pytest.approx(planned.sync_up_bytes_per_round, rel=0.10)
    assert sync.bytes_down / result.rounds == pytest.approx(planned.sync_down_bytes_per_round, rel=0.10)
    # Joining fetched the whole model once per learner: not a per-round cost.
    fp32_model = 4 * sum(t.numel() for t in params.values())
    assert all(w.bytes_down >= fp32_model for who, w in result.join_wire.items() if who != "synchronizer")
    # What the bucket tells `atoll status`: every round's synchronizer traffic, and the learners'
    # up to their last merged report (what they sent after it has no commit yet).
    goodput = GoodputTracker(RunReader.open(url, read_only=True))
    goodput.update()
    tracker = goodput.wire
    # Tokens merged are the tokens trained that reached the model: the merged-work share (equal step times).
    share = goodput.report().merged_share
    assert share is not None and tracker.tokens_merged / tracker.learner_tokens == pytest.approx(share, rel=0.15)
    rest = sync - tracker.synchronizer
    assert min(rest.to_dict().values()) >= 0 and rest.puts >= 3  # the last commit's writes are in no round
    joined = sum((w for who, w in result.join_wire.items() if who != "synchronizer"), WireCounts())
    unreported = total + joined - tracker.learners
    assert min(unreported.to_dict().values()) >= 0 and tracker.learners.puts >= total.puts - 2 * config.num_learners
    lines = run_status(RunReader.open(url, read_only=True))
    assert f"learners ({config.num_learners})" in "\n".join(lines) and any(x.startswith("synchronizer") for x in lines)


def test_the_link_planner_counts_the_fp32_downlink_learners_fetch() -> None:
    """``plan`` and ``plan_wire`` agree on the payloads: an int4 delta up, the fp32 fragment down."""
    config = dataclasses.replace(smoke_recipe(3)[0], num_fragments=4, inner_steps=8, compression="int4")
    link = plan(params=4_000_000, num_fragments=4, inner_steps=8, overlap_steps=1, precision="int4", step_s=1.0,
                wan_gbps=1.0)
    wire = plan_wire(config, params=4_000_000, tokens_per_step=256, tensors=4)
    assert link.download_bytes_per_round == 4_000_000
    assert wire.fragment_bytes - link.download_bytes_per_round == 8 + 70 + 24  # safetensors header, one tensor
    assert wire.payload_bytes - link.upload_bytes_per_round == 8 + 2 * (70 + 24)  # int4: codes and scales
    assert wire.up_bytes_per_token == pytest.approx(wire.up_bytes_per_round / (2 * 256))
    assert wire.save_bytes_per_token == 0.0
    saving = plan_wire(config, params=4_000_000, tokens_per_step=256, tensors=4, save_every_steps=50)
    assert saving.save_bytes == 2 * (4 * 4_000_000 + 8 + 4 * (70 + 24)) + 570  # two fp32 moments, one record
    assert saving.save_bytes_per_token == pytest.approx(saving.save_bytes / (50 * 256))
