"""Bounds on every hyperparameter and engine field at ``POST /v1/fine_tuning/jobs``: a value over the
server's limits, or one that could only fail once the job runs, is a 400 whose ``param`` names the
field, and nothing is written or enqueued. The Llama-style create paths (built-in and a local
checkpoint, full and LoRA, both places for hyperparameters) still pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store.orm import FineTuningJob
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    TeamKey,
    error_of,
    make_team,
    team_rows,
    uploaded_id,
)

JOBS = "/v1/fine_tuning/jobs"

#: Tighter than the defaults, to show the limits are the server's settings (ZENFLOW_MAX_...).
LIMITS = dict(
    max_n_epochs=50,
    max_batch_size=64,
    max_seq_length=1024,
    max_total_steps=200,
    max_total_tokens=200_000,
    max_learning_rate=0.5,
    max_lora_rank=16,
)


@pytest.fixture(scope="module")
def bounded(settings: Settings, llama_dir: Path) -> tuple[FastAPI, Enqueued]:
    from api.app import create_app

    enqueued = Enqueued()
    limited = settings.model_copy(update={**LIMITS, "model_roots": [llama_dir.parent]})
    return create_app(limited, TEST_API_SETTINGS, enqueue=enqueued), enqueued


@pytest.fixture(scope="module")
def bclient(bounded: tuple[FastAPI, Enqueued]) -> Any:
    with TestClient(bounded[0]) as c:
        yield c


@pytest.fixture
def bteam(bounded: tuple[FastAPI, Enqueued]) -> TeamKey:
    return make_team(bounded[0])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Llama-style model folder (config, tokenizer, weights: create checks all three)."""
    from tests.model_folders import write_model_folder

    return write_model_folder(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=512)


def _supervised(hp: dict[str, Any]) -> dict[str, Any]:
    return {"method": {"type": "supervised", "supervised": {"hyperparameters": hp}}}


