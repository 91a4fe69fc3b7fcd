"""Issue 26 part 1: a DPO job through the official openai SDK (``method={"type": "dpo", ...}``) on the
tiny model, run by the real job runner: it succeeds, its loss at step 0 is log 2 (the policy is the
reference), and its preference accuracy on a small separable set of pairs ends above 0.9; a malformed
preference line is a 400 naming the line, at upload and at create."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, chat_jsonl, make_team


def preference_jsonl(n: int) -> bytes:
    """``n`` separable pairs: the same preferred and non-preferred replies to different questions."""
    rows = [
        {
            "input": {"messages": [{"role": "user", "content": f"Question {i}: agree?"}]},
            "preferred_output": [{"role": "assistant", "content": "yes indeed"}],
            "non_preferred_output": [{"role": "assistant", "content": "no way"}],
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture(scope="module")
def dapp(settings: Settings) -> FastAPI:
    from api.app import create_app

    return create_app(settings, TEST_API_SETTINGS, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(dapp: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(dapp) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(server: ServerThread, dapp: FastAPI) -> tuple[openai.OpenAI, TeamKey]:
    team = make_team(dapp)
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=60), team


def _metrics(client: openai.OpenAI, job_id: str) -> list[dict[str, Any]]:
    events = client.fine_tuning.jobs.list_events(job_id, limit=200).data
    return [e.data for e in reversed(events) if e.type == "metrics" and e.data]


@pytest.mark.slow
def test_dpo_job_through_the_sdk(sdk: tuple[openai.OpenAI, TeamKey], settings: Settings) -> None:
    from worker.job.runner import run_job_process

    client, _ = sdk
    f = client.files.create(file=("pairs.jsonl", io.BytesIO(preference_jsonl(16))), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        validation_file=f.id,
        seed=1,
        method={
            "type": "dpo",
            "dpo": {"hyperparameters": {"beta": "auto", "n_epochs": 4, "batch_size": 8}},
        },
        extra_body={"hyperparameters": None, "engine": {"mode": "device"}},
    )
    assert job.method is not None and job.method.type == "dpo"
    assert run_job_process(job.id, settings=settings) == 0
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded", done.error
    assert done.method is not None and done.method.dpo is not None
    assert done.method.dpo.hyperparameters is not None and done.method.dpo.hyperparameters.beta == 0.1
    rows = _metrics(client, job.id)
    steps = [r for r in rows if "train_loss" in r]
    valid = [r for r in rows if "valid_loss" in r]
    assert abs(steps[0]["train_loss"] - math.log(2)) < 1e-4  # the policy is the reference at step 0
    assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert steps[-1]["accuracy"] > 0.9 and steps[-1]["reward_margin"] > 0
    assert valid[-1]["valid_accuracy"] > 0.9
    print(f"DPO job {done.id}: {done.status}, final preference accuracy {steps[-1]['accuracy']:.3f}")


def test_malformed_preference_line_is_a_400(sdk: tuple[openai.OpenAI, TeamKey]) -> None:
    client, _ = sdk
    good = preference_jsonl(3).splitlines(keepends=True)
    bad = b'{"input": {"messages": [{"role": "user", "content": "hi"}]}, "preferred_output": "yes"}\n'
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("p.jsonl", io.BytesIO(b"".join([*good, bad]))), purpose="fine-tune")
    assert e.value.param == "file" and "line 4" in str(e.value) and "preferred_output" in str(e.value)

    # a supervised job refuses pairs, a DPO job chat records: 400 naming the file and the line
    pairs = client.files.create(file=("p.jsonl", io.BytesIO(b"".join(good))), purpose="fine-tune")
    chat = client.files.create(file=("c.jsonl", io.BytesIO(chat_jsonl(4))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny-llama", training_file=pairs.id)
    assert e.value.param == "training_file" and "line 1" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny-llama", training_file=chat.id, method={"type": "dpo"})
    assert e.value.param == "training_file" and "line 1" in str(e.value) and "DPO" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=pairs.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}},
        )
    assert e.value.param == "method.dpo.hyperparameters.beta"


def test_an_upload_checked_with_a_model_takes_pairs(
    sdk: tuple[openai.OpenAI, TeamKey], server: ServerThread, dapp: FastAPI
) -> None:
    """Checked at upload with a model, a DPO job's create reuses that check; a supervised job's does not
    (its check refuses the pairs, naming the line)."""
    import httpx

    client, team = sdk
    r = httpx.post(
        f"{server.base_url}/v1/files",
        headers=team.headers,
        files={"file": ("p.jsonl", preference_jsonl(4))},
        data={"purpose": "fine-tune", "model": "tiny-llama"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["validation"]["format"] == "preference" and r.json()["validation"]["num_examples"] == 4
    checks = dapp.state.data_checks
    before = checks.submitted
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=r.json()["id"], method={"type": "dpo"}
    )
    assert job.status == "queued" and checks.submitted == before  # the upload's outcome, kept on its row
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny-llama", training_file=r.json()["id"])
    assert e.value.param == "training_file" and "line 1" in str(e.value) and checks.submitted == before + 1


@pytest.mark.slow
def test_dpo_from_a_supervised_jobs_model(sdk: tuple[openai.OpenAI, TeamKey], settings: Settings) -> None:
    """The usual path: supervised tuning, then DPO starting from its ``ft:`` model (the reference)."""
    from worker.job.runner import run_job_process

    client, _ = sdk
    chat = client.files.create(file=("c.jsonl", io.BytesIO(chat_jsonl(8))), purpose="fine-tune")
    sft = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=chat.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}},
        extra_body={"engine": {"mode": "device"}},
    )
    assert run_job_process(sft.id, settings=settings) == 0
    base = client.fine_tuning.jobs.retrieve(sft.id).fine_tuned_model
    assert base is not None and base.startswith("ft:")
    pairs = client.files.create(file=("p.jsonl", io.BytesIO(preference_jsonl(8))), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=base,
        training_file=pairs.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 4, "beta": 0.2}}},
        extra_body={"engine": {"mode": "zenflow"}},
    )
    assert run_job_process(job.id, settings=settings) == 0
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.model == base, done.error
    steps = [r for r in _metrics(client, job.id) if "train_loss" in r]
    assert abs(steps[0]["train_loss"] - math.log(2)) < 1e-4
