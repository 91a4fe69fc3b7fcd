"""JobSpec: validation, YAML loading, construction from a stored request; model registry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract.hyperparameters import HyperparametersRequest
from contract.job import JobRequest
from trainer.model.catalog import UnknownModelError, default_learning_rate, find_model, model_max_length
from trainer.spec import JobSpec, load_spec, spec_of_request


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
        HyperparametersRequest(**{field: value})
    assert ei.value.errors()[0]["loc"][0] == field


def test_engine_request_is_the_public_settings_only() -> None:
    spec = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"mode": "offload", "topk_ratio": 0.2})
    assert spec.engine.mode == "offload" and spec.engine.topk_ratio == 0.2
    assert spec.engine.model_fields_set == {"mode", "topk_ratio"}
    assert JobSpec(model="tiny-llama", training_file="t.jsonl").engine.mode == "auto"
    for bad, loc in [
        ({"lr": 1e-3}, ("engine", "lr")),
        ({"mode": "gpu"}, ("engine", "mode")),
        ({"bogus": 1}, ("engine", "bogus")),
        ({"cpu_chunk_elements": 1 << 20}, ("engine", "cpu_chunk_elements")),  # a worker's tuning
        ({"landing_buffers": False}, ("engine", "landing_buffers")),  # the plan's choice
    ]:
        with pytest.raises(ValidationError) as ei:
            JobSpec(model="tiny-llama", training_file="t.jsonl", engine=bad)
        assert ei.value.errors()[0]["loc"] == loc


def test_engine_tuning_is_checked_by_the_engine() -> None:
    ok = JobSpec(model="tiny-llama", training_file="t.jsonl", engine_tuning={"cpu_threads": 2})
    assert ok.engine_tuning == {"cpu_threads": 2}
    for bad in ({"topk_ratio": 0.5}, {"cpu_threads": 0}):
        with pytest.raises(ValidationError) as ei:
            JobSpec(model="tiny-llama", training_file="t.jsonl", engine_tuning=bad)
        assert ei.value.errors()[0]["loc"][:1] == ("engine_tuning",)


def test_window_policies_take_their_former_spelling() -> None:
    engine = JobSpec(
        model="tiny-llama",
        training_file="t.jsonl",
        engine={"update_interval": "auto", "select_interval": "auto"},
    ).engine
    assert (engine.update_interval, engine.select_interval) == ("adaptive", "epoch")


def test_dpo_in_hyperparameters_is_the_method(tmp_path: Path) -> None:
    spec = JobSpec(
        model="tiny-llama", training_file="t.jsonl", hyperparameters={"n_epochs": 2, "dpo": {"beta": 0.2}}
    )
    assert spec.method.type == "dpo" and spec.dpo is not None and spec.dpo.beta == 0.2
    assert spec.hyperparameters.model_fields_set == {"n_epochs"}
    with pytest.raises(ValidationError) as ei:
        JobSpec(
            model="tiny-llama",
            training_file="t.jsonl",
            method={"type": "dpo"},
            hyperparameters={"packing": True},
        )
    assert ei.value.errors()[0]["loc"] == ("hyperparameters", "packing")


def test_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"unknown model 'gpt-17'.*tiny-llama"):
        find_model("gpt-17")
    with pytest.raises(UnknownModelError):
        find_model(str(tmp_path))  # a directory without config.json
    for unusable_path in ("x" * 5000, "bad\x00name"):  # too long for the OS, or with a NUL byte
        with pytest.raises(UnknownModelError):
            find_model(unusable_path)
    with pytest.raises(ValidationError) as ei:
        JobSpec(model="gpt-17", training_file="t.jsonl")
    assert ei.value.errors()[0]["loc"] == ("model",) and "unknown model 'gpt-17'" in str(ei.value)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 777}')
    assert find_model(str(tmp_path)) == tmp_path.resolve()
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


def test_sample_spec_is_valid() -> None:
    from trainer.samples import SPEC_FILE, TRAIN_FILE

    spec = load_spec(SPEC_FILE, output_dir="/tmp/x")
    assert spec.training_file == TRAIN_FILE and spec.model == "tiny-llama"
    # the sample spells out the engine settings tiny-llama jobs get by default (they must agree)
    from trainer.model.catalog import TINY_LLAMA_ZENFLOW

    assert {k: getattr(spec.engine, k) for k in TINY_LLAMA_ZENFLOW} == TINY_LLAMA_ZENFLOW


def test_spec_of_a_stored_request(tmp_path: Path) -> None:
    request = JobRequest.model_validate(
        {
            "model": "ft:tiny-llama:team:x:ftjob-1",
            "training_file": "file-1",
            "method": {"type": "dpo"},
            "hyperparameters": {"n_epochs": 2, "lora": {"r": 4}},
            "engine": {"mode": "device"},
        }
    )
    spec = spec_of_request(
        request,
        model="tiny-llama",
        training_file=tmp_path / "t.jsonl",
        validation_file=None,
        output_dir=tmp_path,
    )
    assert spec.lora is not None and spec.lora.r == 4 and spec.method.type == "dpo"
    assert spec.engine.mode == "device" and spec.validation_file is None
    # what the request left unset stays unset, so its resolution can say where the value came from
    assert (
        spec.hyperparameters.model_fields_set == {"n_epochs", "lora"}
        and "resources" not in spec.model_fields_set
    )
    assert spec.request().model_dump(exclude_unset=True, exclude={"training_file", "model"})["engine"] == {
        "mode": "device"
    }


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
