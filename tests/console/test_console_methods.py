"""The console's flows for every method, in Chromium against ``zenflow serve``: the create form follows the
method (DPO's and reinforcement's files, never a file of another kind chosen; a reinforcement grader
checked by the server before any job, its refusal shown by the field; LoRA rank and alpha; an API
refusal shown by the field it names); a DPO and a reinforcement job's pages (their own charts first, at
the top; the plan in GiB, s and %; the run's name); models with their checkpoints under them and a
download button; quotas without the team's id; the views at phone width (420 px) with no id squeezed to
a character a line. With ``ZENFLOW_CONSOLE_SHOTS=<dir>`` the last test writes a screenshot of every view
at 1400 px and 420 px there."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.api.test_dpo import preference_jsonl
from tests.console.harness import LiveServer, page_problems

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.services  # the service on PostgreSQL and Redis, driven by a browser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WIDE, PHONE = 1400, 420
SHOTS = os.environ.get("ZENFLOW_CONSOLE_SHOTS")


@dataclass
class Team:
    name: str
    key: str
    base_url: str
    files: dict[str, str]
    jobs: dict[str, str]

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(
            method,
            f"{self.base_url}{path}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
            **kw,
        )

    def job(self, job_id: str) -> dict[str, Any]:
        body: dict[str, Any] = self.call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
        return body

    def wait(self, job_id: str, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                assert job["status"] == "succeeded", job
                return job
            assert time.monotonic() < deadline, job
            time.sleep(1)


@pytest.fixture(scope="module")
def team(live_server: LiveServer) -> Iterator[Team]:
    """A team with a file of each kind (format-only uploads, the reinforcement file newest) and three
    short jobs on tiny-llama queued at once: supervised, DPO and reinforcement, each named by a suffix."""
    from trainer.samples import KEYWORD_GRADER, KEYWORD_TRAIN_FILE, SAMPLES_DIR, TRAIN_FILE

    name, key = live_server.team_key()
    t = Team(name, key, live_server.base_url, {}, {})
    uploads = {
        "sft": ("capitals.jsonl", TRAIN_FILE.read_bytes()),
        "dpo": ("pairs.jsonl", preference_jsonl(16)),
        "rl_valid": ("keyword_valid.jsonl", (SAMPLES_DIR / "keyword_rl_valid.jsonl").read_bytes()),
        "rl": ("keyword_train.jsonl", KEYWORD_TRAIN_FILE.read_bytes()),
    }
    for kind, (filename, content) in uploads.items():
        r = t.call("POST", "/v1/files", data={"purpose": "fine-tune"}, files={"file": (filename, content)})
        assert r.status_code == 200, r.text
        t.files[kind] = r.json()["id"]
    every = {"n_epochs": 1, "batch_size": 8, "checkpoint_every": 1, "eval_every": 2}
    bodies = {
        "sft": {
            "model": "tiny-llama",
            "training_file": t.files["sft"],
            "suffix": "capitals-sft",
            "hyperparameters": {**every, "max_steps": 2},
        },
        "dpo": {
            "model": "tiny-llama",
            "training_file": t.files["dpo"],
            "validation_file": t.files["dpo"],
            "suffix": "house-dpo",
            "method": {"type": "dpo", "dpo": {"hyperparameters": every}},
        },
        "rl": {
            "model": "tiny-llama",
            "training_file": t.files["rl"],
            "validation_file": t.files["rl_valid"],
            "suffix": "keyword-rl",
            "method": {
                "type": "reinforcement",
                "reinforcement": {
                    "grader": KEYWORD_GRADER,
                    "hyperparameters": {
                        **every,
                        "batch_size": 4,
                        "max_steps": 2,
                        "compute_multiplier": 0.25,
                        "eval_samples": 1,
                        "max_completion_tokens": 8,
                        "max_seq_length": 96,
                    },
                },
            },
        },
    }
    for kind, body in bodies.items():
        r = t.call("POST", "/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        t.jobs[kind] = r.json()["id"]
    yield t


def _open(browser: Browser, live_server: LiveServer, key: str, width: int, **kw: Any) -> Page:
    """The console at ``width`` px with ``key`` in use (the key section folded to one line)."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": width, "height": 900}, **kw)
    page.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)
    page.goto(f"{live_server.base_url}/console/")
    page.get_by_label("Key", exact=True).fill(key)
    page.get_by_role("button", name="Use key").click()
    expect(page.locator("#key-status")).to_contain_text("Key accepted")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.get_by_role("button", name="Change key")).to_be_visible()
    return page


