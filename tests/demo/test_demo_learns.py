"""``make run`` fine-tunes a base that knows some language (trainer.samples.demo_base, shipped in
trainer/samples/models), so the answers it prints before and after fine-tuning show what the job taught."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from demo import cli, flow, folder
from trainer.model.catalog import check_model
from trainer.samples import MODELS_DIR
from trainer.samples.demo_base import MODEL_NAME, Recipe


def test_demo_adds_its_model_root_to_the_configured_ones() -> None:
    root = str(MODELS_DIR)
    assert folder.with_demo_root("") == root
    assert folder.with_demo_root("/a:/b") == f"/a:/b:{root}"
    assert json.loads(folder.with_demo_root('["/a"]')) == ["/a", root]


def test_the_shipped_base_is_a_model_folder_made_by_the_recipe() -> None:
    folder = MODELS_DIR / MODEL_NAME
    assert flow.BASE_MODEL == MODEL_NAME
    assert check_model(str(folder)) is not None  # config, weights and tokenizer load as a local base
    info = json.loads((folder / "pretrain.json").read_text())
    assert info["recipe"] == json.loads(json.dumps(Recipe().__dict__))  # rebuilt by the same recipe
    assert info["valid_loss_after"] < info["valid_loss_before"] / 2  # it learned the corpus' bytes
    assert (folder / "model.safetensors").stat().st_size < 5 << 20


def test_the_demos_questions_are_marked_from_the_data() -> None:
    """Seen means a training example asks it word for word with the demo's system prompt; the answer the
    demo expects is the data's. Two seen (they must come out right), one in the validation wording."""
    from trainer.samples import TRAIN_FILE, VALID_FILE

    qs = flow.demo_questions(TRAIN_FILE, VALID_FILE)
    assert [q.text for q in qs] == list(flow.QUESTIONS)
    assert [q.seen for q in qs] == [True, True, False]
    assert [q.expected for q in qs] == [
        "The capital of France is Paris.",
        "The capital of Japan is Tokyo.",
        "The capital of Japan is Tokyo.",
    ]
    trained = TRAIN_FILE.read_text()
    for q in qs:
        line = json.dumps(
            {
                "messages": [
                    {"role": "system", "content": flow.SYSTEM_PROMPT},
                    {"role": "user", "content": q.text},
                ]
            }
        )[:-3]  # the example's start, up to its assistant turn
        assert (line in trained) == q.seen, q
    assert qs[2].text in VALID_FILE.read_text()
    assert qs[0].verdict("The capital of France is Paris.") == "right"
    assert qs[1].verdict("The capital of Nepal is Kathmandu.").startswith("wrong: the data says")


@pytest.mark.slow
@pytest.mark.services  # starts `zenflow serve` and a job process
def test_demo_prints_what_fine_tuning_taught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--data-dir", str(tmp_path / "var"), "--no-stay", "--timeout", "600"]) == 0
    out = capsys.readouterr().out
    before = dict(re.findall(r"user:  (.*?)  \[.*\]\n  base:  (.*)", out))
    after = dict(
        re.findall(r"user:  (.*?)  \[.*\]\n  before fine-tuning: .*\n  after fine-tuning:  (.*)", out)
    )
    assert set(before) == set(after) == set(flow.QUESTIONS)
    seen = [q for q in flow.QUESTIONS if f"user:  {q}  [in the training data]" in out]
    assert len(seen) == 2 and f"user:  {flow.QUESTIONS[2]}  [not in the training data" in out
    # the questions it was trained on come out right (the data's answer, and the demo says so)
    for q in seen:
        assert after[q].endswith("(right)"), after[q]
    assert "==> 2 of the 2 questions in the training data answered right" in out
    france = "What is the capital of France?"
    assert "Paris" in after[france] and "Paris" not in before[france]
    assert all("capital" in after[q] and "capital" not in before[q] for q in flow.QUESTIONS)
    assert "stall" in out  # the engine's per-step events (zenflow mode) reached the stream
