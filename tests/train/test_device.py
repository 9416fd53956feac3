"""Devices: the device setting, bf16 autocast of the inner steps, one device-to-host copy per publish,
the synchronizer's merge device, and the inner step's options (fused AdamW, micro-batches, prefetch,
compile, progress lines). Runs on the CPU; the same code paths run unchanged on CUDA, and the tests
marked ``cuda`` run there (``pytest -m cuda``) and are skipped, with the reason, elsewhere."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import atoll.train.device as device_mod
import atoll.train.merge_device as merge_device_mod
from atoll.core.config import ConfigError
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.synchronize import FragmentContribution, synchronize_fragment
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.train.device import DeviceError, fragment_to_host, resolve_device
from atoll.train.inner import RecipeLearner
from atoll.train.merge_device import merge_on_device
from atoll.train.publisher import BackgroundOutbox
from atoll.train.recipe import InnerOptimConfig, LearnerSpec, Recipe, smoke_recipe
from atoll.train.run import create_run
from atoll.train.synchronizer import Synchronizer, SynchronizerOptions


def _expected_auto() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has neither CUDA nor MPS (it has neither in CI; on a GPU box too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: False)


def _run(root: Path, **learner_changes: object) -> LearnerStore:
    config, recipe = smoke_recipe(2, max_rounds=20)
    if learner_changes:
        recipe = recipe.replace(learners=tuple(
            LearnerSpec(**{**vars(s), **learner_changes}) for s in recipe.learners))  # type: ignore[arg-type]
    return LearnerStore.beside(create_run(to_url(str(root / "run")), config, recipe))


# -- the setting ----------------------------------------------------------------------------------

def test_cpu_and_auto_resolve_to_cpu_without_an_accelerator(no_accelerator: None) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu") and resolve_device("") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


def test_auto_prefers_cuda_then_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto").type == _expected_auto()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_cuda_without_cuda_names_the_knob(no_accelerator: None) -> None:
    with pytest.raises(DeviceError, match=r"--device='cuda' but CUDA is not available.*set --device to 'auto' or 'cpu'"):
        resolve_device("cuda", knob="--device")
    with pytest.raises(DeviceError, match="mps"):
        resolve_device("mps")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("gpu0")


def test_learner_device_comes_from_the_recipe_or_the_launch(tmp_path: Path, no_accelerator: None) -> None:
    store = _run(tmp_path, device="cuda")
    with pytest.raises(DeviceError, match=r"LearnerSpec.device of learner-0.*'cuda' but CUDA is not available"):
        RecipeLearner(store, "learner-0", log=lambda _: None)
    with pytest.raises(DeviceError, match=r"LearnerOptions.device, the learner flow's `device` parameter"):
        RecipeLearner(store, "learner-0", log=lambda _: None, device="cuda:0")
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, device="auto")  # the launch overrides the recipe
    assert learner.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in learner.model.parameters())


def test_recipe_validates_and_round_trips_the_device_fields() -> None:
    with pytest.raises(ConfigError, match="device"):
        LearnerSpec(learner_id="a", device="quantum")
    with pytest.raises(ConfigError, match="autocast"):
        LearnerSpec(learner_id="a", autocast="fp8")
    spec = LearnerSpec(learner_id="a", device="cuda:1", autocast="bf16")  # valid on any machine
    recipe = Recipe(learners=(spec,))
    assert Recipe.from_dict(recipe.to_dict()).learners[0] == spec
    # Runs written before these fields existed load with the defaults.
    old = recipe.to_dict()
    for s in old["learners"]:
        del s["device"], s["autocast"]
    assert Recipe.from_dict(old).learners[0].device == "auto"


# -- one copy per publish -----------------------------------------------------------------------

def test_fragment_to_host_is_one_copy_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = device_mod.copy_to_host
    monkeypatch.setattr(device_mod, "copy_to_host", lambda flat: calls.append(flat.numel()) or real(flat))
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "c": torch.randn(2, 2, 2, generator=g)}
    host = fragment_to_host(tensors)
    assert calls == [12 + 5 + 8]
    assert list(host) == ["a", "b", "c"]
    for n, t in tensors.items():
        assert host[n].shape == t.shape and host[n].is_contiguous() and torch.equal(host[n], t)
    assert len({h.untyped_storage().data_ptr() for h in host.values()}) == 1  # views of one host buffer
    with pytest.raises(ValueError, match="one dtype"):
        fragment_to_host({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)})


def test_fragment_delta_to_host_is_the_learner_delta_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.core.pseudograd import learner_delta
    from atoll.train.device import fragment_delta_to_host

    calls: list[int] = []
    real = device_mod.copy_to_host
    monkeypatch.setattr(device_mod, "copy_to_host", lambda flat: calls.append(flat.numel()) or real(flat))
    g = torch.Generator().manual_seed(1)
    base = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    local = {"b": torch.randn(5, generator=g), "a": torch.randn(3, 4, generator=g).bfloat16()}
    host = fragment_delta_to_host(base, local)
    want = learner_delta(base, local)
    assert calls == [17] and list(host) == ["a", "b"]
    for n in want:
        assert host[n].dtype == torch.float32 and torch.equal(host[n], want[n])
    assert len({h.untyped_storage().data_ptr() for h in host.values()}) == 1  # views of one host buffer
    with pytest.raises(ValueError, match="names differ"):
        fragment_delta_to_host(base, {"a": local["a"]})
    with pytest.raises(ValueError, match="shape of 'b'"):
        fragment_delta_to_host(base, {"a": local["a"], "b": torch.zeros(4)})


def test_each_publish_makes_exactly_one_device_to_host_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _run(tmp_path)
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, device="cpu")
    calls: list[int] = []
    real = device_mod.copy_to_host
    monkeypatch.setattr(device_mod, "copy_to_host", lambda flat: calls.append(flat.numel()) or real(flat))
    for _ in range(6):
        learner.step()
    assert learner.summary.published == 6  # H = P = 2: one fragment due every step
    sizes = [store.plan.fragment_numel(p) for p in (1, 0, 1, 0, 1, 0)]
    assert calls == sizes


# -- bf16 autocast ------------------------------------------------------------------------------

def test_bf16_autocast_trains_and_publishes_finite_fp32_deltas(tmp_path: Path) -> None:
    store = _run(tmp_path / "bf16")
    mixed = RecipeLearner(store, "learner-0", log=lambda _: None, autocast="bf16")
    ref = RecipeLearner(_run(tmp_path / "fp32"), "learner-0", log=lambda _: None)  # same start, same data, fp32
    for _ in range(8):
        mixed.step()
        ref.step()
    assert mixed.autocast == "bf16" and ref.autocast == ""
    assert all(math.isfinite(x) for x in mixed.summary.losses)
    assert mixed.summary.losses != ref.summary.losses  # autocast really ran in lower precision
    assert abs(mixed.summary.losses[-1] - ref.summary.losses[-1]) < 0.1  # ... and trains the same model
    assert mixed.summary.losses[-1] < mixed.summary.losses[0]
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in mixed.opt.state.values())
    records = store.list_contributions(0, {0}).records
    assert records and {r.learner_id for r in records} == {"learner-0"}
    contributions, bad = store.load_contributions(records)
    assert not bad
    for c in contributions:
        for t in c.delta.values():
            assert t.dtype == torch.float32 and bool(torch.isfinite(t).all())
        assert any(float(t.abs().max()) > 0 for t in c.delta.values())


def test_autocast_can_be_set_in_the_recipe(tmp_path: Path) -> None:
    store = _run(tmp_path, autocast="bf16")
    assert RecipeLearner(store, "learner-0", log=lambda _: None).autocast == "bf16"
    assert RecipeLearner(store, "learner-0", log=lambda _: None, autocast="").autocast == ""


# -- the synchronizer's merge device -------------------------------------------------------------

def _round_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    current = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    old = {n: t - 0.01 * torch.randn(t.shape, generator=g) for n, t in current.items()}
    contributions = [
        FragmentContribution(key=f"k{i}", learner_id=f"l{i}", base_version=3 if i else 2,
                             counters=Counters(c_steps=4 + i, c_tokens=100 * (4 + i)),
                             delta={n: 0.1 * torch.randn(t.shape, generator=g) for n, t in current.items()})
        for i in range(3)
    ]
    return current, {3: current, 2: old}, contributions


def test_merge_on_a_device_equals_the_cpu_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transfer path of merge_on_device, with the device copy stood in by a CPU clone (the
    code path a CUDA synchronizer takes; a CUDA machine runs it for real)."""
    current, bases, contributions = _round_inputs()
    momentum = {"momentum.w": torch.randn(16, 8), "momentum.b": torch.randn(8)}
    ref_opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    ref_opt.load_state_dict(momentum)
    ref = synchronize_fragment(current=current, bases=bases, contributions=contributions, optimizer=ref_opt)

    moved: list[int] = []

    def to_device(tensors, device):
        moved.append(len(tensors))
        return {n: t.clone() for n, t in tensors.items()}

    copies: list[int] = []
    real = device_mod.copy_to_host
    monkeypatch.setattr(merge_device_mod, "fragment_to_device", to_device)
    monkeypatch.setattr(device_mod, "copy_to_host", lambda flat: copies.append(flat.numel()) or real(flat))
    opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    opt.load_state_dict(momentum)
    out = merge_on_device(torch.device("cuda"), current=current, bases=bases, contributions=contributions,
                          optimizer=opt)
    assert ref is not None and out is not None
    assert moved and len(copies) == 3  # new params, update, momentum: one copy each
    for n in current:
        assert torch.equal(out.new_params[n], ref.new_params[n])
        assert torch.equal(opt.buffers[n], ref_opt.buffers[n]) and opt.buffers[n].device.type == "cpu"
    assert out.weights == ref.weights