def _nav(page: Page, name: str, view: str) -> None:
    from playwright.sync_api import expect

    page.get_by_role("navigation", name="Console views").get_by_role("link", name=name).click()
    expect(page.locator("body")).to_have_attribute("data-view", view)


def test_the_create_form_follows_the_method(browser: Browser, live_server: LiveServer, team: Team) -> None:
    from playwright.sync_api import expect

    page = _open(browser, live_server, team.key, WIDE)
    problems = page_problems(page)
    training = page.locator("#job-training-file")
    # Supervised (the default): the chat file is chosen although the reinforcement file is the newest;
    # the other kinds are listed, disabled.
    expect(page.locator("#job-method")).to_have_value("supervised")
    expect(training).to_have_value(team.files["sft"])
    expect(training.locator(f'option[value="{team.files["rl"]}"]')).to_be_disabled()
    expect(training.locator(f'option[value="{team.files["dpo"]}"]')).to_be_disabled()
    expect(page.locator("#job-validation-file")).to_have_value("")
    expect(page.locator("#grader-fieldset")).to_be_hidden()
    expect(page.get_by_label("DPO beta")).to_be_hidden()
    # DPO: the pairs, and beta.
    page.get_by_label("Method", exact=True).select_option("dpo")
    expect(training).to_have_value(team.files["dpo"])
    expect(training.locator(f'option[value="{team.files["sft"]}"]')).to_be_disabled()
    expect(page.get_by_label("DPO beta")).to_be_visible()
    # Reinforcement: its prompts, and the grader, checked by the server before any job is created.
    page.get_by_label("Method", exact=True).select_option("reinforcement")
    expect(training).to_have_value(team.files["rl"])
    expect(page.locator("#grader-fieldset")).to_be_visible()
    jobs_before = len(team.call("GET", "/v1/fine_tuning/jobs").json()["data"])
    grader = page.get_by_label("Grader JSON")
    grader.fill('{"type": "string_check",')
    page.get_by_role("button", name="Create job").click()
    expect(page.locator("#job-grader-error")).to_contain_text("Not JSON")
    expect(grader).to_have_attribute("aria-invalid", "true")
    bad = {
        "type": "string_check",
        "name": "uses the word",
        "input": "{{sample.output_text}}",
        "reference": "{{item.keyword}}",
        "operation": "sounds_like",
    }
    grader.fill(json.dumps(bad))
    with page.expect_response("**/v1/fine_tuning/alpha/graders/validate") as checked:
        page.get_by_role("button", name="Create job").click()
    assert checked.value.status == 400
    error = page.locator("#job-grader-error")
    expect(error).to_contain_text("operation")
    expect(error).to_have_attribute("data-param", re.compile(r"^grader"))
    assert error.evaluate("e => e.previousElementSibling.id") == "job-grader"  # shown by the field
    expect(page.locator("#job-form-result")).to_contain_text("grader was refused")
    assert len(team.call("GET", "/v1/fine_tuning/jobs").json()["data"]) == jobs_before
    # DPO with LoRA through the form: a refusal shown by the field it names, then created.
    page.get_by_label("Method", exact=True).select_option("dpo")
    expect(page.locator("#job-grader-error")).to_have_count(0)  # a new method clears the old marks
    page.locator("#job-model").select_option("tiny-llama")
    page.get_by_label("Suffix").fill("form-dpo")
    page.get_by_label("Epochs").fill("100000")
    page.get_by_label("LoRA rank").fill("4")
    page.get_by_label("LoRA alpha").fill("32")
    page.get_by_role("button", name="Create job").click()
    epochs_error = page.locator("#hp-epochs-error")
    expect(epochs_error).to_be_visible()
    expect(epochs_error).to_have_attribute("data-param", re.compile(r"n_epochs$"))
    expect(page.get_by_label("Epochs")).to_have_attribute("aria-invalid", "true")
    assert epochs_error.evaluate("e => e.previousElementSibling.id") == "hp-epochs"
    page.get_by_label("Epochs").fill("1")
    page.get_by_label("Max steps").fill("1")
    page.get_by_role("button", name="Create job").click()
    expect(page.locator("#job-section")).to_be_visible()
    expect(page.locator("#job-id")).to_have_text(re.compile(r"^ftjob-"))
    expect(page.locator("#job-name")).to_have_text("form-dpo")
    expect(page.locator("#job-method-name")).to_contain_text("DPO with a LoRA adapter")
    job_id = page.locator("#job-id").inner_text()
    team.call("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel")  # the three jobs above go first
    job = team.job(job_id)
    assert job["method"]["type"] == "dpo" and job["training_file"] == team.files["dpo"]
    lora = job["method"]["dpo"]["hyperparameters"]["lora"]
    assert (lora["r"], lora["alpha"]) == (4, 32)
    assert problems == [], problems
    page.close()


