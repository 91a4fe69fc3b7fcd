"""Issue 39's first day: supervised fine-tuning of the shipped base (docs-llama) on 30 house-style
examples (trainer/samples/style_train.jsonl) with every hyperparameter at its default learns: the
training loss falls by half or more, no "learned little" warning, and the model answers in the style."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.trainer.run.test_loop import Recorder
from trainer.run.loop import run_training
from trainer.samples import MODELS_DIR, SAMPLES_DIR
from trainer.spec import JobSpec


@pytest.mark.slow
@pytest.mark.usefixtures("torch_single_thread")
def test_default_hyperparameters_teach_the_demo_base_a_house_style(tmp_path: Path) -> None:
    import torch

    from trainer.model.catalog import load_model, load_tokenizer

    rec = Recorder()
    spec = JobSpec(
        model=str(MODELS_DIR / "docs-llama"),
        training_file=SAMPLES_DIR / "style_train.jsonl",
        hyperparameters={"seed": 0},
        output_dir=tmp_path,
        device="cpu",
    )
    result = run_training(spec, on_event=rec)
    losses = [e.loss for e in rec.of("step")]
    drop = 1 - statistics.fmean(losses[-5:]) / losses[0]
    print(
        f"training loss {losses[0]:.3f} -> {statistics.fmean(losses[-5:]):.3f} ({drop:.0%} lower), {len(losses)} steps"
    )
    assert drop >= 0.5, (drop, losses)
    assert not [e for e in rec.of("log") if "learned little" in e.message]
    assert result.final_model_dir is not None
    tok = load_tokenizer(result.final_model_dir)
    model = load_model(result.final_model_dir, dtype=torch.float32, seed=0, tokenizer=tok)
    for question in ("What does len() return?", "What does the shutil module do?"):  # seen, unseen
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
        assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).startswith("Short answer: ")
