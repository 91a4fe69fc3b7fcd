"""Model intake at job create: base-model folders under the model roots are checked (config, weights,
tokenizer) and a broken one is a 400 on ``model`` naming the cause, with nothing written; max_seq_length
over the model's position limit is a 400 naming it; the job object shows what will run."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    error_of,
    make_team,
    team_rows,
    uploaded_id,
)
from tests.model_folders import write_model_folder

JOBS = "/v1/fine_tuning/jobs"


def _drop_model_type(f: Path) -> None:
    cfg = json.loads((f / "config.json").read_text())
    del cfg["model_type"]
    (f / "config.json").write_text(json.dumps(cfg))


#: Model name -> (how its folder is broken, words of the cause in the 400).
BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "no-tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer: none of tokenizer.json"),
    "broken-config": (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    "no-model-type": (_drop_model_type, 'config.json has no "model_type"'),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "no weights: expected model.safetensors"),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model-roots")
    write_model_folder(root / "gpt2", "gpt2", max_position_embeddings=256)
    for name, (breaks, _) in BROKEN.items():
        breaks(write_model_folder(root / name, "llama"))
    return root


@pytest.fixture(scope="module")
def mclient(settings: Settings, roots: Path) -> Iterator[tuple[FastAPI, TestClient]]:
    from api.app import create_app

    app = create_app(
        settings.model_copy(update={"model_roots": [roots]}), TEST_API_SETTINGS, enqueue=Enqueued()
    )
    with TestClient(app) as c:
        yield app, c


def test_broken_model_folders_are_refused_with_the_cause(mclient: tuple[FastAPI, TestClient]) -> None:
    app, client = mclient
    team = make_team(app)
    fid = uploaded_id(client, team)
    for name, (_, words) in BROKEN.items():
        r = client.post(JOBS, headers=team.headers, json={"model": name, "training_file": fid})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "model" and err["code"] == "invalid_model", r.text
        assert err["message"].startswith(f"Model '{name}' cannot be fine-tuned: ") and words in err["message"]
    assert team_rows(app, team) == (0, 0)


def test_max_seq_length_over_gpt2_positions_is_refused(mclient: tuple[FastAPI, TestClient]) -> None:
    app, client = mclient
    team = make_team(app)
    fid = uploaded_id(client, team)
    r = client.post(
        JOBS,
        headers=team.headers,
        json={"model": "gpt2", "training_file": fid, "hyperparameters": {"max_seq_length": 300}},
    )
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "hyperparameters.max_seq_length", r.text
    assert "at most 256, the model's maximum sequence length" in err["message"]
    assert team_rows(app, team) == (0, 0)


def test_job_object_shows_what_will_run(mclient: tuple[FastAPI, TestClient], roots: Path) -> None:
    from trainer.model.catalog import estimated_params, learning_rate_for_size

    app, client = mclient
    team = make_team(app)
    fid = uploaded_id(client, team)
    sent: dict[str, Any] = {"n_epochs": 2, "warmup": 0.1, "lora": {"r": 4}}
    r = client.post(
        JOBS, headers=team.headers, json={"model": "gpt2", "training_file": fid, "hyperparameters": sent}
    )
    assert r.status_code == 200, r.text
    hp = client.get(f"{JOBS}/{r.json()['id']}", headers=team.headers).json()["hyperparameters"]
    assert list(hp)[:3] == ["n_epochs", "batch_size", "learning_rate_multiplier"]
    # The values as resolved at create, "auto" ones too (8 examples: batch 4, 2 steps an epoch), and whence
    job = client.get(f"{JOBS}/{r.json()['id']}", headers=team.headers).json()
    assert hp["n_epochs"] == 2 and hp["batch_size"] == 4 and hp["learning_rate_multiplier"] == 1.0
    assert hp["warmup_steps"] == 0 and hp["total_steps"] == 4 and "warmup" not in hp
    sources = job["sources"]
    assert sources["hyperparameters.warmup_steps"] == sources["hyperparameters.lora"] == "request"
    assert (
        sources["hyperparameters.batch_size"] == "data"
        and sources["hyperparameters.learning_rate"] == "model"
    )
    # LoRA's default rate for the folder's size (trainer.model.catalog); GPT-2's n_positions
    lora_rate = learning_rate_for_size(estimated_params(roots / "gpt2"), lora=True)
    assert hp["learning_rate"] == lora_rate and hp["max_seq_length"] == 256
    assert hp["lora"] == {"r": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear"}
    assert r.json()["hyperparameters"] == hp
