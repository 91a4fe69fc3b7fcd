"""The self-serve console (/console, api/console.py + api/static/console/) in a real browser: headless
Debian Chromium driven by Playwright against ``zenflow serve`` (PostgreSQL, Redis, its in-process Celery
worker). Through the page, view by view (hash routes): paste a key, a refused upload's errors by line,
the sample uploaded, a job created and followed to ``succeeded`` in its own view (hyperparameters,
duration, charts with smoothing and log scale, events by level, checkpoints), the model downloaded,
the job's view opened by its address, two runs compared, a streamed chat answer and a side-by-side
answer, the dataset view, models (delete a checkpoint after confirming), quotas, a file deleted after
confirming, an unusable model never offered. A screenshot of each view is written (to
``$ZENFLOW_SCREENSHOT_DIR``, else tests/console/screenshots/) and checked. The API reference (/docs,
the vendored Swagger UI) renders under its own policy with no violation and no request to another
origin."""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.console.harness import LiveServer, page_problems

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ROOT = Path(__file__).resolve().parents[2]
#: Where the views' screenshots go (kept between runs; the folder's own .gitignore keeps them out of git).
SCREENSHOTS = Path(os.environ.get("ZENFLOW_SCREENSHOT_DIR") or Path(__file__).parent / "screenshots")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_console_is_served_with_a_strict_policy(tmp_path: Path) -> None:
    """Static files under a same-origin-only CSP, ES modules as JavaScript, the vendored chart
    library with its licence, the usual error object for a missing file; no inline script."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.core.config import ApiSettings
    from store.settings import Settings

    app = create_app(
        Settings(_env_file=None, data_dir=tmp_path),  # type: ignore[call-arg]
        ApiSettings(_env_file=None, migrate_on_start=False),
    )  # type: ignore[call-arg]
    client = TestClient(app)
    r = client.get("/console", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/console/")
    index = client.get("/console/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    csp = index.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert index.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in index.text and 'type="module" src="js/app.js"' in index.text
    js = client.get("/console/js/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/console/vendor/uplot/LICENSE").text.startswith("The MIT License")
    missing = client.get("/console/js/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # No page module builds HTML from strings: server text only ever becomes text nodes.
    for module in (ROOT / "api/static/console/js").glob("*.js"):
        source = module.read_text()
        assert "innerHTML" not in source and "insertAdjacentHTML" not in source, module.name


def test_api_docs_render_under_their_policy(browser: Browser, tmp_path: Path) -> None:
    """/docs in Chromium: Swagger UI, vendored, renders the API's operations under the page's CSP
    with no violation or error, and the page requests nothing from another origin."""
    from playwright.sync_api import expect

    from api.app import create_app
    from api.core.config import ApiSettings
    from store.settings import Settings
    from tests.api.conftest import ServerThread

    app = create_app(
        Settings(_env_file=None, data_dir=tmp_path),  # type: ignore[call-arg]
        ApiSettings(_env_file=None, migrate_on_start=False),  # type: ignore[call-arg]
    )
    with ServerThread(app) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems = page_problems(page)
        requested: list[str] = []
        page.on("request", lambda r: requested.append(r.url))
        page.goto(f"{server.base_url}/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("ZenFlow fine-tuning API")
        expect(
            page.locator(".opblock-summary-path", has_text="/v1/models/{model}/content").first
        ).to_be_visible()
        page.get_by_role("button", name="Authorize").first.click()  # the auth dialog opens: the UI works
        expect(page.locator(".dialog-ux")).to_be_visible()
        shot = tmp_path / "docs.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == PNG_MAGIC
        foreign = [u for u in requested if not u.startswith(server.base_url) and not u.startswith("data:")]
        assert foreign == [], foreign
        assert problems == [], problems
        page.close()


@pytest.mark.services  # the service on PostgreSQL and Redis, driven by a browser
def test_console_upload_create_follow_download_chat(
    browser: Browser, live_server: LiveServer, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    from trainer.samples import TRAIN_FILE, VALID_FILE

    team, key = live_server.team_key()
    page = browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 900})
    problems = page_problems(page)
    page.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)  # a loaded CI machine: a create checks and tokenizes the data first
    page.goto(f"{live_server.base_url}/console/")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def shot(name: str) -> None:
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000, path

    def nav(name: str, view: str) -> None:
        page.get_by_role("navigation", name="Console views").get_by_role("link", name=name).click()
        expect(page.locator("body")).to_have_attribute("data-view", view)

    expect(page.locator("body")).to_have_attribute("data-view", "jobs")  # no route: the jobs list
    page.get_by_label("Key", exact=True).fill(key)
    page.get_by_role("button", name="Use key").click()
    expect(page.locator("#key-status")).to_contain_text("Key accepted")

    # Datasets (#/files). A refused upload: the server's errors, by line, in a table.
    nav("Datasets", "files")
    assert page.url.endswith("#/files")
    expect(page.locator("#create-section")).to_be_hidden()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TRAIN_FILE.read_text().splitlines()[0] + '\n{"messages": "not a list"}\n')
    page.get_by_label("JSONL file").set_input_files(bad)
    page.get_by_role("button", name="Upload").click()
    errors = page.locator("#upload-result table.line-errors tbody tr")
    expect(errors).to_have_count(1)
    expect(errors.locator("td").first).to_have_text("2")
    expect(page.locator("#upload-result")).to_have_attribute("role", "alert")

    # The sample, one file under a name with markup in it: shown as text, never parsed. The validation
    # file is checked with the model at upload (its token counts then show in its dataset view).
    marked = "<img src=x onerror=alert(1)>capitals.jsonl"
    for name, path, model in ((marked, TRAIN_FILE, ""), ("capitals_valid.jsonl", VALID_FILE, "tiny-llama")):
        page.get_by_label("JSONL file").set_input_files(
            files=[{"name": name, "mimeType": "application/jsonl", "buffer": path.read_bytes()}]
        )
        page.get_by_label("Check with model").select_option(model)
        page.get_by_role("button", name="Upload").click()
        expect(page.locator("#files-table tbody")).to_contain_text(name)
    expect(page.locator("#upload-result")).to_contain_text("32 examples")
    assert page.locator("img").count() == 0
    valid_file_id = (
        page.locator("#files-table tbody tr", has_text="capitals_valid.jsonl")
        .locator("td")
        .first.inner_text()
    )
    train_file_id = (
        page.locator("#files-table tbody tr", has_text="capitals.jsonl")
        .first.locator("td")
        .first.inner_text()
    )

    # A job through the form (#/jobs): tiny-llama, 1 epoch of 128 examples at batch 16 = 8 steps.
    nav("Jobs", "jobs")
    page.locator("#job-model").select_option("tiny-llama")
    page.locator("#job-training-file").select_option(
        label=page.locator("#job-training-file option", has_text=marked).inner_text()
    )
    page.locator("#job-validation-file").select_option(
        label=page.locator("#job-validation-file option", has_text="capitals_valid.jsonl").inner_text()
    )
    page.get_by_label("Epochs").fill("100000")  # over the server's max_n_epochs: refused, the field marked
    page.get_by_role("button", name="Create job").click()
    expect(page.locator("#job-form-result")).to_contain_text("field hyperparameters.n_epochs")
    expect(page.get_by_label("Epochs")).to_have_attribute("aria-invalid", "true")
    page.get_by_label("Epochs").fill("1")
    page.get_by_label("Batch size").fill("16")
    page.get_by_label("Evaluate every (steps)").fill("4")
    page.get_by_label("Checkpoint every (steps)").fill("4")
    page.get_by_label("Engine mode").select_option("zenflow")
    page.get_by_label("Top-k ratio").fill("0.1")
    page.get_by_label("Update interval (steps)").fill("2")
    page.get_by_role("button", name="Create job").click()
    # The job's own view, at its own address.
    expect(page.locator("#job-section")).to_be_visible()
    expect(page.locator("#job-id")).to_have_text(re.compile(r"^ftjob-"))
    job_id = page.locator("#job-id").inner_text()
    assert page.url.endswith(f"#/jobs/{job_id}")
    expect(page.locator("#jobs-section")).to_be_hidden()
    # A second, shorter run to compare with, through the API.
    other = httpx.post(
        f"{live_server.base_url}/v1/fine_tuning/jobs",
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
        json={
            "model": "tiny-llama",
            "training_file": train_file_id,
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 16,
                "max_steps": 4,
                "learning_rate_multiplier": 4,
            },
        },
    )
    assert other.status_code == 200, other.text
    other_id = other.json()["id"]

    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=180_000)
    ft_id = f"ft:tiny-llama:{team}::{job_id}"
    expect(page.locator("#job-result-model")).to_have_text(ft_id)
    expect(page.locator("#job-progress-text")).to_have_text("step 8 of 8")
    expect(page.locator("#events-log")).to_contain_text("Job succeeded")
    expect(page.locator("#events-status")).to_have_text("The job has finished.")
    # Hyperparameters as resolved, the data, duration and finish.
    expect(_kv(page, "#job-hyperparameters", "batch_size")).to_have_text("16")
    expect(_kv(page, "#job-hyperparameters", "total_steps")).to_have_text("8")
    expect(_kv(page, "#job-hyperparameters", "engine.mode")).to_have_text("zenflow")
    expect(_kv(page, "#job-data", "training_file")).to_have_text(train_file_id)
    expect(_kv(page, "#job-data", "validation_file")).to_have_text(valid_file_id)
    expect(page.locator("#job-duration")).to_have_text(re.compile(r"^\d+ (s|min \d\d s)$"))
    expect(page.locator("#job-eta")).to_have_text("finished")
    expect(page.locator("#job-created")).not_to_be_empty()
    # The charts, fed by the metrics endpoint: every step, validation loss where it was evaluated.
    expect(page.locator("#chart-loss-latest")).to_contain_text("train loss")
    expect(page.locator("#chart-loss-latest")).to_contain_text("validation loss")
    expect(page.locator("#chart-loss-latest")).to_contain_text("at step 8")
    expect(page.locator("#chart-stall-latest")).to_contain_text("%")
    expect(page.locator("#chart-tokens-latest")).to_contain_text("tokens/s")
    expect(page.locator("#charts canvas")).to_have_count(4)
    gpu = page.locator("#chart-gpu-latest").inner_text()
    if "%" not in gpu:  # a CPU run says why its GPU chart is empty
        assert "no GPU" in gpu and "CPU run" in gpu, gpu
    latest_before = page.locator("#chart-loss-latest").inner_text()
    page.locator("#chart-smoothing").fill("0.9")
    expect(page.locator("#chart-smoothing-value")).to_have_text("0.9")
    expect(page.locator("#chart-loss-latest")).to_have_text(latest_before)  # the text keeps raw values
    page.get_by_label("Log scale (loss)").check()
    expect(page.locator("#chart-loss")).to_have_attribute("data-scale", "log")
    expect(page.locator("#chart-loss canvas")).to_have_count(1)
    # Checkpoints with their losses.
    expect(page.locator("#checkpoints-table tbody tr")).to_have_count(2)
    first_ckpt = page.locator("#checkpoints-table tbody tr").first
    expect(first_ckpt).to_contain_text(f"{ft_id}:ckpt-step-8")
    expect(first_ckpt.locator("td").nth(1)).to_have_text(re.compile(r"^\d+(\.\d+)?(e[-+]?\d+)?$"))
    expect(first_ckpt.locator("td").nth(2)).to_have_text(re.compile(r"^\d+(\.\d+)?(e[-+]?\d+)?$"))
    # Events: step metrics hidden until asked for, then filtered by level.
    log = page.locator("#events-log li")
    expect(page.locator("#events-log li[data-type=metrics]")).to_have_count(0)
    shown_messages = log.count()
    page.get_by_label("Show step metrics").check()
    expect(page.locator("#events-log li[data-type=metrics]").first).to_be_visible()
    assert log.count() > shown_messages
    page.get_by_label("Show step metrics").uncheck()
    expect(log).to_have_count(shown_messages)
    page.get_by_label("Level", exact=True).select_option("error")
    expect(page.locator("#events-count")).to_have_text(re.compile(r"^0 of \d+ events shown$"))
    page.get_by_label("Level", exact=True).select_option("all")
    expect(log).to_have_count(shown_messages)
    shot("job")

    # The model, downloaded through the page, checksum verified in the browser.
    with page.expect_download() as download:
        page.get_by_role("button", name="Download model").click()
    saved = tmp_path / "model.tar"
    download.value.save_as(saved)
    expect(page.locator("#download-status")).to_contain_text("SHA-256 verified")
    with tarfile.open(saved) as tar:
        assert {"config.json", "model.safetensors"} <= set(tar.getnames())

    # The job's view opened by its address (a fresh load of the page).
    page.goto("about:blank")
    page.goto(f"{live_server.base_url}/console/#/jobs/{job_id}")
    expect(page.locator("#job-section")).to_be_visible()
    expect(page.locator("#job-id")).to_have_text(job_id)
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#checkpoints-table tbody tr")).to_have_count(2)
    expect(page.get_by_role("link", name="Jobs", exact=True)).to_have_attribute("aria-current", "page")

    # The runs table: two runs' loss curves on one chart.
    expect(
        page.locator("#job-status")  # the second run finishes too (it queued behind the first)
    ).to_have_text("succeeded")
    _wait_job(live_server.base_url, key, other_id)
    nav("Jobs", "jobs")
    expect(page.locator(f'#jobs-table tr[data-job="{other_id}"]')).to_contain_text("succeeded")
    page.get_by_label(f"Compare job {job_id}").check()
    page.get_by_label(f"Compare job {other_id}").check()
    page.get_by_role("button", name="Compare selected").click()
    expect(page.locator("#compare-figure")).to_have_attribute("data-series", "2")
    expect(page.locator("#compare-status")).to_contain_text(f"({job_id}) (8 steps)")
    expect(page.locator("#compare-status")).to_contain_text(f"({other_id}) (4 steps)")
    legend = page.locator("#compare-figure .u-legend .u-series")
    expect(legend).to_have_count(2)  # one series a run
    expect(legend.first).to_contain_text(job_id)
    expect(legend.last).to_contain_text(other_id)
    expect(page.locator("#compare-figure canvas")).to_have_count(1)
    page.get_by_label("Log scale", exact=True).check()  # redrawn at once, on a log scale
    expect(page.locator("#compare-figure")).to_have_attribute("data-scale", "log")
    page.locator("#compare-smoothing").fill("0.5")
    expect(page.locator("#compare-figure")).to_have_attribute("data-smoothing", "0.5")
    page.get_by_label("Metric", exact=True).select_option("valid_loss")
    expect(page.locator("#compare-figure")).to_have_attribute("data-metric", "valid_loss")
    expect(page.locator("#compare-status")).to_contain_text("Validation loss of")
    expect(page.locator("#compare-figure figcaption")).to_have_text("Validation loss by step")
    page.get_by_label("Metric", exact=True).select_option("train_loss")
    expect(page.locator("#compare-figure figcaption")).to_have_text("Train loss by step")
    page.locator("#jobs-table").get_by_role(
        "link", name=other_id, exact=True
    ).click()  # a run's link opens its view
    expect(page.locator("#job-id")).to_have_text(other_id)
    page.go_back()
    expect(page.locator("body")).to_have_attribute("data-view", "jobs")
    page.get_by_label(f"Compare job {job_id}").check()
    page.get_by_label(f"Compare job {other_id}").check()
    page.get_by_role("button", name="Compare selected").click()
    expect(page.locator("#compare-figure")).to_have_attribute("data-series", "2")
    shot("runs")

    # A streamed chat answer equals the API's greedy answer to the same request.
    page.get_by_role("link", name=job_id, exact=True).click()
    expect(page.locator("#job-id")).to_have_text(job_id)
    expect(page.locator("#job-status")).to_have_text("succeeded")
    page.get_by_role("button", name="Chat with this model").click()
    expect(page.locator("body")).to_have_attribute("data-view", "chat")
    expect(page.locator("#chat-model")).to_have_value(ft_id)
    page.get_by_label("Max tokens", exact=True).fill("16")
    question = "What is the capital of France?"
    page.get_by_label("Message", exact=True).fill(question)
    page.get_by_role("button", name="Send").click()
    reply = page.locator("#chat-log li.assistant")
    expect(reply).to_have_attribute("data-state", "done", timeout=60_000)
    expect(page.locator("#chat-status")).to_contain_text("completion tokens")
    shown = reply.locator(".text").text_content()
    expected = _chat(live_server.base_url, key, ft_id, question, max_tokens=16)
    assert shown == expected["choices"][0]["message"]["content"]
    assert reply.get_attribute("data-completion-tokens") == str(expected["usage"]["completion_tokens"])
    assert expected["usage"]["completion_tokens"] >= 1

    # Side by side: the base model and the fine-tuned one answer the same prompt.
    page.go_back()
    expect(page.locator("#job-id")).to_have_text(job_id)
    expect(page.locator("#job-status")).to_have_text("succeeded")
    page.get_by_role("button", name="Compare with the base model").click()
    expect(page.locator("body")).to_have_attribute("data-view", "chat")
    expect(page.locator("#side-left")).to_have_value("tiny-llama")
    expect(page.locator("#side-right")).to_have_value(ft_id)
    page.get_by_label("Max tokens per answer").fill("16")
    page.get_by_label("Prompt", exact=True).fill(question)
    page.get_by_role("button", name="Ask both").click()
    for pane in ("#side-left-answer", "#side-right-answer"):
        expect(page.locator(pane)).to_have_attribute("data-state", "done", timeout=60_000)
    expect(page.locator("#side-left-answer figcaption")).to_have_text("tiny-llama")
    expect(page.locator("#side-right-answer figcaption")).to_have_text(ft_id)
    assert (
        page.locator("#side-right-answer .text").text_content()
        == expected["choices"][0]["message"]["content"]
    )
    base_answer = _chat(live_server.base_url, key, "tiny-llama", question, max_tokens=16)
    assert (
        page.locator("#side-left-answer .text").text_content()
        == base_answer["choices"][0]["message"]["content"]
    )
    shot("chat")

    # The dataset view: the check with the model, problems by line, lengths, examples with learned turns.
    nav("Datasets", "files")
    shot("files")
    page.locator("#files-table").get_by_role("link", name=valid_file_id, exact=True).click()
    assert page.url.endswith(f"#/files/{valid_file_id}")
    expect(page.locator("#file-id")).to_have_text(valid_file_id)
    expect(page.locator("#file-facts")).to_contain_text("capitals_valid.jsonl")
    expect(_kv(page, "#file-validation-table", "model")).to_have_text("tiny-llama")
    expect(_kv(page, "#file-validation-table", "examples kept")).to_have_text("32")
    expect(page.locator("#file-problems")).to_contain_text(
        "No problems found in the whole file (32 examples read)"
    )
    # Rendered with the view's model (GET /v1/files/{id}/preview): tokens, the learned text marked.
    expect(page.locator("#file-lengths-heading")).to_contain_text("tokens")
    expect(page.locator("#file-histogram")).to_contain_text("32 examples: tokens per example")
    expect(page.locator("#file-histogram-table tbody tr")).to_have_count(10)
    examples = page.locator("#file-examples > li")
    expect(examples).to_have_count(5)
    first = json.loads(VALID_FILE.read_text().splitlines()[0])["messages"]
    expect(examples.first.locator(".learned-piece").first).to_contain_text(first[-1]["content"])
    expect(examples.first.locator(".rendered")).to_contain_text(first[0]["content"])
    shot("dataset")
    # Its address, loaded afresh, opens the same view.
    page.goto("about:blank")
    page.goto(f"{live_server.base_url}/console/#/files/{valid_file_id}")
    expect(page.locator("#file-examples > li")).to_have_count(5)

    # Models: a checkpoint deleted, once the deletion is confirmed.
    nav("Models", "models")
    ckpt4 = f"{ft_id}:ckpt-step-4"
    row = page.locator(f'#models-table tr[data-model="{ckpt4}"]')
    expect(row).to_contain_text("checkpoint")
    expect(page.locator(f'#models-table tr[data-model="{ft_id}"]')).to_contain_text("fine-tuned")
    expect(page.locator('#models-table tr[data-model="tiny-llama"]')).to_contain_text("yes")
    expect(
        page.locator('#models-table tr[data-model="tiny-llama"]').get_by_role("button", name="Delete")
    ).to_have_count(0)
    shot("models")
    page.get_by_role("button", name=f"Delete model {ckpt4}").click()
    expect(page.locator("#confirm-dialog")).to_be_visible()
    expect(page.locator("#confirm-text")).to_contain_text(ckpt4)
    page.locator("#confirm-cancel").click()
    expect(page.locator("#confirm-dialog")).to_be_hidden()
    expect(row).to_have_count(1)
    assert _get(live_server.base_url, key, f"/v1/models/{ckpt4}") == 200
    page.get_by_role("button", name=f"Delete model {ckpt4}").click()
    page.locator("#confirm-ok").click()
    expect(page.locator("#models-status")).to_contain_text(f"Deleted {ckpt4}")
    expect(row).to_have_count(0)
    assert _get(live_server.base_url, key, f"/v1/models/{ckpt4}") == 404

    # Quotas and usage: the team's own storage limit beside the server's defaults.
    live_server.set_storage_quota(team, 1 << 30)
    nav("Quotas and usage", "quotas")
    storage = page.locator('#quotas-table tr[data-quota="storage_bytes"]')
    expect(storage.locator("td").nth(1)).to_have_text("1.0 GiB")
    expect(storage.locator("td").nth(3)).to_have_text("your team")
    expect(storage.locator("meter")).to_have_count(1)
    expect(page.locator('#quotas-table tr[data-quota="gpu_hours"] td').nth(3)).to_have_text("server default")
    quotas = page.locator("#quotas-table tbody tr")
    expect(quotas).to_have_count(4)
    expect(page.locator('#quotas-table tr[data-quota="storage_bytes"] td').first).to_have_text(
        re.compile(r"^\d+(\.\d)? (KiB|MiB|GiB)$")
    )
    expect(page.locator('#quotas-table tr[data-quota="max_running_jobs"] td').first).to_have_text("0")
    expect(page.locator("#quotas-period")).to_contain_text("days")
    shot("quotas")

    # A file deleted from the datasets view after confirming.
    nav("Datasets", "files")
    file_row = page.locator(f'#files-table tr[data-file="{valid_file_id}"]')
    expect(file_row).to_have_count(1)
    page.get_by_role("button", name=f"Delete file {valid_file_id}").click()
    expect(page.locator("#confirm-text")).to_contain_text("capitals_valid.jsonl")
    page.locator("#confirm-ok").click()
    expect(file_row).to_have_count(0)
    expect(page.locator("#upload-result")).to_contain_text(f"Deleted capitals_valid.jsonl ({valid_file_id})")
    assert _get(live_server.base_url, key, f"/v1/files/{valid_file_id}") == 404

    # A model the server marks unusable (a broken base folder) is shown as such and never offered.
    def mark_unusable(route: Any) -> None:
        response = route.fetch()
        body = response.json()
        for m in body["data"]:
            if m["id"] == "tiny-llama":
                m["usable"] = False
        route.fulfill(response=response, json=body)

    page.route("**/v1/models", mark_unusable)
    nav("Models", "models")
    page.get_by_role("button", name="Refresh models").click()
    expect(page.locator('#models-table tr[data-model="tiny-llama"]')).to_contain_text("no")
    nav("Jobs", "jobs")
    expect(page.locator('#job-model option[value="tiny-llama"]')).to_be_disabled()
    assert page.locator("#job-model").input_value() != "tiny-llama"
    page.unroute("**/v1/models")
    assert problems == [], problems


def _kv(page: Page, table: str, key: str) -> Any:
    """The value cell of a key/value table's row ``key``."""
    return page.locator(f'{table} tr:has(th:text-is("{key}")) td')


def _get(base_url: str, key: str, path: str) -> int:
    return httpx.get(f"{base_url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def _wait_job(base_url: str, key: str, job_id: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(
            f"{base_url}/v1/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        status = r.json()["status"]
        if status in ("succeeded", "failed", "cancelled"):
            assert status == "succeeded", r.text
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)


def _chat(base_url: str, key: str, model: str, question: str, *, max_tokens: int) -> dict[str, Any]:
    """The non-streamed answer to what the page sent (temperature 0: greedy)."""
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
        },
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = json.loads(r.text)
    return body