def _top(page: Page, selector: str) -> float:
    box = page.locator(selector).bounding_box()
    assert box is not None, selector
    return float(box["y"])


def test_dpo_and_reinforcement_pages_chart_their_method_first(
    browser: Browser, live_server: LiveServer, team: Team
) -> None:
    from playwright.sync_api import expect

    for kind in ("sft", "dpo", "rl"):
        team.wait(team.jobs[kind])
    page = _open(browser, live_server, team.key, WIDE)
    problems = page_problems(page)
    # DPO: reward margin and accuracy, then its loss; at the top of the page, above the settings and plan.
    page.goto(f"{live_server.base_url}/console/#/jobs/{team.jobs['dpo']}")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#job-name")).to_have_text("house-dpo")
    charts = page.locator("#charts > figure")
    expect(page.locator("#charts")).to_have_attribute("data-method", "dpo")
    expect(charts.first).to_have_attribute("id", "chart-margin")
    expect(charts.nth(1)).to_have_attribute("id", "chart-accuracy")
    expect(page.locator("#chart-margin-latest")).to_contain_text("reward margin")
    expect(page.locator("#chart-margin-latest")).to_contain_text("at step 2")
    expect(page.locator("#chart-accuracy-latest")).to_contain_text(
        re.compile(r"accuracy \d+(\.\d+)?% at step 2")
    )
    expect(page.locator("#chart-loss figcaption")).to_have_text("DPO loss")
    expect(page.locator("#chart-loss-latest")).to_contain_text("validation loss")
    expect(page.locator("#job-plan-table")).to_be_visible()
    assert _top(page, "#charts") < 900  # in the first screen
    assert _top(page, "#charts") < _top(page, "#job-hyperparameters") < _top(page, "#job-plan-table") + 1
    # The plan reads in units: bytes in GiB/MiB with their share, seconds in s; no raw byte counts.
    plan = page.locator("#job-plan-table").inner_text()
    assert re.search(r"\d+(\.\d)? (MiB|GiB) of \d+(\.\d)? (MiB|GiB|TiB) \(\d+(\.\d+)?%\)", plan), plan
    assert re.search(r"\d+(\.\d+)? s\b", plan), plan
    assert not re.search(r"\d{7,}", plan.replace(",", "")), plan  # 23128698880-like figures are gone
    # Reinforcement: the rewards first (mean, min, max, validation), then the policy loss.
    page.goto(f"{live_server.base_url}/console/#/jobs/{team.jobs['rl']}")
    expect(page.locator("#job-name")).to_have_text("keyword-rl")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#charts")).to_have_attribute("data-method", "reinforcement")
    expect(charts.first).to_have_attribute("id", "chart-reward")
    expect(page.locator("#chart-reward-latest")).to_contain_text("mean reward")
    expect(page.locator("#chart-reward-latest")).to_contain_text("max reward")
    expect(page.locator("#chart-reward-latest")).to_contain_text("validation reward")
    expect(page.locator("#chart-loss figcaption")).to_have_text("Policy loss")
    expect(page.locator("#chart-margin")).to_have_count(0)
    expect(page.locator("#job-method-name")).to_contain_text("grader uses the word")
    # Supervised: the loss first.
    page.goto(f"{live_server.base_url}/console/#/jobs/{team.jobs['sft']}")
    expect(page.locator("#job-name")).to_have_text("capitals-sft")
    expect(charts.first).to_have_attribute("id", "chart-loss")
    expect(page.locator("#chart-reward")).to_have_count(0)
    # The runs list and the comparison's legend name the runs.
    _nav(page, "Jobs", "jobs")
    for kind, name in (("sft", "capitals-sft"), ("dpo", "house-dpo"), ("rl", "keyword-rl")):
        expect(page.locator(f'#jobs-table tr[data-job="{team.jobs[kind]}"] td.run')).to_contain_text(name)
    expect(page.locator(f'#jobs-table tr[data-job="{team.jobs["dpo"]}"] td.run')).to_contain_text("DPO")
    page.get_by_label(f"Compare job {team.jobs['sft']}").check()
    page.get_by_label(f"Compare job {team.jobs['dpo']}").check()
    page.get_by_role("button", name="Compare selected").click()
    legend = page.locator("#compare-figure .u-legend .u-series")
    expect(legend).to_have_count(2)  # one a run
    expect(page.locator("#compare-figure .u-legend")).to_contain_text("capitals-sft")
    expect(page.locator("#compare-figure .u-legend")).to_contain_text("house-dpo")
    page.get_by_label("Metric", exact=True).select_option("reward_margin")
    expect(page.locator("#compare-figure")).to_have_attribute("data-metric", "reward_margin")
    assert problems == [], problems
    page.close()