REFUSED = [
    # the reported values
    ({"hyperparameters": {"n_epochs": 10_000_000}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"n_epochs": 1_000_000_000}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"max_steps": 2**63}}, "hyperparameters.max_steps"),
    ({"hyperparameters": {"batch_size": 2**64}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"max_seq_length": 10**9}}, "hyperparameters.max_seq_length"),
    ({"hyperparameters": {"lora": {"r": 10**6}}}, "hyperparameters.lora.r"),
    ({"engine": {"update_interval": 10**9}}, "engine.update_interval"),
    # values that would only fail once the job runs
    ({"hyperparameters": {"learning_rate": 1e300}}, "hyperparameters.learning_rate"),
    ({"hyperparameters": {"learning_rate_multiplier": 1e300}}, "hyperparameters.learning_rate_multiplier"),
    ({"hyperparameters": {"max_seq_length": 1}}, "hyperparameters.max_seq_length"),
    (
        {"hyperparameters": {"lora": {"target_modules": ["q_proj", "attention"]}}},
        "hyperparameters.lora.target_modules",
    ),
    (
        {"hyperparameters": {"max_seq_length": 2000}},
        "hyperparameters.max_seq_length",
    ),  # over the model's 1024
    # every other limit of the server
    ({"hyperparameters": {"n_epochs": 51}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"batch_size": 65}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"max_steps": 201}}, "hyperparameters.max_steps"),
    ({"hyperparameters": {"warmup": 201}}, "hyperparameters.warmup"),
    ({"hyperparameters": {"eval_every": 201}}, "hyperparameters.eval_every"),
    ({"hyperparameters": {"checkpoint_every": 2**40}}, "hyperparameters.checkpoint_every"),
    ({"hyperparameters": {"lora": {"r": 17}}}, "hyperparameters.lora.r"),
    ({"hyperparameters": {"lora": {"alpha": 1e9}}}, "hyperparameters.lora.alpha"),
    (
        {"hyperparameters": {"n_epochs": 40, "batch_size": 1}},
        "hyperparameters.n_epochs",
    ),  # 320 steps over 8 examples
    (
        {"hyperparameters": {"n_epochs": 50, "batch_size": 8, "max_seq_length": 512}},
        "hyperparameters.max_seq_length",
    ),  # 204,800 token positions
    (_supervised({"n_epochs": 10_000_000}), "method.supervised.hyperparameters.n_epochs"),
    (_supervised({"lora": {"r": 10**6}}), "method.supervised.hyperparameters.lora.r"),
    # the engine's fields
    ({"engine": {"select_interval": 10**9}}, "engine.select_interval"),
    ({"engine": {"max_update_interval": 10**9}}, "engine.max_update_interval"),
    ({"engine": {"select_interval_fallback": 10**9}}, "engine.select_interval_fallback"),
    ({"engine": {"full_warm_up_rounds": 2**40}}, "engine.full_warm_up_rounds"),
    ({"engine": {"weight_decay": 1e9}}, "engine.weight_decay"),
    ({"engine": {"max_grad_norm": 1e300}}, "engine.max_grad_norm"),
    ({"engine": {"eps": 2.0}}, "engine.eps"),
    ({"engine": {"cpu_threads": 10**6}}, "engine.cpu_threads"),
    ({"engine": {"cpu_chunk_elements": 2**64}}, "engine.cpu_chunk_elements"),
    ({"engine": {"shard_params": "sometimes"}}, "engine.shard_params"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_out_of_bounds_is_refused_naming_the_field(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey, extra: dict[str, Any], param: str
) -> None:
    app, enqueued = bounded
    fid = uploaded_id(bclient, bteam)  # 8 examples
    sent = len(enqueued.calls)
    r = bclient.post(JOBS, headers=bteam.headers, json={"model": "tiny-llama", "training_file": fid, **extra})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert "Traceback" not in err["message"] and "SELECT" not in err["message"]
    assert team_rows(app, bteam) == (0, 0) and len(enqueued.calls) == sent


def test_non_finite_learning_rate_in_raw_json_is_refused(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey
) -> None:
    """Python's JSON parser takes ``Infinity`` and ``NaN``; they never reach a job."""
    fid = uploaded_id(bclient, bteam)
    for raw in ("Infinity", "NaN", "1e999"):
        body = f'{{"model": "tiny-llama", "training_file": "{fid}", "hyperparameters": {{"learning_rate": {raw}}}}}'
        r = bclient.post(JOBS, headers={**bteam.headers, "Content-Type": "application/json"}, content=body)
        assert r.status_code == 400 and error_of(r)["param"] == "hyperparameters.learning_rate", (raw, r.text)
    assert team_rows(bounded[0], bteam) == (0, 0)


def test_default_limits_refuse_the_reported_values(client: TestClient, team: TeamKey, app: FastAPI) -> None:
    """On the default settings too (no integer column of PostgreSQL can be reached with these)."""
    fid = uploaded_id(client, team)
    for hp, param in [
        ({"n_epochs": 10_000_000}, "n_epochs"),
        ({"n_epochs": 1_000_000_000}, "n_epochs"),
        ({"max_steps": 2**63}, "max_steps"),
        ({"batch_size": 2**64}, "batch_size"),
        ({"max_seq_length": 10**9}, "max_seq_length"),
        ({"lora": {"r": 10**6}}, "lora.r"),
        ({"learning_rate": 1e300}, "learning_rate"),
    ]:
        r = client.post(
            JOBS,
            headers=team.headers,
            json={"model": "tiny-llama", "training_file": fid, "hyperparameters": hp},
        )
        assert r.status_code == 400 and error_of(r)["param"] == f"hyperparameters.{param}", r.text
    big = uploaded_id(
        client,
        team,
        b"".join(
            json.dumps({"prompt": f"{i}?", "completion": f"{i}."}).encode() + b"\n" for i in range(2000)
        ),
    )
    r = client.post(
        JOBS,
        headers=team.headers,
        json={
            "model": "tiny-llama",
            "training_file": big,
            "hyperparameters": {"n_epochs": 1000, "batch_size": 1},
        },
    )
    assert r.status_code == 400 and "2,000,000 training steps" in error_of(r)["message"], r.text
    with app.state.sessionmaker() as s:
        assert (
            s.scalar(select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id))
            == 0
        )


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    "extra",
    [
        {"hyperparameters": {"n_epochs": 3, "batch_size": 4, "max_seq_length": 128}},
        {"hyperparameters": {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}},
        _supervised({"n_epochs": 2, "lora": {"r": 16, "target_modules": LLAMA_TARGETS}}),
        {
            "hyperparameters": {"learning_rate": 0.5, "warmup": 0.1, "max_steps": 200},
            "engine": {"mode": "device"},
        },
        {
            "engine": {
                "mode": "zenflow",
                "update_interval": 4,
                "select_interval": 10_000_000,
                "topk_ratio": 0.1,
            }
        },
    ],
)
def test_llama_style_creates_still_pass(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey, extra: dict[str, Any]
) -> None:
    fid = uploaded_id(bclient, bteam)
    r = bclient.post(JOBS, headers=bteam.headers, json={"model": "tiny-llama", "training_file": fid, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued" and team_rows(bounded[0], bteam)[0] == 1


def test_local_llama_checkpoint_with_lora(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey, llama_dir: Path
) -> None:
    fid = uploaded_id(bclient, bteam)
    body = {"model": llama_dir.name, "training_file": fid}  # a base model under the model roots
    ok = bclient.post(
        JOBS,
        headers=bteam.headers,
        json={
            **body,
            "hyperparameters": {"max_seq_length": 256, "lora": {"r": 8, "target_modules": LLAMA_TARGETS}},
        },
    )
    assert ok.status_code == 200, ok.text
    bad = bclient.post(
        JOBS,
        headers=bteam.headers,
        json={**body, "hyperparameters": {"lora": {"target_modules": ["q_proj", "c_attn"]}}},
    )
    assert bad.status_code == 400 and error_of(bad)["param"] == "hyperparameters.lora.target_modules"
    assert "'c_attn' matches no module" in error_of(bad)["message"]
    long = bclient.post(
        JOBS, headers=bteam.headers, json={**body, "hyperparameters": {"max_seq_length": 600}}
    )
    assert long.status_code == 400 and "the model's maximum sequence length" in error_of(long)["message"]
    assert team_rows(bounded[0], bteam)[0] == 1


# --- issue 25: micro_batch_size over batch_size; the engine windows' documented bound --------------------


@pytest.mark.parametrize(
    ("hp", "param", "said"),
    [
        (
            {"micro_batch_size": 1_000_000},
            "hyperparameters",
            "batch_size 'auto' resolves to 4 for 8 examples",
        ),
        ({"micro_batch_size": 5}, "hyperparameters", "batch_size 'auto' resolves to 4 for 8 examples"),
        ({"batch_size": 4, "micro_batch_size": 8}, "hyperparameters", "must be at most batch_size (4)"),
        (
            {"micro_batch_size": 1_000_000},
            "method.supervised.hyperparameters",
            "batch_size 'auto' resolves to 4",
        ),
    ],
    ids=["auto-huge", "auto-just-over", "explicit", "method"],
)
def test_micro_batch_size_over_batch_size_is_refused(
    bounded: tuple[FastAPI, Enqueued],
    bclient: TestClient,
    bteam: TeamKey,
    hp: dict[str, Any],
    param: str,
    said: str,
) -> None:
    app, enqueued = bounded
    fid = uploaded_id(bclient, bteam)  # 8 examples: a batch size of "auto" resolves to 4
    sent = len(enqueued.calls)
    extra = _supervised(hp) if param.startswith("method") else {"hyperparameters": hp}
    r = bclient.post(JOBS, headers=bteam.headers, json={"model": "tiny-llama", "training_file": fid, **extra})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == f"{param}.micro_batch_size" and err["code"] == "invalid_value", err
    assert said in err["message"], err["message"]
    assert team_rows(app, bteam) == (0, 0) and len(enqueued.calls) == sent


def test_micro_batch_size_within_batch_size_passes(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey
) -> None:
    fid = uploaded_id(bclient, bteam)
    for hp in (
        {"micro_batch_size": 4},  # what "auto" resolves to for 8 examples
        {"batch_size": 16, "micro_batch_size": 16},  # the request agrees; 8 examples lower both to 8
        {"batch_size": 8, "micro_batch_size": 2},
    ):
        r = bclient.post(
            JOBS,
            headers=bteam.headers,
            json={"model": "tiny-llama", "training_file": fid, "hyperparameters": hp},
        )
        assert r.status_code == 200, (hp, r.text)


def test_micro_batch_errors_without_a_file_count_use_the_most_auto_resolves_to() -> None:
    from api.jobs.checks import micro_batch_errors
    from trainer.resolve import AUTO_BATCH_MAX
    from trainer.spec import JobSpec

    def spec(hp: dict[str, Any]) -> JobSpec:
        return JobSpec(model="tiny-llama", training_file="t.jsonl", hyperparameters=hp)

    assert micro_batch_errors(spec({"micro_batch_size": AUTO_BATCH_MAX}), None) == []
    (refused,) = micro_batch_errors(spec({"micro_batch_size": AUTO_BATCH_MAX + 1}), None)
    assert refused.loc == ("hyperparameters", "micro_batch_size")
    assert f"batch_size 'auto' is at most {AUTO_BATCH_MAX}" in refused.message
    assert micro_batch_errors(spec({"micro_batch_size": "auto"}), 8) == []
    assert micro_batch_errors(spec({"batch_size": 2, "micro_batch_size": 2}), 1) == []  # clamped at run


def test_engine_window_bound_is_the_documented_one() -> None:
    """docs/api.md's bound on the engine windows is contract.engine.MAX_INTERVAL_STEPS (10,000,000: longer
    than any job may run, so a select_interval that long means "never reselect"; clients send it)."""
    import re

    from contract.engine import MAX_INTERVAL_STEPS
    from offload.config import EngineConfig
    from trainer.limits import JobLimits

    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    found = re.search(r"`max_update_interval`\) at\s+most ([\d,]+) steps", docs)
    assert found is not None and int(found.group(1).replace(",", "")) == MAX_INTERVAL_STEPS
    tuning = re.search(r"`select_interval_fallback` and `loss_scale_growth_interval` ([\d,]+)\)", docs)
    assert tuning is not None and int(tuning.group(1).replace(",", "")) == MAX_INTERVAL_STEPS
    assert "at most 100,000 steps" not in docs
    assert JobLimits().max_total_steps <= MAX_INTERVAL_STEPS
    EngineConfig(select_interval=MAX_INTERVAL_STEPS, max_update_interval=MAX_INTERVAL_STEPS)
    for field in ("update_interval", "select_interval", "max_update_interval", "select_interval_fallback"):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: MAX_INTERVAL_STEPS + 1})


def test_engine_window_over_the_bound_is_refused_at_create(
    bounded: tuple[FastAPI, Enqueued], bclient: TestClient, bteam: TeamKey
) -> None:
    from offload.config import MAX_INTERVAL_STEPS

    fid = uploaded_id(bclient, bteam)
    body = {"model": "tiny-llama", "training_file": fid}
    r = bclient.post(
        JOBS, headers=bteam.headers, json={**body, "engine": {"select_interval": MAX_INTERVAL_STEPS + 1}}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "engine.select_interval", r.text
    assert f"{MAX_INTERVAL_STEPS}" in error_of(r)["message"]
