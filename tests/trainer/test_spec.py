"""JobSpec: auto resolution, validation, YAML loading, construction from a job row; model registry."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.model.catalog import UnknownModelError, default_learning_rate, model_max_length, resolve_model
from trainer.spec import Hyperparameters, JobSpec, load_spec, spec_from_job


def test_auto_resolution() -> None:
    r = Hyperparameters().resolve(64, base_learning_rate=3e-3, model_max_length=1024)
    assert (r.n_epochs, r.batch_size, r.steps_per_epoch, r.total_steps) == (3, 4, 16, 48)
    assert r.learning_rate == 3e-3 and r.warmup_steps == 2 and r.max_seq_length == 1024
    assert r.eval_every is None and r.checkpoint_every == 10
    small = Hyperparameters().resolve(10, base_learning_rate=1.0, has_validation=True)
    assert small.n_epochs == 10 and small.eval_every is not None
    big = Hyperparameters().resolve(20_000, base_learning_rate=1.0)
    assert big.n_epochs == 1 and big.batch_size == 32 and big.max_seq_length == 2048


def test_explicit_values_and_schedule() -> None:
    h = Hyperparameters(
        n_epochs=2,
        batch_size=100,
        learning_rate=1e-3,
        learning_rate_multiplier=2.0,
        warmup=4,
        max_steps=10,
        eval_every=0,
        checkpoint_every=3,
        lr_scheduler="linear",
        min_lr_ratio=0.0,
    )
    r = h.resolve(30, base_learning_rate=5.0)
    assert r.batch_size == 30 and r.total_steps == 2 and r.learning_rate == pytest.approx(2e-3)
    assert r.eval_every is None and r.warmup_steps == 2
    r = Hyperparameters(warmup=0.5, n_epochs=3, learning_rate=1.0, min_lr_ratio=0.0, batch_size=1).resolve(
        8, base_learning_rate=1
    )
    lrs = [r.lr_at(s) for s in range(r.total_steps)]
    assert r.warmup_steps == 12 and lrs[0] == pytest.approx(1 / 12) and lrs[11] == pytest.approx(1.0)
    assert lrs[-1] < 0.05 and all(a >= b for a, b in itertools.pairwise(lrs[11:]))


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_epochs", 0),
        ("batch_size", -1),
        ("learning_rate", 0.0),
        ("warmup", 1.5),
        ("warmup", -2),
        ("n_epochs", "many"),
    ],
)
def test_bad_hyperparameters(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as ei:
        Hyperparameters(**{field: value})
    assert ei.value.errors()[0]["loc"][0] == field


def test_engine_settings() -> None:
    spec = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"mode": "offload", "topk_ratio": 0.2})
    cfg = spec.engine.engine_config(0.5)
    assert cfg.mode == "offload" and cfg.lr == 0.5 and cfg.topk_ratio == 0.2
    default = JobSpec(model="tiny-llama", training_file="t.jsonl").engine
    assert default.mode == "auto" and default.engine_config(0.5, mode="device").mode == "device"
    for bad, loc in [
        ({"lr": 1e-3}, ("engine", "lr")),
        ({"mode": "gpu"}, ("engine", "mode")),
        ({"bogus": 1}, ("engine", "bogus")),
    ]:
        with pytest.raises(ValidationError) as ei:
            JobSpec(model="tiny-llama", training_file="t.jsonl", engine=bad)
        assert ei.value.errors()[0]["loc"] == loc


def test_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"unknown model 'gpt-17'.*tiny-llama"):
        resolve_model("gpt-17")
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path))  # a directory without config.json
    for unusable_path in ("x" * 5000, "bad\x00name"):  # too long for the OS, or with a NUL byte
        with pytest.raises(UnknownModelError):
            resolve_model(unusable_path)
    with pytest.raises(ValidationError) as ei:
        JobSpec(model="gpt-17", training_file="t.jsonl")
    assert ei.value.errors()[0]["loc"] == ("model",) and "unknown model 'gpt-17'" in str(ei.value)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 777}')
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert model_max_length(str(tmp_path)) == 777 and default_learning_rate(str(tmp_path), lora=True) == 2e-4
    assert default_learning_rate("tiny-llama", lora=False) == 3e-3


def test_load_spec_resolves_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "specs"
    d.mkdir()
    (d / "job.yaml").write_text(
        "model: tiny-llama\ntraining_file: data/train.jsonl\nhyperparameters: {n_epochs: 2}\n"
    )
    monkeypatch.chdir(tmp_path)
    spec = load_spec(d / "job.yaml")
    assert spec.training_file == d / "data" / "train.jsonl"
    assert spec.output_dir == tmp_path / "runs" / "job" and spec.hyperparameters.n_epochs == 2
    assert load_spec(d / "job.yaml", output_dir="out").output_dir == tmp_path / "out"


def test_model_engine_defaults_fill_only_the_gaps(tmp_path: Path) -> None:
    from offload.config import EngineConfig
    from trainer.model.catalog import TINY_LLAMA_ZENFLOW

    plain = EngineConfig()
    tiny = JobSpec(model="tiny-llama", training_file="t.jsonl").engine
    assert {k: getattr(tiny, k) for k in TINY_LLAMA_ZENFLOW} == TINY_LLAMA_ZENFLOW
    assert tiny.topk_ratio != plain.topk_ratio  # the built-in's measured settings, not the paper's
    given = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"topk_ratio": 0.5}).engine
    assert given.topk_ratio == 0.5 and given.update_interval == 1 and given.full_warm_up_rounds == 16
    # update_interval 4 does not fit the default select_interval 1: that default is left out, not refused
    window = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"update_interval": 4}).engine
    assert window.update_interval == 4 and window.select_interval == plain.select_interval
    assert window.topk_ratio == 0.25
    # a local checkpoint and small-llama (no measured settings) get EngineConfig's defaults
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for model in (str(tmp_path), "small-llama"):
        eng = JobSpec(model=model, training_file="t.jsonl").engine
        assert (eng.topk_ratio, eng.update_interval, eng.select_interval) == (
            plain.topk_ratio,
            plain.update_interval,
            plain.select_interval,
        )
    # the job's own bad value is still reported at its field
    with pytest.raises(ValidationError) as ei:
        JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"topk_ratio": 2})
    assert ei.value.errors()[0]["loc"] == ("engine", "topk_ratio")


def test_sample_spec_is_valid() -> None:
    from trainer.samples import SPEC_FILE, TRAIN_FILE

    spec = load_spec(SPEC_FILE, output_dir="/tmp/x")
    assert spec.training_file == TRAIN_FILE and spec.model == "tiny-llama"
    # the sample spells out the engine settings tiny-llama jobs get by default (they must agree)
    from trainer.model.catalog import TINY_LLAMA_ZENFLOW

    assert {k: getattr(spec.engine, k) for k in TINY_LLAMA_ZENFLOW} == TINY_LLAMA_ZENFLOW


def test_spec_from_job_row_values(tmp_path: Path) -> None:
    spec = spec_from_job(
        model="tiny-llama",
        training_file=tmp_path / "t.jsonl",
        validation_file=None,
        hyperparameters={"n_epochs": 2, "seed": 1, "lora": {"r": 4}},
        engine={"mode": "device"},
        seed=7,
        output_dir=tmp_path / "out",
    )
    assert spec.hyperparameters.seed == 7 and spec.lora is not None and spec.lora.r == 4
    assert spec.engine.mode == "device" and spec.validation_file is None


def test_light_imports() -> None:
    """The API imports these at request time: they must not pull in torch."""
    import subprocess

    code = (
        "import sys, trainer.spec, trainer.data.dataset, trainer.model.catalog, worker, worker.broker, "
        "worker.task, worker.reaper, worker.job.runner, trainer.events, trainer.run.checkpoint; "
        "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_light_imports_training_library() -> None:
    """The training run's modules import torch, transformers and peft only inside their functions."""
    import subprocess

    code = (
        "import sys, trainer.run.loop, trainer.data.batching, trainer.model.lora, trainer.run.checkpoint, trainer.events, trainer.cli; "
        "sys.exit(1 if {'torch', 'transformers', 'peft'} & set(sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
