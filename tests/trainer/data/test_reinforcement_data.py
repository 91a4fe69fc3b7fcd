"""OpenAI's reinforcement format (trainer.data.reinforcement through trainer.data.dataset): which records
are prompts, the errors by line and field, prompts tokenized up to the model's turn with their row as
``item``, and a prompt over max_seq_length dropped rather than cut."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.data.dataset import DataOptions, DatasetValidationError, validate_file
from trainer.data.example import IGNORE_INDEX, RolloutPrompt
from trainer.data.reinforcement import check_reinforcement_record, is_reinforcement_prompt
from trainer.samples import MODELS_DIR

RL = DataOptions(method="reinforcement")


def prompt(text: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **fields}


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok() -> Any:
    from trainer.model.catalog import load_tokenizer

    return load_tokenizer(str(MODELS_DIR / "docs-llama"))


def test_which_records_are_prompts() -> None:
    assert is_reinforcement_prompt(prompt("hi", keyword="x"))
    sys_user = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert is_reinforcement_prompt(sys_user)
    answered = {"messages": [*prompt("hi")["messages"], {"role": "assistant", "content": "hello"}]}
    assert not is_reinforcement_prompt(answered)
    # an earlier assistant turn makes it a conversation (an upload's check calls that chat)
    assert not is_reinforcement_prompt(
        {"messages": [*answered["messages"], {"role": "user", "content": "so?"}]}
    )
    assert not is_reinforcement_prompt({"messages": []}) and not is_reinforcement_prompt({"prompt": "x"})


def test_record_problems_name_the_field() -> None:
    assert check_reinforcement_record(prompt("hi", keyword="x")) == []
    assert [f for f, _ in check_reinforcement_record({"messages": []})] == ["messages"]
    assert [f for f, _ in check_reinforcement_record({"keyword": "x"})] == ["messages"]
    ends = {"messages": [*prompt("hi")["messages"], {"role": "assistant", "content": "hello"}]}
    ((field, detail),) = check_reinforcement_record(ends)
    assert field == "messages[1].role" and "ends with an assistant message" in detail
    bad_role = {"messages": [{"role": "bot", "content": "x"}]}
    assert [f for f, _ in check_reinforcement_record(bad_role)] == ["messages[0].role"]


def test_a_reinforcement_jobs_file_and_an_uploads_check(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", [prompt("a", keyword="x"), prompt("b", keyword="y")])
    assert validate_file(path, options=RL).format == "reinforcement"
    assert validate_file(path).format == "reinforcement"  # no method: no assistant turn, a prompt
    ends = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = write(tmp_path / "b.jsonl", [prompt("a"), ends])
    with pytest.raises(DatasetValidationError) as e:
        validate_file(bad, options=RL)
    assert [(x["line"], x["field"]) for x in e.value.errors] == [(2, "messages[1].role")]
    pc = write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DatasetValidationError) as e:
        validate_file(pc, options=RL)
    assert (
        e.value.errors[0]["line"] == 1
        and "reinforcement job trains on prompts" in e.value.errors[0]["message"]
    )


def test_a_mixed_file_is_refused_naming_the_line(tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    mixed = write(tmp_path / "m.jsonl", [prompt("a", keyword="x"), prompt("b", keyword="y"), chat])
    with pytest.raises(DatasetValidationError) as e:
        validate_file(mixed)
    ((err,),) = [e.value.errors]
    assert err["line"] == 3 and "reinforcement" in err["message"] and "(line 1)" in err["message"]


def test_prompts_end_with_the_generation_prompt_and_carry_their_row(tmp_path: Path, tok: Any) -> None:
    rows = [
        prompt("Use the word 'class'.", keyword="class", extra={"n": 1}),
        prompt("Say 'yield'.", keyword="yield"),
    ]
    path = write(tmp_path / "p.jsonl", rows)
    rep = validate_file(path, tokenizer=tok, max_seq_length=128, options=RL, keep_examples=True)
    assert rep.format == "reinforcement" and rep.num_examples == 2
    for ex, row in zip(rep.examples, rows, strict=True):
        assert isinstance(ex, RolloutPrompt)
        assert ex.labels == [IGNORE_INDEX] * len(ex.input_ids)  # nothing learned from the prompt
        assert ex.item == row  # every field, messages included, is the grader's item
        text = tok.decode(ex.input_ids)
        assert text.endswith("<|assistant|>") and row["messages"][0]["content"] in text
        rendered = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        assert ex.input_ids == list(tok(rendered, add_special_tokens=False)["input_ids"])


def test_a_prompt_too_long_is_dropped_not_cut(tmp_path: Path, tok: Any) -> None:
    long_text = "a long prompt " * 40
    path = write(tmp_path / "p.jsonl", [prompt("short", keyword="x"), prompt(long_text, keyword="y")])
    rep = validate_file(path, tokenizer=tok, max_seq_length=48, options=RL, keep_examples=True)
    assert rep.num_examples == 1 and rep.num_dropped == 1 and rep.num_truncated == 0
    assert (
        rep.cut_summary()
        == "1 dropped, no room for the completion (max_seq_length less max_completion_tokens) (line 2)"
    )
    (kept,) = rep.examples
    assert isinstance(kept, RolloutPrompt) and kept.item["keyword"] == "x"
    with pytest.raises(DatasetValidationError) as e:
        validate_file(
            path, tokenizer=tok, max_seq_length=48, options=DataOptions("error", method="reinforcement")
        )
    assert [(x["line"], x["field"]) for x in e.value.errors] == [(2, "messages")]
