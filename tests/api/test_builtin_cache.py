"""Built-in models' seeded downloads are a cache within a budget (issue 37): any key may ask for any
seed, and the data folder grows by no more than ``builtin_cache_bytes`` however many it asks for; the
least recently used folder goes first, never one still being sent; the bytes show in ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from api.builtin_cache import BUILTIN_DIR, BuiltinCache
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, make_team

MODEL = "tiny-llama"


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def one_folder(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Bytes of one built-in folder (the same at every seed)."""
    cache = BuiltinCache(tmp_path_factory.mktemp("zf-one"), 1 << 40)
    with cache.folder(MODEL, 0):
        pass
    return cache.usage().bytes


def test_the_least_recently_used_goes_first_never_one_being_sent(tmp_path: Path, one_folder: int) -> None:
    cache = BuiltinCache(tmp_path, 2 * one_folder)
    with cache.folder(MODEL, 1) as first:
        with cache.folder(MODEL, 2):
            pass
        with cache.folder(MODEL, 3):  # seed 2 goes, not seed 1: it is being sent
            assert first.is_dir() and not (tmp_path / f"{MODEL}-seed2").exists()
        assert (first / "model.safetensors").is_file()
    assert cache.usage().folders == 2 and cache.usage().bytes <= cache.budget_bytes
    with cache.folder(MODEL, 1):  # used again: seed 3 is now the least recently used
        pass
    with cache.folder(MODEL, 4):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{MODEL}-seed1", f"{MODEL}-seed4"]


def test_a_folder_over_the_budget_is_sent_then_removed(tmp_path: Path, one_folder: int) -> None:
    cache = BuiltinCache(tmp_path, one_folder // 2)
    with cache.folder(MODEL, 5) as folder:
        assert (folder / "model.safetensors").is_file()
    assert cache.usage().folders == 0 and not folder.exists()


@pytest.fixture(scope="module")
def budget_server(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory, one_folder: int
) -> Iterator[tuple[FastAPI, ServerThread]]:
    from api.app import create_app

    s = settings.model_copy(update={"data_dir": tmp_path_factory.mktemp("zf-bcache") / "var"})
    api_settings = TEST_API_SETTINGS.model_copy(update={"builtin_cache_bytes": 3 * one_folder})
    app = create_app(s, api_settings, enqueue=Enqueued())
    with ServerThread(app) as server:
        yield app, server


def test_a_hundred_seeded_heads_grow_the_data_folder_by_at_most_the_budget(
    budget_server: tuple[FastAPI, ServerThread],
) -> None:
    app, server = budget_server
    team = make_team(app)
    data_dir: Path = app.state.settings.data_dir
    budget = app.state.api_settings.builtin_cache_bytes
    before = _folder_bytes(data_dir)
    grew = 0
    with httpx.Client(base_url=server.base_url, headers=team.headers, timeout=60) as http:
        for seed in range(100):
            r = http.head(f"/v1/models/{MODEL}/content", params={"seed": seed})
            assert r.status_code == 200, r.text
            grew = max(grew, _folder_bytes(data_dir) - before)
        assert 0 < grew <= budget, (grew, budget)
        assert len(list((data_dir / BUILTIN_DIR).iterdir())) == 3  # the three newest seeds
        whole = http.get(f"/v1/models/{MODEL}/content", params={"seed": 0})  # evicted: written again
        assert whole.status_code == 200 and len(whole.content) == int(whole.headers["content-length"])
        metrics = http.get("/metrics").text
    wanted = ("zenflow_builtin_cache_bytes", "zenflow_builtin_cache_budget_bytes")
    gauges = {f.name: f.samples[0].value for f in text_string_to_metric_families(metrics) if f.name in wanted}
    assert gauges["zenflow_builtin_cache_budget_bytes"] == budget
    assert 0 < gauges["zenflow_builtin_cache_bytes"] <= budget
