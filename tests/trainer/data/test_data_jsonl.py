"""What a line may not hold although JSON allows it (trainer.data.jsonl), the bounds of one example
(trainer.dataset.ExampleLimits) and a check stopped between lines: each a line's error naming the
field, never an exception of the tokenizer or Python's own wording (issue 25)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.model_folders import jsonl
from trainer.data.dataset import CheckStopped, DatasetValidationError, ExampleLimits, validate_file
from trainer.limits import MAX_EXAMPLE_CHARS, MAX_EXAMPLE_MESSAGES, MAX_EXAMPLE_TOKENS, JobLimits
from trainer.model.catalog import load_tokenizer

OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def errors_of(path: Path, **kw: Any) -> list[dict[str, Any]]:
    with pytest.raises(DatasetValidationError) as ei:
        validate_file(path, **kw)
    return [dict(e) for e in ei.value.errors]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("tiny-llama")


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_a_lone_surrogate_is_the_lines_error_naming_the_field(
    tmp_path: Path, tok: Any, with_tokenizer: bool
) -> None:
    bad = '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}'
    key = '{"messages": [{"role": "user", "content": "hi", "\\udfff": 1}, {"role": "assistant", "content": "x"}]}'
    paired = (
        '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "x"}]}'
    )
    path = jsonl(tmp_path / "s.jsonl", [OK, bad, paired, key])
    kw: dict[str, Any] = {"tokenizer": tok, "max_seq_length": 64} if with_tokenizer else {}
    errors = errors_of(path, **kw)
    assert [(e["line"], e["field"]) for e in errors] == [
        (2, "messages[0].content"),
        (4, "messages[0].\\udfff"),
    ]
    assert "unpaired UTF-16 surrogate" in errors[0]["message"]
    assert errors[0]["message"].startswith("line 2: messages[0].content: ")


def test_a_5000_digit_integer_is_the_lines_error_in_our_words(tmp_path: Path) -> None:
    digits = "7" * 5000
    rec = f'{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "x", "weight": {digits}}}]}}'
    path = jsonl(tmp_path / "d.jsonl", [OK, rec, f'{{"prompt": "a", "completion": "b", "n": -{digits}}}'])
    errors = errors_of(path)
    limit = sys.get_int_max_str_digits()
    assert [(e["line"], e["field"]) for e in errors[:2]] == [(2, "messages[1].weight"), (3, "n")]
    assert errors[0]["detail"] == (
        f"a number with 5000 digits: numbers may have at most {limit} digits (give it as a string)"
    )
    assert not any("set_int_max_str_digits" in e["message"] for e in errors)


def test_a_long_integer_in_tool_call_arguments_is_named(tmp_path: Path) -> None:
    args = json.dumps(f'{{"n": {"1" * 5000}}}')
    rec = (
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": '
        f'[{{"type": "function", "function": {{"name": "f", "arguments": {args}}}}}]}}]}}'
    )
    errors = errors_of(jsonl(tmp_path / "t.jsonl", [rec]))
    assert (errors[0]["line"], errors[0]["field"]) == (1, "messages[1].tool_calls[0].function.arguments")
    assert "too long" in errors[0]["detail"]


def test_the_bounds_of_one_example_name_the_line(tmp_path: Path, tok: Any) -> None:
    many = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(10)]}
    wide = {"messages": [{"role": "user", "content": "q" * 500}, {"role": "assistant", "content": "a"}]}
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 100}]}
    path = jsonl(tmp_path / "b.jsonl", [OK, many, wide, long])
    limits = ExampleLimits(max_messages=8, max_chars=400, max_tokens=80)
    errors = errors_of(path, tokenizer=tok, max_seq_length=1024, limits=limits)
    assert [(e["line"], e["field"]) for e in errors] == [(2, "messages"), (3, None), (4, "messages")]
    assert errors[0]["detail"].startswith("too long: 10 messages, over this server's limit of 8 per example")
    assert "characters" in errors[1]["detail"] and "tokens" in errors[2]["detail"]
    # without a tokenizer (an upload without a model) messages and characters are bounded all the same
    errors = errors_of(path, limits=limits)
    assert [(e["line"], e["field"]) for e in errors] == [(2, "messages"), (3, None)]
    # the run checks with no bounds (the service's were checked at create)
    assert validate_file(path, tokenizer=tok, max_seq_length=1024).num_examples == 4


def test_the_service_bounds_default_to_the_named_constants() -> None:
    assert JobLimits().examples() == ExampleLimits(
        MAX_EXAMPLE_MESSAGES, MAX_EXAMPLE_CHARS, MAX_EXAMPLE_TOKENS
    )


def test_a_check_stops_between_lines(tmp_path: Path, tok: Any) -> None:
    path = jsonl(tmp_path / "many.jsonl", [OK] * 10)
    asked = 0

    def stop() -> bool:
        nonlocal asked
        asked += 1
        return asked > 3

    with pytest.raises(CheckStopped, match="line 4"):
        validate_file(path, tokenizer=tok, max_seq_length=64, stop=stop)
    assert asked == 4
