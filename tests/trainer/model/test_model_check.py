"""Model intake without services: local model folders checked before a job runs (trainer.model.folder_check),
the position limit of every architecture against max_seq_length, and LoRA under hyperparameters."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.model_folders import write_model_folder
from trainer.limits import JobLimits, limit_errors
from trainer.model.folder_check import ModelFolderError, check_model_folder, position_limit
from trainer.resolve import resolve_hyperparameters
from trainer.samples import TRAIN_FILE
from trainer.spec import JobSpec, load_spec


def _edit_config(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _no_tokenizer(f: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (f / name).unlink(missing_ok=True)


def _missing_shard(f: Path) -> None:
    (f / "model.safetensors").rename(f / "model-00001-of-00002.safetensors")
    (f / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "lm_head.weight": "model-00001-of-00002.safetensors",
                    "model.norm.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )


#: A broken folder (built from a good Llama one) -> words of the cause the check must report.
BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "no tokenizer": (_no_tokenizer, "no tokenizer: none of tokenizer.json"),
    "tokenizer does not load": (
        lambda f: (f / "tokenizer.json").write_text("{}"),
        "the tokenizer (tokenizer.json) does not load",
    ),
    "config not JSON": (
        lambda f: (f / "config.json").write_text('{"model_type": "llama",'),
        "config.json is not valid JSON",
    ),
    "config not an object": (
        lambda f: (f / "config.json").write_text("[1]"),
        "config.json must hold a JSON object",
    ),
    "no model_type": (
        lambda f: _edit_config(f, lambda c: c.pop("model_type")),
        'config.json has no "model_type"',
    ),
    "unknown model_type": (
        lambda f: _edit_config(f, lambda c: c.update(model_type="no-such-arch")),
        'model_type "no-such-arch" is not an architecture',
    ),
    "not a causal LM": (
        lambda f: _edit_config(f, lambda c: c.update(model_type="t5")),
        "no causal language model class",
    ),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no weights: expected model.safetensors"),
    "bad safetensors header": (
        lambda f: (f / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{bad json}......"),
        "model.safetensors is not a readable safetensors file",
    ),
    "index names a missing shard": (
        _missing_shard,
        "names the shard 'model-00002-of-00002.safetensors', which is not",
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_folders_name_the_cause(folders: Path, case: str) -> None:
    folder = write_model_folder(folders / case.replace(" ", "-"), "llama")
    check_model_folder(folder)  # good as built
    breaks, words = BROKEN[case]
    breaks(folder)
    with pytest.raises(ModelFolderError) as exc:
        check_model_folder(folder)  # the change is seen: the cache is keyed by the files
    assert words in str(exc.value) and str(folder) in str(exc.value)


@pytest.mark.parametrize(
    ("arch", "key"),
    [
        ("gpt2", "n_positions"),
        ("llama", "max_position_embeddings"),
        ("qwen2", "max_position_embeddings"),
        ("gemma2", "max_position_embeddings"),
    ],
)
def test_position_limit_of_each_architecture_bounds_max_seq_length(
    folders: Path, arch: str, key: str
) -> None:
    folder = write_model_folder(folders / f"limit-{arch}", arch, max_position_embeddings=96)
    assert json.loads((folder / "config.json").read_text())[key] == 96
    info = check_model_folder(folder)
    assert (
        info.model_type == arch and info.position_limit == 96 and info.weight_files == ("model.safetensors",)
    )
    assert info.num_parameters and info.num_parameters > 1000
    over = JobSpec(model=str(folder), training_file=TRAIN_FILE, hyperparameters={"max_seq_length": 128})
    errors = limit_errors(over, JobLimits(), num_examples=8)
    assert [e.loc for e in errors] == [("hyperparameters", "max_seq_length")]
    assert "at most 96, the model's maximum sequence length" in errors[0].message
    auto = JobSpec(model=str(folder), training_file=TRAIN_FILE)
    assert (
        limit_errors(auto, JobLimits(), num_examples=8) == []
        and resolve_hyperparameters(auto, 8)[0].max_seq_length == 96
    )


def test_position_limit_keys_nesting_and_tokenizer_fallback() -> None:
    assert position_limit({"n_ctx": 512}) == 512
    assert position_limit({"max_seq_len": 300}) == 300
    assert position_limit({"text_config": {"max_position_embeddings": 8192}}) == 8192
    # A tokenizer's model_max_length counts only where the config has none, and only when it is a real
    # limit (transformers writes 1e30 for "none").
    assert position_limit({}, {"model_max_length": 4096}) == 4096
    assert position_limit({"n_positions": 1024}, {"model_max_length": 4096}) == 1024
    assert position_limit({}, {"model_max_length": 1e30}) is None
    assert position_limit({"max_position_embeddings": True}) is None


def test_lora_under_hyperparameters_in_yaml_and_the_old_place_warns(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: tiny-llama\ntraining_file: {TRAIN_FILE}\nhyperparameters:\n  lora: {{r: 4}}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = load_spec(spec)
    assert s.lora is not None and s.lora.r == 4 and resolve_hyperparameters(s, 8)[0].lora == s.lora
    old = tmp_path / "old.yaml"
    old.write_text(f"model: tiny-llama\ntraining_file: {TRAIN_FILE}\nlora: {{r: 2}}\n")
    with pytest.warns(FutureWarning, match="put it under 'hyperparameters:'"):
        assert load_spec(old).hyperparameters.lora.r == 2  # type: ignore[union-attr]
    both = tmp_path / "both.yaml"
    both.write_text(
        f"model: tiny-llama\ntraining_file: {TRAIN_FILE}\nlora: {{r: 2}}\nhyperparameters:\n  lora: {{r: 4}}\n"
    )
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="lora is given twice"):
        load_spec(both)


def test_the_run_refuses_max_seq_length_over_the_position_limit_before_training(
    folders: Path, tmp_path: Path
) -> None:
    """A job created before the create-time check (or a spec run by hand) fails at start, naming the
    field and the limit, instead of crashing mid-run (GPT-2's learned positions: IndexError)."""
    from trainer.run.loop import run_training

    folder = write_model_folder(folders / "run-gpt2", "gpt2", max_position_embeddings=64)
    spec = JobSpec(
        model=str(folder),
        training_file=TRAIN_FILE,
        output_dir=tmp_path / "out",
        hyperparameters={"max_seq_length": 128, "max_steps": 2},
    )
    with pytest.raises(ValueError, match=r"hyperparameters.max_seq_length must be at most 64"):
        run_training(spec)
    assert not list((tmp_path / "out").glob("checkpoint-*"))