def test_synchronizer_device_option(tmp_path: Path, no_accelerator: None) -> None:
    store = _run(tmp_path)
    sync = SynchronizerStore.beside(store)
    assert Synchronizer(sync).device == torch.device("cpu")  # default: cpu
    assert Synchronizer(sync, options=SynchronizerOptions(device="auto")).device == torch.device("cpu")
    with pytest.raises(DeviceError, match="SynchronizerOptions.device"):
        Synchronizer(sync, options=SynchronizerOptions(device="cuda"))


# -- publishing in the background -----------------------------------------------------------------

def test_background_publishing_writes_the_same_contributions(tmp_path: Path) -> None:
    stores = [_run(tmp_path / "sync"), _run(tmp_path / "background")]
    sync = RecipeLearner(stores[0], "learner-0", log=lambda _: None)
    background = RecipeLearner(stores[1], "learner-0", log=lambda _: None, publish_in_background=True)
    for _ in range(7):
        sync.step()
        background.step()
    background.flush()
    for p in (0, 1):
        a, b = (sorted((r.base_version, r.c_steps, r.c_tokens, r.payload.sha256, r.info["step"])
                       for r in s.list_contributions(p, {0}).records) for s in stores)
        assert a == b and len(a) >= 3


def test_a_failed_background_write_stops_the_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = RecipeLearner(_run(tmp_path), "learner-0", log=lambda _: None, publish_in_background=True)
    assert isinstance(learner.outbox, BackgroundOutbox)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("bucket unreachable")

    monkeypatch.setattr(learner.outbox.writer.store, "publish_contribution", broken)
    learner.step()  # submitted; the write fails in the background
    with pytest.raises(OSError, match="bucket unreachable"):
        learner.flush()
    with pytest.raises(OSError, match="bucket unreachable"):
        learner.step()


