"""Tool-calling data and unusual tokenizers through real (tiny) training runs: an OpenAI-format
tool-calling file trains on a Qwen2-style model; a model without eos or end-of-turn marker gets one
token added, learned, stopped on at generation, and carried by the LoRA adapter."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model_folders import TOOL_CALL_RECORD, jsonl, write_model_folder
from trainer.events import Event
from trainer.run.loop import run_training
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}


def _spec(model: Path, train: Path, out: Path, **hp: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": str(model),
            "training_file": str(train),
            "output_dir": str(out),
            "device": "cpu",
            "engine": {"mode": "device"},
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 2,
                "max_seq_length": 256,
                "eval_every": None,
                "learning_rate": 1e-2,
                "seed": 0,
                **hp,
            },
        }
    )


def test_tool_calling_file_trains(tmp_path: Path) -> None:
    model = write_model_folder(tmp_path / "qwen2", "qwen2", max_position_embeddings=512)
    long_answer = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 600}]
    }
    train = jsonl(tmp_path / "train.jsonl", [TOOL_CALL_RECORD, CHAT, TOOL_CALL_RECORD, long_answer])
    events: list[Event] = []
    result = run_training(_spec(model, train, tmp_path / "out", max_seq_length=480), on_event=events.append)
    assert result.steps == 2 and not result.cancelled
    validated = next(e for e in events if getattr(e, "message", "").startswith("Validated training file"))
    assert validated.data["num_examples"] == 4 and validated.data["truncated_lines"] == [4]  # type: ignore[attr-defined]
    assert "1 truncated to 480 tokens (line 4)" in validated.message  # type: ignore[attr-defined]
    losses = [e.loss for e in events if e.type == "step"]  # type: ignore[attr-defined]
    assert losses and all(math.isfinite(x) for x in losses)


def test_added_end_token_is_learned_stopped_on_and_in_the_lora_adapter(tmp_path: Path) -> None:
    """No eos and no chat template: ``<|end|>`` is added (the embeddings grow by a row); the export's
    generation config stops on it and the LoRA adapter, on the base model grown the same way, gives the
    merged model's logits, the new token included."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = write_model_folder(tmp_path / "bare", "llama", eos=False, chat_template=None)
    train = jsonl(tmp_path / "train.jsonl", [CHAT] * 4)
    result = run_training(_spec(base, train, tmp_path / "out", lora={"r": 4}), on_event=None)
    final = Path(result.final_model_dir or "")
    tok = AutoTokenizer.from_pretrained(final)
    end = tok.convert_tokens_to_ids("<|end|>")
    assert tok.eos_token == "<|end|>" and end == len(tok) - 1
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert merged.generation_config.eos_token_id == end and merged.config.vocab_size == len(tok)

    from safetensors import safe_open

    with safe_open(str(final / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any("embed_tokens" in k for k in names)  # the grown embeddings travel with the adapter
    grown = AutoModelForCausalLM.from_pretrained(base)
    grown.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():  # whatever the user's resize puts in the new row, the adapter's embeddings win
        grown.get_input_embeddings().weight[end:].zero_()
    adapted = PeftModel.from_pretrained(grown, final / "adapter").merge_and_unload()
    ids = tok(
        tok.apply_chat_template(CHAT["messages"], tokenize=False),
        return_tensors="pt",
        add_special_tokens=False,
    ).input_ids
    assert end in ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-4)


def test_template_refusal_fails_the_run_as_a_data_error(tmp_path: Path) -> None:
    """At run time too (a file validated before the model was known): a line's error, not a training error."""
    from trainer.data.dataset import DatasetValidationError

    model = write_model_folder(tmp_path / "gemma2", "gemma2", weights=False)
    train = jsonl(tmp_path / "train.jsonl", [{"messages": CHAT["messages"][1:]}, CHAT])
    events: list[Event] = []
    with pytest.raises(DatasetValidationError) as ei:
        run_training(_spec(model, train, tmp_path / "out"), on_event=events.append)
    assert [(e["line"], e["field"]) for e in ei.value.errors] == [(2, "messages[0]")]
    assert [e.error_type for e in events if e.type == "error"] == ["DatasetValidationError"]  # type: ignore[attr-defined]
