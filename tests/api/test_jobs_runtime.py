"""The runtime hyperparameters at job creation: micro_batch_size, gradient_checkpointing and packing pass
through to the trainer's JobSpec; a bad value is a 400 naming the field, and nothing is written."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Enqueued, TeamKey, error_of, uploaded_id
from tests.api.test_jobs import JOBS, _job_rows


@pytest.mark.parametrize(
    ("hyperparameters", "param"),
    [
        ({"batch_size": 4, "micro_batch_size": 8}, "hyperparameters.micro_batch_size"),
        ({"micro_batch_size": 0}, "hyperparameters.micro_batch_size"),
        ({"gradient_checkpointing": "sometimes"}, "hyperparameters.gradient_checkpointing"),
        ({"packing": 3}, "hyperparameters.packing"),
    ],
)
def test_bad_runtime_hyperparameters_are_400(
    client: TestClient,
    app: Any,
    team: TeamKey,
    enqueued: Enqueued,
    hyperparameters: dict[str, Any],
    param: str,
) -> None:
    fid = uploaded_id(client, team)
    sent = len(enqueued.calls)  # the recorder is shared by the session's tests
    r = client.post(
        JOBS,
        headers=team.headers,
        json={"model": "tiny-llama", "training_file": fid, "hyperparameters": hyperparameters},
    )
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param, err
    if "batch_size" in hyperparameters:
        assert "at most batch_size (4)" in err["message"]
    assert _job_rows(app, team) == 0 and len(enqueued.calls) == sent


def test_runtime_hyperparameters_are_kept_and_resolved(
    client: TestClient, team: TeamKey, enqueued: Enqueued
) -> None:
    fid = uploaded_id(client, team)
    hp = {"batch_size": 8, "micro_batch_size": 2, "gradient_checkpointing": True, "packing": "auto"}
    r = client.post(
        JOBS, headers=team.headers, json={"model": "tiny-llama", "training_file": fid, "hyperparameters": hp}
    )
    assert r.status_code == 200, r.text
    got = r.json()["hyperparameters"]
    assert (got["batch_size"], got["micro_batch_size"], got["gradient_checkpointing"]) == (8, 2, True)
    assert isinstance(got["packing"], bool)  # "auto" shows as what it resolved to