# -- the publish's delta: flat bases, reused host buffers -----------------------------------------

def test_flat_bases_give_the_same_delta_in_one_subtraction_and_reuse_the_buffer() -> None:
    from atoll.core.pseudograd import learner_delta
    from atoll.train.device import FlatFragment, flat_fragment_to_device, fragment_delta_to_host

    g = torch.Generator().manual_seed(2)
    plain = {"w": torch.randn(4, 3, generator=g), "norm": torch.randn(3, generator=g), "b": torch.randn(2, generator=g)}
    base = flat_fragment_to_device(plain, torch.device("cpu"))
    assert isinstance(base, FlatFragment) and list(base) == ["w", "norm", "b"]
    assert base.flat.numel() == 17 and all(torch.equal(base[n], plain[n]) for n in plain)
    assert base["w"].untyped_storage().data_ptr() == base.flat.untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="read-only"):
        base["w"] = torch.zeros(4, 3)
    local = {n: t + torch.randn(t.shape, generator=g) for n, t in plain.items()}
    want = learner_delta(plain, local)
    out = torch.full((17,), float("nan"))
    for _ in range(2):  # the same buffer again: overwritten, never accumulated
        host = fragment_delta_to_host(base, local, out=out)
        for n in want:
            assert torch.equal(host[n], want[n])
            assert host[n].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    # Local tensors of another dtype take the per-tensor path: the same values.
    mixed = dict(local, w=local["w"].bfloat16())
    host = fragment_delta_to_host(base, mixed, out=out)
    for n, t in learner_delta(plain, mixed).items():
        assert torch.equal(host[n], t)
    with pytest.raises(ValueError, match="out must be"):
        fragment_delta_to_host(base, local, out=torch.empty(16))
    with pytest.raises(ValueError, match="shape of 'b'"):
        fragment_delta_to_host(base, dict(local, b=torch.zeros(3)))


