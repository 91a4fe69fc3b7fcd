"""The official openai SDK against the running server (uvicorn on a loopback port): upload, create,
list, retrieve, cancel a job and list its events; jobs go onto a real Redis queue (no worker)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import openai
import pytest
from fastapi import FastAPI

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, TeamKey, chat_jsonl, make_team


@pytest.fixture(scope="module")
def sdk_app(settings: Settings) -> Iterator[FastAPI]:
    from api.app import create_app
    from worker.broker import configure_celery

    configure_celery(settings)  # Redis, this session's queue
    try:
        yield create_app(settings, TEST_API_SETTINGS)  # the real enqueue: worker.broker.enqueue_job
    finally:
        configure_celery()


@pytest.fixture(scope="module")
def server(sdk_app: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(sdk_app) as s:
        yield s


@pytest.fixture
def sdk(server: ServerThread, sdk_app: FastAPI) -> tuple[openai.OpenAI, TeamKey]:
    t = make_team(sdk_app)
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=t.key, max_retries=0, timeout=30), t


def _queue_length(settings: Settings) -> int:
    import redis

    return int(redis.Redis.from_url(settings.broker_url).llen(settings.default_queue))


def test_sdk_files_and_jobs(sdk: tuple[openai.OpenAI, TeamKey], settings: Settings) -> None:
    client, team = sdk
    f = client.files.create(file=("train.jsonl", io.BytesIO(chat_jsonl(6))), purpose="fine-tune")
    assert f.id.startswith("file-") and f.purpose == "fine-tune" and f.bytes == len(chat_jsonl(6))
    assert [x.id for x in client.files.list()] == [f.id]
    assert client.files.retrieve(f.id).filename == "train.jsonl"
    assert client.files.content(f.id).read() == chat_jsonl(6)

    before = _queue_length(settings)
    job = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        suffix="sdk",
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
        extra_body={"engine": {"mode": "zenflow", "topk_ratio": 0.1}},
        extra_headers={"Idempotency-Key": "sdk-create-1"},
    )
    assert job.object == "fine_tuning.job" and job.status == "queued" and job.organization_id == team.id
    assert job.hyperparameters.n_epochs == 1 and job.method and job.method.type == "supervised"
    assert job.training_file == f.id and job.seed == 3
    assert _queue_length(settings) == before + 1  # on the real broker

    again = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        suffix="sdk",
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
        extra_body={"engine": {"mode": "zenflow", "topk_ratio": 0.1}},
        extra_headers={"Idempotency-Key": "sdk-create-1"},
    )
    assert again.id == job.id and _queue_length(settings) == before + 1

    second = client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    listed = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in listed.data] == [second.id] and listed.has_more
    assert [j.id for j in client.fine_tuning.jobs.list()] == [second.id, job.id]
    all_ids = [j.id for j in client.fine_tuning.jobs.list(limit=1)]  # auto-pagination follows `after`
    assert all_ids == [second.id, job.id]

    got = client.fine_tuning.jobs.retrieve(job.id)
    assert got.id == job.id and got.status == "queued"

    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None

    events = client.fine_tuning.jobs.list_events(job.id, limit=50)
    assert events.data[0].message == "Job cancelled before it started"
    assert events.data[-1].message.startswith("Created fine-tuning job")
    assert all(
        e.object == "fine_tuning.job.event" and e.level in ("info", "warn", "error") for e in events.data
    )
    assert client.fine_tuning.jobs.checkpoints.list(job.id).data == []

    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(job.id)
    client.fine_tuning.jobs.cancel(second.id)


def test_sdk_errors(sdk: tuple[openai.OpenAI, TeamKey], server: ServerThread) -> None:
    client, _ = sdk
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny-llama", training_file="file-nope")
    assert e.value.param == "training_file" and e.value.code == "file_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", io.BytesIO(b'{"prompt": 1}\n')), purpose="fine-tune")
    assert e.value.param == "file"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="zf-not-a-key-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.fine_tuning.jobs.list()
    assert e.value.code == "invalid_api_key"
