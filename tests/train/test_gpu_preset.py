"""The gpu recipe preset (a ~100 M GPT for GPUs) and benchmarks/gpu_check.py on a machine without CUDA."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from atoll.core.config import ConfigError
from atoll.storage import LearnerStore
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner
from atoll.train.local import main as local_main
from atoll.train.model import count_parameters
from atoll.train.recipe import RECIPE_PRESETS, DataSpec, LearnerSpec, Recipe, gpu_recipe
from atoll.train.run import create_run

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_preset_is_a_100m_class_gpt_in_bf16_with_fused_adamw_int4_and_h_above_p() -> None:
    config, recipe = gpu_recipe()
    assert RECIPE_PRESETS["gpu"] is gpu_recipe
    with torch.device("meta"):
        model = recipe.model_factory()()
    assert 80e6 < count_parameters(model) < 130e6  # 12 x 768, context 1024, bytes: ~86 M
    assert recipe.context_for(model) == 1024 and recipe.data.kind == "stdlib"
    assert config.inner_steps >= 32 and config.num_fragments == 8 and config.inner_steps % config.num_fragments == 0
    assert config.compression == config.downlink_compression == "int4"
    assert recipe.inner.fused and all(s.autocast == "bf16" and s.compile == "auto" for s in recipe.learners)
    assert Recipe.from_dict(recipe.to_dict()) == recipe  # stored in run.json and read back as it was
    _, tokens = gpu_recipe(2, train_url="/d/train.bin", val_url="/d/val.bin", vocab_size=50257)
    assert tokens.data == DataSpec(kind="tokens", train_url="/d/train.bin", val_url="/d/val.bin")
    assert isinstance(tokens.model, dict) and tokens.model["vocab_size"] == 50257 and tokens.model["tie_embeddings"]
    with pytest.raises(ConfigError, match="vocab_size"):
        gpu_recipe(train_url="/d/train.bin", val_url="/d/val.bin")


def test_the_gpu_preset_trains_two_steps_on_the_cpu_with_a_tiny_override(tmp_path: Path) -> None:
    config, recipe = gpu_recipe(2)
    tiny = {**dict(recipe.model), "num_layers": 1, "embed_dim": 32, "num_heads": 2, "context_tokens": 32}  # type: ignore[arg-type]
    recipe = recipe.replace(model=tiny, data=DataSpec(max_corpus_mb=2.0),
                            learners=tuple(LearnerSpec(**{**vars(s), "batch_size": 4, "micro_batch": 2})
                                           for s in recipe.learners))
    store = LearnerStore.beside(create_run(to_url(str(tmp_path / "run")), config, recipe))
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, device="cpu")
    assert not learner.inner.compiled  # compile="auto": not on a CPU
    assert learner.opt.defaults.get("fused") and learner.autocast == "bf16"
    learner.step()
    learner.step()
    assert learner.step_count == 2 and all(torch.isfinite(torch.tensor(learner.summary.losses)))
    assert "tok/s" in learner.progress_line()


def test_the_gpu_preset_is_listed_where_presets_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        local_main(["run", "--help"])
    assert "gpu" in capsys.readouterr().out
    from atoll.runs.manage import _preset

    config, recipe = _preset("gpu", 2, 5)
    assert config.num_learners == 2 and recipe.max_rounds == 5


def test_gpu_check_says_there_is_no_cuda_and_runs_nothing_without_prefect_or_pydantic(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported afresh with Prefect, pydantic and the cloud clients blocked: nothing on its path needs them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    saved = dict(sys.modules)
    try:
        for name in list(sys.modules):
            if name == "atoll" or name.startswith("atoll.") or name == "gpu_check" or name == "throughput":
                del sys.modules[name]
        for blocked in ("prefect", "pydantic", "s3fs", "boto3", "gcsfs"):
            sys.modules[blocked] = None  # type: ignore[assignment]
        sys.path.insert(0, str(ROOT / "benchmarks"))
        gpu_check = importlib.import_module("gpu_check")
        importlib.import_module("throughput")  # its (a) section runs there
        for module in ("atoll.train.local", "atoll.runs.goodput", "atoll.runs.contributions", "atoll.train.speed"):
            importlib.import_module(module)  # the CUDA path's imports
        assert gpu_check.main([]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.clear()
        sys.modules.update(saved)
    out = capsys.readouterr().out
    assert "no CUDA device on this machine" in out and "nothing was run" in out