def test_background_publishes_reuse_their_host_buffers(tmp_path: Path) -> None:
    learner = RecipeLearner(_run(tmp_path), "learner-0", log=lambda _: None, publish_in_background=True)
    assert isinstance(learner.outbox, BackgroundOutbox)
    seen: set[int] = set()
    real = learner.outbox.buffers.take

    def take(numel: int) -> torch.Tensor | None:
        buffer = real(numel)
        if buffer is not None:
            seen.add(buffer.untyped_storage().data_ptr())
        return buffer

    learner.outbox.buffers.take = take  # type: ignore[method-assign]
    for _ in range(8):
        learner.step()
        learner.flush()  # each write done: its buffer is back before the next publish of that size
    assert learner.summary.published == 8 and 1 <= len(seen) <= 2  # one buffer per fragment size


def test_a_background_save_writes_the_state_of_its_step(tmp_path: Path) -> None:
    """The periodic save snapshots the optimizer state and writes it after the contributions
    submitted before it; the steps taken while it is written do not leak into it."""
    store = _run(tmp_path)
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, publish_in_background=True)
    for _ in range(3):
        learner.step()
    learner.user_state["epoch"] = 1
    want = {n: t.clone() for n, t in learner.opt.state[learner.params[next(iter(learner.params))]].items()}
    learner.save(background=True)
    learner.user_state["epoch"] = 2  # changed before the write: the save keeps 1
    for _ in range(3):
        learner.step()
    learner.flush()
    saved = store.load_learner_state("learner-0")
    assert saved is not None and saved.meta["step"] == 3 and saved.meta["user"] == {"epoch": 1}
    name = next(iter(learner.params))
    # The save is on the host; the live state on the learner's device (CUDA where there is one).
    assert torch.equal(saved.tensors[f"adamw.{name}.exp_avg"], want["exp_avg"].cpu())
    assert torch.equal(saved.tensors[f"adamw.{name}.exp_avg_sq"], want["exp_avg_sq"].cpu())
    # The contributions submitted before the save are in the bucket too.
    published = [r for p in (0, 1) for r in store.list_contributions(p, {0}).records]
    assert {r.info["step"] for r in published} >= {1, 2, 3}


# -- the inner step's options --------------------------------------------------------------------

def _learner(root: Path, name: str, *, inner: InnerOptimConfig | None = None, device: str = "cpu",
             **spec_changes: object) -> RecipeLearner:
    config, recipe = smoke_recipe(2, max_rounds=20)
    recipe = recipe.replace(learners=tuple(LearnerSpec(**{**vars(s), **spec_changes})  # type: ignore[arg-type]
                                           for s in recipe.learners), inner=inner or recipe.inner)
    store = LearnerStore.beside(create_run(to_url(str(root / name)), config, recipe))
    return RecipeLearner(store, "learner-0", log=lambda _: None, device=device)


