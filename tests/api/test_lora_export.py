"""Issue 27 item 4: LoRA through the openai SDK as the README shows it (``method=`` and ``extra_body``
forms; the mixed form is a 400 saying which to use), an adapter that names its base by the API's id
(never a server path) with a real model card, and base models a team may train on downloadable:
built-in configs at a seed and folders under the model roots, loading with ``from_pretrained`` and
taking the adapter."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, chat_jsonl, make_team
from tests.model_folders import write_model_folder

BASE = "org/chat-base"
HP = {"n_epochs": 1, "batch_size": 4, "max_seq_length": 64}


@pytest.fixture(scope="module")
def lsettings(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("zf-lora")
    write_model_folder(root / "roots" / BASE, "llama")
    return settings.model_copy(update={"data_dir": root / "var", "model_roots": [root / "roots"]})


@pytest.fixture(scope="module")
def lapp(lsettings: Settings) -> FastAPI:
    from api.app import create_app

    return create_app(lsettings, TEST_API_SETTINGS, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(lapp: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(lapp) as s:
        yield s


@dataclass
class Sdk:
    client: openai.OpenAI
    team: TeamKey
    base_url: str
    training_file: str


@pytest.fixture(scope="module")
def sdk(server: ServerThread, lapp: FastAPI) -> Sdk:
    team = make_team(lapp)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=60)
    f = client.files.create(file=("train.jsonl", io.BytesIO(chat_jsonl(16))), purpose="fine-tune")
    return Sdk(client, team, server.base_url, f.id)


def _run(job_id: str, settings: Settings, client: openai.OpenAI) -> Any:
    from worker.job.runner import run_job_process

    assert run_job_process(job_id, settings=settings) == 0
    job = client.fine_tuning.jobs.retrieve(job_id)
    assert job.status == "succeeded", job
    return job


def _download(sdk: Sdk, model: str, out: Path, **params: Any) -> Path:
    import httpx

    r = httpx.get(
        f"{sdk.base_url}/v1/models/{model}/content", headers=sdk.team.headers, params=params, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-checksum-sha256"] == hashlib.sha256(r.content).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(out, filter="data")
    return out


@pytest.fixture(scope="module")
def folder_job(sdk: Sdk, lsettings: Settings) -> Any:
    """The README's first example: LoRA in method.supervised.hyperparameters, on a base folder."""
    method: Any = {
        "type": "supervised",
        "supervised": {"hyperparameters": {**HP, "lora": {"r": 8, "alpha": 16}}},
    }
    job = sdk.client.fine_tuning.jobs.create(
        model=BASE, training_file=sdk.training_file, seed=5, method=method
    )
    return _run(job.id, lsettings, sdk.client)


def test_the_extra_body_form_works_and_the_mixed_form_says_which_to_use(sdk: Sdk) -> None:
    job = sdk.client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=sdk.training_file,
        extra_body={"hyperparameters": {**HP, "lora": {"r": 8}}},
    )
    assert job.status == "queued"
    method: Any = {"type": "supervised", "supervised": {"hyperparameters": HP}}
    with pytest.raises(openai.BadRequestError) as err:
        sdk.client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=sdk.training_file,
            method=method,
            extra_body={"hyperparameters": {"lora": {"r": 8}}},
        )
    body: Any = err.value.body
    msg = body["message"]
    assert body["param"] == "hyperparameters" and body["code"] == "invalid_value"
    assert "at the top level (lora)" in msg and "method.supervised.hyperparameters (" in msg, msg
    assert "method={'type': 'supervised'" in msg and "extra_body={'hyperparameters'" in msg, msg


def test_adapter_names_the_base_by_its_id_with_a_model_card(
    folder_job: Any, sdk: Sdk, lsettings: Settings, tmp_path: Path
) -> None:
    model = folder_job.fine_tuned_model
    adapter = _download(sdk, model, tmp_path / "adapter", format="adapter")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == BASE and cfg["r"] == 8
    config_sha = hashlib.sha256((lsettings.model_roots[0] / BASE / "config.json").read_bytes()).hexdigest()
    card = (adapter / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert f'base_model: "{BASE}"' in front and "library_name: peft" in front and "- lora" in front
    assert f'base_model_config_sha256: "{config_sha}"' in front
    import re

    used = re.search(r"- num_examples: (\d+)", body)
    assert used and f"Training examples: {used[1]}\n" in body and "Validation examples: 0" in body
    assert re.search(r"Tokens trained: [1-9]\d*\n", body) and "Steps: 3 of 3" in body, body
    assert "- n_epochs: 1" in body and '"r": 8' in body and "- batch_size: 4" in body
    assert "Final training loss: " in body and "Final training loss: n/a" not in body
    assert f"GET /v1/models/{BASE}/content" in body and str(lsettings.model_roots[0]) not in card

    merged = _download(sdk, model, tmp_path / "model")
    mcard = (merged / "README.md").read_text()
    assert "library_name: transformers" in mcard and f'base_model: "{BASE}"' in mcard
    assert "- lora" not in mcard.split("---\n")[1]


def test_a_base_folder_downloads_and_takes_the_adapter(
    folder_job: Any, sdk: Sdk, lsettings: Settings, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = _download(sdk, BASE, tmp_path / "base")
    assert (base_dir / "config.json").read_bytes() == (
        lsettings.model_roots[0] / BASE / "config.json"
    ).read_bytes()
    adapter = _download(sdk, folder_job.fine_tuned_model, tmp_path / "adapter", format="adapter")
    merged = _download(sdk, folder_job.fine_tuned_model, tmp_path / "merged")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
        with_adapter = PeftModel.from_pretrained(base, adapter)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)(ids).logits
    assert torch.allclose(with_adapter, want, atol=1e-4), (with_adapter - want).abs().max()


def test_a_builtin_base_downloads_at_the_jobs_seed(sdk: Sdk, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.catalog import load_model

    got_dir = _download(sdk, "tiny-llama", tmp_path / "tiny", seed=7)
    got = AutoModelForCausalLM.from_pretrained(got_dir, local_files_only=True)
    want = load_model("tiny-llama", dtype=torch.float32, seed=7)
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert (got_dir / "tokenizer_config.json").is_file()
    again = _download(sdk, "tiny-llama", tmp_path / "again", seed=7)
    assert (again / "model.safetensors").read_bytes() == (got_dir / "model.safetensors").read_bytes()


def test_a_base_download_resumes_with_range_and_head(sdk: Sdk, lapp: FastAPI) -> None:
    import httpx

    url = f"{sdk.base_url}/v1/models/{BASE}/content"
    whole = httpx.get(url, headers=sdk.team.headers, timeout=60)
    head = httpx.head(url, headers=sdk.team.headers, timeout=60)
    assert head.status_code == 200 and head.headers["content-length"] == str(len(whole.content))
    assert head.headers["x-checksum-sha256"] == whole.headers["x-checksum-sha256"]
    part = httpx.get(
        url,
        headers={**sdk.team.headers, "Range": "bytes=1000-", "If-Range": whole.headers["etag"]},
        timeout=60,
    )
    assert part.status_code == 206 and part.content == whole.content[1000:]
    other = httpx.get(url, headers=make_team(lapp).headers, timeout=60)
    assert other.status_code == 200 and other.content == whole.content  # any team may train on it
