"""trainer.model.catalog's default learning rate of a pretrained folder, by its size: the parameter count
read from config.json alone matches the model's, and the rule gives the usual 7B values, more as the base
shrinks, within its bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.model.catalog import (
    LORA_LR_MAX,
    LR_AT_7B,
    LR_MAX,
    default_learning_rate,
    estimated_params,
    learning_rate_for_size,
)
from trainer.samples import MODELS_DIR


@pytest.mark.parametrize(
    "config",
    [
        {
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "tie_word_embeddings": False,
        },
        {
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 6,
            "num_key_value_heads": 6,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        },
    ],
)
def test_the_count_from_the_config_is_the_models(tmp_path: Path, config: dict[str, object]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    LlamaConfig(**config).save_pretrained(tmp_path)  # type: ignore[arg-type]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(tmp_path))
    assert estimated_params(tmp_path) == sum(p.numel() for p in model.parameters())


def test_the_demo_base_and_a_folder_that_says_nothing(tmp_path: Path) -> None:
    base = MODELS_DIR / "docs-llama"
    assert estimated_params(base) == json.loads((base / "pretrain.json").read_text())["params"]
    assert default_learning_rate(str(base), lora=False) == learning_rate_for_size(
        estimated_params(base), lora=False
    )
    (tmp_path / "config.json").write_text("{}")
    assert estimated_params(tmp_path) == 7_000_000_000  # unknown: the careful end


def test_the_rule_by_size() -> None:
    assert learning_rate_for_size(7_000_000_000, lora=False) == pytest.approx(LR_AT_7B)
    assert learning_rate_for_size(7_000_000_000, lora=True) == pytest.approx(2e-4)
    assert learning_rate_for_size(70_000_000_000, lora=False) == LR_AT_7B  # never below it
    sizes = [10**k for k in range(5, 11)]
    full = [learning_rate_for_size(n, lora=False) for n in sizes]
    assert full == sorted(full, reverse=True) and max(full) <= LR_MAX
    assert max(learning_rate_for_size(n, lora=True) for n in sizes) <= LORA_LR_MAX


def test_a_gpt2_config_is_counted_within_its_biases(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    GPT2Config(n_embd=96, n_layer=3, n_head=4, vocab_size=1000, n_positions=256).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GPT2Config.from_pretrained(tmp_path))
    real = sum(p.numel() for p in model.parameters())
    assert abs(estimated_params(tmp_path) - real) / real < 0.02
