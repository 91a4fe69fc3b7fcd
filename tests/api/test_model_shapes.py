"""Issue 27 item 3: a base-model folder whose config does not fit its weights (another hidden_size or
vocab_size, a tensor missing) is a 400 ``invalid_model`` at create naming the tensor and both shapes,
and ``GET /v1/models`` lists it with ``usable: false`` and the reason; a valid folder passes, with
only the safetensors headers read (no tensor loaded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, error_of, make_team, team_rows, uploaded_id
from tests.model_folders import write_model_folder

JOBS = "/v1/fine_tuning/jobs"


def _set_config(folder: Path, **values: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shape-roots")
    write_model_folder(root / "good", "llama")
    # hidden 32 weights under a config saying 64 (the 256-over-128, smaller)
    _set_config(write_model_folder(root / "wide", "llama"), hidden_size=64)
    _set_config(write_model_folder(root / "vocab", "qwen2"), vocab_size=300)  # the weights hold 261+ rows
    _drop_tensor(write_model_folder(root / "missing", "llama"), "model.layers.0.mlp.down_proj.weight")
    return root


@pytest.fixture(scope="module")
def sclient(settings: Settings, roots: Path) -> Iterator[tuple[FastAPI, TestClient]]:
    from api.app import create_app

    app = create_app(
        settings.model_copy(update={"model_roots": [roots]}), TEST_API_SETTINGS, enqueue=Enqueued()
    )
    with TestClient(app) as c:
        yield app, c


def _create(client: TestClient, headers: dict[str, str], model: str, fid: str) -> Any:
    return client.post(JOBS, headers=headers, json={"model": model, "training_file": fid})


def test_shape_mismatches_are_a_400_naming_tensor_and_both_shapes(
    sclient: tuple[FastAPI, TestClient], roots: Path
) -> None:
    app, client = sclient
    team = make_team(app)
    fid = uploaded_id(client, team)
    from safetensors import safe_open

    def rows(model: str) -> int:
        with safe_open(str(roots / model / "model.safetensors"), framework="pt") as f:
            return int(f.get_slice("model.embed_tokens.weight").get_shape()[0])

    cases = {
        "wide": ("lm_head.weight", f"[{rows('wide')}, 32]", f"[{rows('wide')}, 64]"),
        "vocab": ("lm_head.weight", f"[{rows('vocab')}, 32]", "[300, 32]"),
    }
    for model, (tensor, in_file, from_config) in cases.items():
        err = error_of(r := _create(client, team.headers, model, fid))
        assert r.status_code == 400 and err["code"] == "invalid_model" and err["param"] == "model", r.text
        msg = err["message"]
        assert msg.startswith(f"Model '{model}' cannot be fine-tuned: the weights do not fit config.json")
        assert f"tensor {tensor} has shape {in_file} in the safetensors files" in msg, msg
        assert f"the config makes it {from_config}" in msg, msg
    err = error_of(r := _create(client, team.headers, "missing", fid))
    assert r.status_code == 400 and err["code"] == "invalid_model", r.text
    assert "model.layers.0.mlp.down_proj.weight" in err["message"] and "[32, 64]" in err["message"], err
    assert "not in the safetensors files" in err["message"]
    assert team_rows(app, team) == (0, 0)
    assert "/" + str(roots).strip("/") not in r.text  # no server path in the message


def test_broken_folders_are_listed_as_not_usable(sclient: tuple[FastAPI, TestClient]) -> None:
    app, client = sclient
    team = make_team(app)
    r = client.get("/v1/models", headers=team.headers)
    assert r.status_code == 200, r.text
    by_id = {m["id"]: m for m in r.json()["data"]}
    for broken in ("wide", "vocab", "missing"):
        assert by_id[broken]["usable"] is False, by_id[broken]
        assert "the weights do not fit config.json" in by_id[broken]["unusable_reason"]
    assert by_id["good"]["usable"] is True and by_id["good"]["unusable_reason"] is None
    assert by_id["tiny-llama"]["usable"] is True
    one = client.get("/v1/models/wide", headers=team.headers).json()
    assert one["usable"] is False and "tensor lm_head.weight" in one["unusable_reason"], one


def test_a_valid_folder_passes_with_headers_only(
    sclient: tuple[FastAPI, TestClient], roots: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh valid folder (not cached) is accepted while loading any tensor raises."""
    import safetensors
    import safetensors.torch

    def no_tensors(*a: Any, **k: Any) -> Any:
        raise AssertionError("a tensor was read")

    app, client = sclient
    team = make_team(app)
    fid = uploaded_id(client, team)
    write_model_folder(roots / "fresh", "qwen2", tie_word_embeddings=True)
    for mod, attr in (
        (safetensors.torch, "load_file"),
        (safetensors.torch, "load"),
        (safetensors, "safe_open"),
    ):
        real = getattr(mod, attr)
        if attr == "safe_open":
            monkeypatch.setattr(mod, attr, _header_only(real))
        else:
            monkeypatch.setattr(mod, attr, no_tensors)
    r = _create(client, team.headers, "fresh", fid)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "fresh"


def _header_only(real: Any) -> Any:
    """safe_open whose handles refuse get_tensor (keys, get_slice and shapes still work)."""

    class Handle:
        def __init__(self, *a: Any, **k: Any) -> None:
            self._h = real(*a, **k)

        def __enter__(self) -> Any:
            inner = self._h.__enter__()

            class Guard:
                def keys(self) -> Any:
                    return inner.keys()

                def get_slice(self, name: str) -> Any:
                    sl = inner.get_slice(name)

                    class Shape:
                        def get_shape(self) -> Any:
                            return sl.get_shape()

                    return Shape()

                def get_tensor(self, name: str) -> Any:
                    raise AssertionError(f"tensor {name} was read")

                def metadata(self) -> Any:
                    return inner.metadata()

            return Guard()

        def __exit__(self, *exc: Any) -> Any:
            return self._h.__exit__(*exc)

    return Handle