def test_fused_adamw_where_the_device_has_it_and_its_state_survives_a_rejoin(tmp_path: Path) -> None:
    inner = InnerOptimConfig(lr=3e-3, warmup_steps=5, total_steps=200, fused=True)
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert inner.make(params).defaults.get("fused") is True  # torch has a CPU kernel too
    assert not InnerOptimConfig().make([torch.nn.Parameter(torch.zeros(3))]).defaults.get("fused")
    fused = _learner(tmp_path, "fused", inner=inner)
    plain = _learner(tmp_path, "plain")
    assert "fused AdamW" in fused.inner.describe() and "fused" not in plain.inner.describe()
    for _ in range(4):
        fused.step()
        plain.step()
    assert fused.summary.losses == pytest.approx(plain.summary.losses, rel=1e-4)  # the same math
    fused.save()
    back = RecipeLearner(fused.store, "learner-0", log=lambda _: None, device="cpu")
    assert back.summary.resumed_inner_state and back.step_count == 4
    p = back.params[next(iter(back.params))]
    want = fused.opt.state[fused.params[next(iter(fused.params))]]
    assert torch.equal(back.opt.state[p]["exp_avg"], want["exp_avg"])
    back.step()  # a fused step on the loaded state (its step counter where the kernel wants it)
    assert back.step_count == 5


def test_micro_batches_accumulate_to_the_same_step(tmp_path: Path) -> None:
    whole = _learner(tmp_path, "whole")
    micro = _learner(tmp_path, "micro", micro_batch=2)  # smoke batch 4: two passes of 2
    assert "micro-batches of 2" in micro.inner.describe()
    for _ in range(3):
        whole.step()
        micro.step()
    assert micro.summary.losses == pytest.approx(whole.summary.losses, rel=1e-5)
    assert micro.tokens_total == whole.tokens_total  # a step is still the whole batch
    for name, p in whole.params.items():
        torch.testing.assert_close(micro.params[name], p, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="micro_batch must be 0 or divide batch_size"):
        LearnerSpec(learner_id="a", batch_size=6, micro_batch=4)


def test_prefetch_trains_the_same_batches_and_saves_the_cursor_of_the_next_one(tmp_path: Path) -> None:
    plain = _learner(tmp_path, "plain")
    ahead = _learner(tmp_path, "ahead")
    assert not ahead.inner.prefetch  # on by default on CUDA only; the same path on the CPU here
    ahead.inner.prefetch = True
    for _ in range(5):
        plain.step()
        ahead.step()
    assert ahead.summary.losses == plain.summary.losses  # the same batches, in the same order
    assert ahead.inner._next is not None  # the sixth batch is drawn already ...
    assert ahead.inner.cursor() == plain.stream.state_dict() != ahead.stream.state_dict()  # ... not trained
    ahead.save()
    back = RecipeLearner(ahead.store, "learner-0", log=lambda _: None, device="cpu")
    x, _ = back.stream.next_batch(4)
    want, _ = plain.stream.next_batch(4)
    assert torch.equal(x, want)  # the rejoined learner trains on exactly the batch that was prefetched


def test_compile_is_off_on_the_cpu_unless_asked(tmp_path: Path) -> None:
    from atoll.train.inner import compile_model

    assert not _learner(tmp_path, "auto", compile="auto").inner.compiled
    model = torch.nn.Linear(2, 2)
    assert not compile_model(model, "off", torch.device("cuda"))
    assert not compile_model(model, "auto", torch.device("cpu"))
    with pytest.raises(ConfigError, match="compile must be one of"):
        LearnerSpec(learner_id="a", compile="yes")


