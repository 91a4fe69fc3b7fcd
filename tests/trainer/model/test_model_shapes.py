"""trainer.model.weight_shapes: config against safetensors headers, no tensor read (issue 27 item 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.model_folders import write_model_folder
from trainer.model.folder_check import ModelFolderError, check_model_folder, folder_problem


def _set_config(folder: Path, **values: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "phi3"])
@pytest.mark.parametrize("tie", [None, True])
def test_valid_folders_pass_without_reading_a_tensor(
    arch: str, tie: bool | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_model_folder(tmp_path / arch, arch, tie_word_embeddings=tie)
    import safetensors.torch
    import torch

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("weights were read")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    checked = check_model_folder(folder)
    assert checked.num_parameters and checked.weight_files == ("model.safetensors",)
    assert folder_problem(folder) is None


def test_sharded_folder_is_checked_through_its_index(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_model_folder(tmp_path / "m", "llama")
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(check_model_folder(folder).weight_files) > 1
    _set_config(folder, intermediate_size=48)
    with pytest.raises(ModelFolderError, match=r"down_proj.weight has shape \[32, 64\].*makes it \[32, 48\]"):
        check_model_folder(folder)


def test_a_broken_outcome_is_cached_until_the_folder_changes(tmp_path: Path) -> None:
    folder = write_model_folder(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    _set_config(folder, hidden_size=64)
    problem = folder_problem(folder)
    assert problem is not None and "lm_head.weight" in problem and "[" in problem
    assert folder_problem(folder) == problem
    (folder / "config.json").write_text(json.dumps(cfg))
    assert folder_problem(folder) is None


def test_extra_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_model_folder(tmp_path / "m", "llama")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.7.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
    tensors = {k: v.clone() for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"no place in the config's model: model.layers.7.mlp.up_proj"):
        check_model_folder(folder)
