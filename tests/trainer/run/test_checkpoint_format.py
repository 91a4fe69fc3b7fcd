"""The training state's file format: streamed (version 2), version 1 files still load, newer ones are
refused naming their version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.run.checkpoint import (
    TRAINING_STATE,
    engine_shard_name,
    is_engine_shard,
    load_rank_state,
    load_training_state,
    save_rank_state,
    save_training_state,
    tensors_path,
)


def _state(version: int) -> dict[str, Any]:
    return {
        "version": version,
        "step": 7,
        "engine": {"mode_state": {"host": [{"master": torch.arange(300_000.0), "steps": [1, 2]}]}},
        "rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)},
        "losses": [1.0, 0.5],
    }


def test_streamed_state_round_trips_with_its_tensors_beside_it(tmp_path: Path) -> None:
    state = _state(2)
    save_training_state(tmp_path, state)
    skeleton = torch.load(tmp_path / TRAINING_STATE, weights_only=False)
    assert skeleton["streamed"] and skeleton["engine"]["mode_state"]["host"][0]["master"] != state["engine"]
    assert (tmp_path / "training_state.safetensors").stat().st_size > 300_000 * 4
    assert (tmp_path / TRAINING_STATE).stat().st_size < 100_000  # no tensor data in the pickle
    back = load_training_state(tmp_path)
    master = back["engine"]["mode_state"]["host"][0]["master"]
    assert torch.equal(master, torch.arange(300_000.0)) and back["rng"]["python"] == (3, (1, 2), None)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and "streamed" not in back


def test_version_1_file_still_loads(tmp_path: Path) -> None:
    state = _state(1)
    torch.save(state, tmp_path / TRAINING_STATE)  # the format before streaming: tensors inline
    back = load_training_state(tmp_path)
    assert torch.equal(back["engine"]["mode_state"]["host"][0]["master"], torch.arange(300_000.0))


def test_newer_version_is_refused_by_name(tmp_path: Path) -> None:
    torch.save(_state(3), tmp_path / TRAINING_STATE)
    with pytest.raises(ValueError, match="version 3"):
        load_training_state(tmp_path)


def test_rank_shards_are_pairs_of_files(tmp_path: Path) -> None:
    name = engine_shard_name(1, 2)
    save_rank_state(tmp_path / name, _state(2))
    assert is_engine_shard(name) and is_engine_shard(tensors_path(Path(name)).name)
    back = load_rank_state(tmp_path, 1, 2)
    assert back["step"] == 7 and torch.equal(
        back["engine"]["mode_state"]["host"][0]["master"][:3], torch.arange(3.0)
    )