def test_progress_lines_say_tokens_per_second_and_mfu_where_the_peak_is_known(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.train.speed import PEAK_TFLOPS_ENV, RateMeter, flops_per_token, peak_tflops

    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    learner = _learner(tmp_path, "run")
    for _ in range(3):
        learner.step()
    line = learner.progress_line()
    assert "tok/s" in line and ("MFU" in line) == (peak_tflops(learner.device) is not None)
    cpu = torch.device("cpu")
    assert peak_tflops(cpu) is None and peak_tflops(cpu, 100.0) == 100.0
    clock, tokens = [0.0], [0]
    meter = RateMeter(cpu, flops_per_token=1e9, tokens=lambda: tokens[0], clock=lambda: clock[0])
    clock[0], tokens[0] = 2.0, 20_000
    assert meter.line() == ", 10,000 tok/s"  # no MFU on a CPU, no device memory
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "100")
    meter = RateMeter(cpu, flops_per_token=1e9, tokens=lambda: tokens[0], clock=lambda: clock[0], chips=2)
    clock[0], tokens[0] = 3.0, 30_000
    assert meter.line() == ", 10,000 tok/s, MFU 5.0%"  # 1e13 FLOP/s of 2 x 100 TFLOP/s
    gpt = learner.model
    cfg = gpt.config  # type: ignore[union-attr]
    n = sum(p.numel() for p in gpt.parameters())
    assert flops_per_token(gpt, 64) == 6 * n + 12 * cfg.num_layers * cfg.embed_dim * 64
    assert flops_per_token(torch.nn.Linear(3, 3), 64) == 6 * 12


# -- on a CUDA device (skipped elsewhere, with the reason) ----------------------------------------

@pytest.mark.cuda
def test_cuda_learner_trains_in_bf16_with_fused_adamw_prefetch_and_micro_batches(tmp_path: Path) -> None:
    inner = InnerOptimConfig(lr=3e-3, warmup_steps=5, total_steps=200, fused=True)
    learner = _learner(tmp_path, "cuda", inner=inner, device="cuda", autocast="bf16", micro_batch=2)
    assert learner.device.type == "cuda" and learner.inner.prefetch and learner.opt.defaults.get("fused")
    for _ in range(6):
        learner.step()
    assert all(math.isfinite(x) for x in learner.summary.losses) and learner.summary.published == 6
    assert "peak mem" in learner.progress_line()
    learner.save()
    back = RecipeLearner(learner.store, "learner-0", log=lambda _: None, device="cuda")
    assert back.step_count == 6 and back.summary.resumed_inner_state
    back.step()


@pytest.mark.cuda
def test_cuda_merge_equals_the_cpu_merge() -> None:
    current, bases, contributions = _round_inputs()
    ref_opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    ref = synchronize_fragment(current=current, bases=bases, contributions=contributions, optimizer=ref_opt)
    opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    out = merge_on_device(torch.device("cuda"), current=current, bases=bases, contributions=contributions,
                          optimizer=opt)
    assert ref is not None and out is not None
    for n in current:
        torch.testing.assert_close(out.new_params[n].cpu(), ref.new_params[n], rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_contributions_are_decoded_on_the_device(tmp_path: Path) -> None:
    """The encoded bytes go to the device and decode there, to the host decode's values bit for bit."""
    store = _run(tmp_path)
    learner = RecipeLearner(store, "learner-0", log=lambda _: None)
    for _ in range(2):
        learner.step()
    records = store.list_contributions(0, {0}).records + store.list_contributions(1, {0}).records
    assert records
    on_host, bad = store.load_contributions(records)
    on_cuda, bad_cuda = store.load_contributions(records, device=torch.device("cuda"))
    assert not bad and not bad_cuda
    for h, c in zip(on_host, on_cuda, strict=True):
        for n, t in h.delta.items():
            assert c.delta[n].device.type == "cuda" and torch.equal(c.delta[n].cpu().view(torch.int32),
                                                                     t.view(torch.int32))


@pytest.mark.cuda
def test_cuda_synchronizer_merges_rounds_of_cuda_learners(tmp_path: Path) -> None:
    store = _run(tmp_path, device="cuda")
    learners = [RecipeLearner(store, f"learner-{i}", log=lambda _: None) for i in range(2)]
    for _ in range(4):
        for learner in learners:
            learner.step()
    sync = Synchronizer(SynchronizerStore.beside(store), options=SynchronizerOptions(device="cuda"))
    assert sync.device.type == "cuda"
    deadline = time.monotonic() + 30
    while store.latest_round() < 2 and time.monotonic() < deadline:  # the grace window runs on the clock
        sync.tick()
        time.sleep(0.05)
    assert store.latest_round() >= 2
    record = store.read_commit(2)
    assert record is not None and record.accepted
