"""Bounds of a job's inputs without services: the engine's fields (offload.config), the hard bounds of
the spec, and the service's configurable limits with the checks of values that would only fail once
the job runs (trainer.limits.limit_errors: totals, learning rate, LoRA target modules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from contract.hyperparameters import HyperparametersRequest as Hyperparameters
from contract.values import MAX_COUNT
from offload.config import EngineConfig
from trainer.limits import JobLimits, limit_errors
from trainer.resolve import resolve_hyperparameters
from trainer.spec import JobSpec


def _locs(exc: ValidationError) -> set[tuple[Any, ...]]:
    return {tuple(p for p in e["loc"] if p not in ("int", "float")) for e in exc.errors()}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("update_interval", 10**9),
        ("select_interval", 10**9),
        ("max_update_interval", 10**9),
        ("select_interval_fallback", 10**9),
        ("full_warm_up_rounds", 2**40),
        ("cpu_threads", 10**6),
        ("cpu_chunk_elements", 2**64),
        ("weight_decay", 1e9),
        ("max_grad_norm", 1e300),
        ("eps", 2.0),
        ("lr", float("inf")),
        ("topk_ratio", float("nan")),
        ("update_interval", True),
        ("full_warm_up_rounds", True),
    ],
)
def test_engine_fields_are_bounded(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig(**{field: value})
    assert _locs(info.value) == {(field,)}, info.value.errors()


def test_engine_bounds_keep_the_documented_defaults_and_auto() -> None:
    cfg = EngineConfig(update_interval="auto", select_interval=10_000_000, max_update_interval=10_000_000)
    assert cfg.update_interval == "adaptive" and EngineConfig().update_interval == 4
    with pytest.raises(ValidationError) as info:
        EngineConfig(betas=(0.9, float("inf")))
    assert ("betas", 1) in {tuple(e["loc"]) for e in info.value.errors()}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_epochs", MAX_COUNT + 1),
        ("batch_size", 2**64),
        ("max_seq_length", 2**40),
        ("max_steps", 2**63),
        ("checkpoint_every", 2**31),
        ("eval_every", 2**31),
        ("warmup", 2**31),
        ("learning_rate", float("inf")),
        ("learning_rate_multiplier", float("nan")),
        ("seed", -1),
        ("max_steps", True),
    ],
)
def test_hyperparameters_have_hard_bounds(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        Hyperparameters(**{field: value})
    assert {loc[0] for loc in _locs(info.value)} == {field}, info.value.errors()


def test_resolve_refuses_more_steps_than_a_job_row_holds() -> None:
    with pytest.raises(ValueError, match="more than a job can run"):
        resolve_hyperparameters(_spec(n_epochs=MAX_COUNT, batch_size=1), 10)


def _spec(model: str = "tiny-llama", **hp: Any) -> Any:
    return JobSpec(
        model=model, training_file="train.jsonl", hyperparameters={**hp, "seed": 1}, output_dir="out"
    )


TIGHT = JobLimits(
    max_n_epochs=50,
    max_batch_size=64,
    max_seq_length=1024,
    max_total_steps=200,
    max_total_tokens=200_000,
    max_learning_rate=0.5,
    max_lora_rank=16,
)


@pytest.mark.parametrize(
    ("hp", "num_examples", "loc", "words"),
    [
        ({"n_epochs": 51}, 8, ("hyperparameters", "n_epochs"), "at most 50"),
        ({"batch_size": 65}, 8, ("hyperparameters", "batch_size"), "at most 64"),
        ({"max_seq_length": 2000}, 8, ("hyperparameters", "max_seq_length"), "at most 1,024 on this server"),
        ({"max_seq_length": 1}, 8, ("hyperparameters", "max_seq_length"), "at least 32"),
        ({"max_steps": 201}, 8, ("hyperparameters", "max_steps"), "at most 200"),
        ({"warmup": 201}, 8, ("hyperparameters", "warmup"), "at most 200"),
        ({"eval_every": 201}, 8, ("hyperparameters", "eval_every"), "at most 200"),
        ({"checkpoint_every": 201}, 8, ("hyperparameters", "checkpoint_every"), "at most 200"),
        ({"learning_rate": 1e300}, 8, ("hyperparameters", "learning_rate"), "at most 0.5"),
        (
            {"learning_rate_multiplier": 1e300},
            8,
            ("hyperparameters", "learning_rate_multiplier"),
            "x multiplier",
        ),
        ({"learning_rate_multiplier": 200}, 8, ("hyperparameters", "learning_rate_multiplier"), "= 0.6"),
        ({"lora": {"r": 17}}, 8, ("hyperparameters", "lora", "r"), "at most 16"),
        # Known only once the data is counted: 40 epochs x 8 steps of one example.
        ({"n_epochs": 40, "batch_size": 1}, 8, ("hyperparameters", "n_epochs"), "320 training steps"),
        (
            {"n_epochs": 40, "batch_size": 1, "max_steps": 250},
            8,
            ("hyperparameters", "max_steps"),
            "at most 200",
        ),
        # 50 steps x batch 8 x 512 positions = 204,800 > 200,000.
        (
            {"n_epochs": 50, "batch_size": 8, "max_seq_length": 512},
            8,
            ("hyperparameters", "max_seq_length"),
            "204,800 token positions",
        ),
    ],
)
def test_limit_errors_name_the_field(
    hp: dict[str, Any], num_examples: int, loc: tuple[str, ...], words: str
) -> None:
    lora = hp.pop("lora", None)
    errors = limit_errors(_spec(**hp, **({"lora": lora} if lora else {})), TIGHT, num_examples=num_examples)
    assert [e.loc for e in errors] == [loc], errors
    assert words in errors[0].message


def test_auto_sequence_length_over_the_limit_asks_for_a_value() -> None:
    errors = limit_errors(_spec(), JobLimits(max_seq_length=512), num_examples=8)
    assert [e.loc for e in errors] == [("hyperparameters", "max_seq_length")]
    assert "resolves to 1024, over this server's 512" in errors[0].message


def test_limits_pass_ordinary_jobs_and_are_the_settings_defaults() -> None:
    from store.settings import Settings

    assert (
        limit_errors(_spec(n_epochs=3, batch_size=4, max_seq_length=128), JobLimits(), num_examples=1000)
        == []
    )
    assert (
        limit_errors(_spec(lora={"target_modules": ["q_proj", "v_proj"], "r": 8}), TIGHT, num_examples=8)
        == []
    )
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert JobLimits(**{name: getattr(settings, name) for name in JobLimits.model_fields}) == JobLimits()


def test_lora_target_modules_are_matched_against_the_model(tmp_path: Path) -> None:
    """A Llama-style local checkpoint (config.json only: the check builds it on the meta device)."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    good = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (
        limit_errors(_spec(str(tmp_path), lora={"target_modules": good}), JobLimits(), num_examples=8) == []
    )
    errors = limit_errors(
        _spec(str(tmp_path), lora={"target_modules": ["q_proj", "query", "mlp"]}), JobLimits()
    )
    assert [e.loc for e in errors] == [("hyperparameters", "lora", "target_modules")]
    assert "'query' matches no module" in errors[0].message and "q_proj" in errors[0].message
    assert "'mlp' matches LlamaMLP modules, which LoRA cannot adapt" in errors[0].message
    # Over this model's own maximum sequence length (256), under the server's.
    errors = limit_errors(_spec(str(tmp_path), max_seq_length=300), JobLimits())
    assert [e.loc for e in errors] == [("hyperparameters", "max_seq_length")] and "256" in errors[0].message
    # A config that builds no model is reported against the model, not as a crash.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    errors = limit_errors(_spec(str(broken), lora={"target_modules": ["q_proj"]}), JobLimits())
    assert [e.loc for e in errors] == [
        ("hyperparameters", "lora", "target_modules")
    ] and "cannot build the model" in errors[0].message