def test_models_group_checkpoints_under_their_model_and_download_and_files_say_their_kind(
    browser: Browser, live_server: LiveServer, team: Team, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    ft = team.wait(team.jobs["dpo"])["fine_tuned_model"]
    page = _open(browser, live_server, team.key, WIDE, accept_downloads=True)
    problems = page_problems(page)
    _nav(page, "Models", "models")
    group = page.locator(f'#models-table tbody[data-group="{ft}"]')
    rows = group.locator("tr")
    expect(rows.first).to_have_attribute("data-model", ft)  # the model, then its checkpoints, newest first
    expect(rows.nth(1)).to_have_attribute("data-model", f"{ft}:ckpt-step-2")
    expect(rows.nth(1)).to_have_attribute("data-parent", ft)
    expect(rows.nth(1).locator("td").first).to_contain_text("step 2")
    expect(group.locator("tr[data-parent]")).to_have_count(2)
    expect(
        page.locator('#models-table tbody[data-group="builtin"] tr[data-model="tiny-llama"]')
    ).to_have_count(1)
    # No checkpoint of the team sits outside its model's group.
    outside = page.locator(f'#models-table tbody:not([data-group="{ft}"]) tr[data-model^="{ft}:"]')
    expect(outside).to_have_count(0)
    with page.expect_download() as download:
        page.get_by_role("button", name=f"Download model {ft}:ckpt-step-1").click()
    saved = tmp_path / "ckpt.tar"
    download.value.save_as(saved)
    expect(page.locator("#models-status")).to_contain_text("SHA-256 verified")
    assert saved.stat().st_size > 10_000
    expect(
        page.locator('#models-table tr[data-model="tiny-llama"]').get_by_role("button", name="Download")
    ).to_have_count(0)
    # Datasets say each file's kind (the file object's format) and the method it trains.
    _nav(page, "Datasets", "files")
    for kind, shown in (
        ("sft", "chat (supervised)"),
        ("dpo", "preference pairs (DPO)"),
        ("rl", "prompts (reinforcement)"),
    ):
        expect(page.locator(f'#files-table tr[data-file="{team.files[kind]}"] td.format')).to_have_text(shown)
    # Quotas: the team's limits, not its id.
    team_id = team.call("GET", "/v1/quotas").json()["organization_id"]
    _nav(page, "Quotas and usage", "quotas")
    expect(page.locator("#quotas-period")).to_contain_text("Your team's limits")
    expect(page.locator("#quotas-section")).not_to_contain_text(team_id)
    assert problems == [], problems
    page.close()


def _squeezed_ids(page: Page) -> list[str]:
    """Visible ids (job and model ids) laid out narrower than 10 characters: wrapped a character or
    a few a line."""
    result: list[str] = page.evaluate(
        """() => [...document.querySelectorAll("td.id a, td.id .mono, #job-id")]
          .filter((e) => e.offsetParent !== null && e.textContent.length > 10)
          .filter((e) => e.getBoundingClientRect().width < 10 * parseFloat(getComputedStyle(e).fontSize) * 0.55)
          .map((e) => e.textContent)"""
    )
    return result


def _overflow(page: Page) -> list[str]:
    """The visible elements that reach past the window's right edge (the page would scroll sideways)."""
    found: list[str] = page.evaluate(
        """() => document.documentElement.scrollWidth <= window.innerWidth ? [] :
          [...document.querySelectorAll("body *")]
            .filter((e) => e.offsetParent !== null && e.getBoundingClientRect().right > window.innerWidth + 1)
            .filter((e) => !e.parentElement || e.parentElement.getBoundingClientRect().right <= window.innerWidth + 1)
            .map((e) => `${e.tagName.toLowerCase()}#${e.id}.${e.className} ${Math.round(e.getBoundingClientRect().width)}px`)"""
    )
    return found


def test_phone_width(browser: Browser, live_server: LiveServer, team: Team) -> None:
    """At 420 px: no page scrolls sideways (wide tables scroll inside their box), no id is squeezed."""
    from playwright.sync_api import expect

    team.wait(team.jobs["dpo"])
    page = _open(browser, live_server, team.key, PHONE)
    problems = page_problems(page)
    expect(page.locator(f'#jobs-table tr[data-job="{team.jobs["dpo"]}"]')).to_be_visible()
    assert _overflow(page) == []
    assert _squeezed_ids(page) == []
    page.goto(f"{live_server.base_url}/console/#/jobs/{team.jobs['dpo']}")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#checkpoints-table tbody tr")).to_have_count(2)
    assert _overflow(page) == []
    assert _squeezed_ids(page) == []
    box = page.locator("#charts > figure").first.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE
    _nav(page, "Models", "models")
    expect(page.locator("#models-table tr[data-parent]").first).to_be_visible()
    assert _overflow(page) == []
    assert _squeezed_ids(page) == []
    for name, view in (("Datasets", "files"), ("Chat", "chat"), ("Quotas and usage", "quotas")):
        _nav(page, name, view)
        assert _overflow(page) == [], view
    assert problems == [], problems
    page.close()


@pytest.mark.skipif(not SHOTS, reason="ZENFLOW_CONSOLE_SHOTS names the folder for the screenshots")
def test_screenshots_of_every_view(browser: Browser, live_server: LiveServer, team: Team) -> None:
    from playwright.sync_api import expect

    out = Path(SHOTS or ".")
    out.mkdir(parents=True, exist_ok=True)
    for kind in ("sft", "dpo", "rl"):
        team.wait(team.jobs[kind])
    for width in (WIDE, PHONE):
        page = _open(browser, live_server, team.key, width)

        def shot(name: str, page: Page = page, width: int = width) -> None:
            path = out / f"{name}-{width}.png"
            page.wait_for_timeout(300)  # the charts' last resize
            page.screenshot(path=str(path), full_page=True)
            assert path.read_bytes()[:8] == PNG_MAGIC, path

        expect(page.locator(f'#jobs-table tr[data-job="{team.jobs["rl"]}"]')).to_be_visible()
        shot("jobs")
        page.get_by_label("Method", exact=True).select_option("reinforcement")
        shot("jobs-create-reinforcement")
        for kind, name in (("sft", "job-supervised"), ("dpo", "job-dpo"), ("rl", "job-reinforcement")):
            page.goto(f"{live_server.base_url}/console/#/jobs/{team.jobs[kind]}")
            expect(page.locator("#job-status")).to_have_text("succeeded")
            expect(page.locator("#checkpoints-table tbody tr").first).to_be_visible()
            expect(page.locator("#job-plan-table")).to_be_visible()
            shot(name)
        _nav(page, "Datasets", "files")
        expect(page.locator(f'#files-table tr[data-file="{team.files["dpo"]}"]')).to_be_visible()
        shot("files")
        page.goto(f"{live_server.base_url}/console/#/files/{team.files['sft']}")
        expect(page.locator("#file-examples > li").first).to_be_visible()
        shot("dataset")
        _nav(page, "Models", "models")
        expect(page.locator("#models-table tr[data-parent]").first).to_be_visible()
        shot("models")
        _nav(page, "Chat", "chat")
        shot("chat")
        _nav(page, "Quotas and usage", "quotas")
        expect(page.locator("#quotas-table tbody tr")).to_have_count(4)
        shot("quotas")
        page.close()
