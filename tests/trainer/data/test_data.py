"""Dataset validation (every error names line and field) and tokenization with assistant-only loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.data.dataset import (
    IGNORE_INDEX,
    DatasetValidationError,
    load_examples,
    tokenize_record,
    validate_file,
)


def chat(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


GOOD = chat(("user", "hi"), ("assistant", "hello"))


def write(tmp_path: Path, lines: list[Any], name: str = "data.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return p


def errors_of(path: Path, **kw: Any) -> list[dict[str, Any]]:
    with pytest.raises(DatasetValidationError) as ei:
        validate_file(path, **kw)
    return [dict(e) for e in ei.value.errors]


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    from trainer.data.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


def test_valid_files(tmp_path: Path) -> None:
    rep = validate_file(write(tmp_path, [GOOD, "", chat(("system", "s"), ("user", "u"), ("assistant", "a"))]))
    assert (rep.format, rep.num_examples, rep.num_tokens) == ("chat", 2, None)
    rep = validate_file(write(tmp_path, [{"prompt": "2+2=", "completion": "4"}] * 3, "pc.jsonl"))
    assert (rep.format, rep.num_examples) == ("prompt_completion", 3)


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert errors_of(p) == [
        {
            "line": None,
            "field": None,
            "message": "empty file: no examples",
            "detail": "empty file: no examples",
        }
    ]
    p.write_text("\n  \n\n")
    assert errors_of(p)[0]["message"] == "empty file: no examples"


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    errs = errors_of(write(tmp_path, [GOOD, GOOD, '{"messages": [}']))
    assert len(errs) == 1 and errs[0]["line"] == 3 and errs[0]["field"] is None
    assert errs[0]["message"].startswith("line 3: invalid JSON")


def test_not_an_object_and_bad_utf8(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'[1, 2]\n{"messages": "\xff\xfe"}\n')
    errs = errors_of(p)
    assert [e["line"] for e in errs] == [1, 2]
    assert "expected a JSON object" in errs[0]["message"] and "not valid UTF-8" in errs[1]["message"]


def test_unknown_role(tmp_path: Path) -> None:
    errs = errors_of(write(tmp_path, [GOOD, GOOD, chat(("user", "hi"), ("bot", "yo"), ("assistant", "x"))]))
    assert errs == [
        {
            "line": 3,
            "field": "messages[1].role",
            "message": "line 3: messages[1].role: unknown role 'bot' (expected system, developer, user, assistant, tool)",
            "detail": "unknown role 'bot' (expected system, developer, user, assistant, tool)",
        }
    ]


def test_message_shape_errors(tmp_path: Path) -> None:
    lines = [
        {"messages": "hello"},
        {"messages": []},
        {"messages": ["hi", {"role": "assistant", "content": "x"}]},
        {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": 5}]},
        {
            "messages": [
                {"role": "user", "content": "u", "weight": 1},
                {"role": "assistant", "content": "a", "weight": 2},
            ]
        },
        {"text": "no known fields"},
    ]
    got = [(e["line"], e["field"]) for e in errors_of(write(tmp_path, lines))]
    assert got == [
        (1, "messages"),
        (2, "messages"),
        (3, "messages[0]"),
        (4, "messages[0].role"),
        (5, "messages[0].content"),
        (5, "messages[1].content"),
        (6, "messages[0].weight"),
        (6, "messages[1].weight"),
        (7, "messages"),
    ]


def test_no_assistant_turn(tmp_path: Path) -> None:
    errs = errors_of(write(tmp_path, [chat(("system", "s"), ("user", "u")), GOOD]))
    assert (
        errs[0]["line"] == 1
        and errs[0]["field"] == "messages"
        and "no assistant message" in errs[0]["message"]
    )
    zero = {
        "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "weight": 0}]
    }
    assert "weight 0" in errors_of(write(tmp_path, [zero]))[0]["message"]


def test_prompt_completion_errors(tmp_path: Path) -> None:
    lines = [{"prompt": "p"}, {"prompt": 3, "completion": "c"}, {"prompt": "p", "completion": "  "}]
    got = [(e["line"], e["field"], e["detail"]) for e in errors_of(write(tmp_path, lines))]
    assert got == [
        (1, "completion", "missing"),
        (2, "prompt", "expected a string"),
        (3, "completion", "empty (nothing to learn from)"),
    ]


def test_mixed_formats(tmp_path: Path) -> None:
    errs = errors_of(write(tmp_path, [GOOD, {"prompt": "p", "completion": "c"}]))
    assert errs[0]["line"] == 2 and "in a chat (messages) file (line 1)" in errs[0]["message"]


def test_too_long_needs_tokenizer(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    from trainer.data.dataset import DataOptions

    p = write(tmp_path, [GOOD, chat(("user", "x" * 100), ("assistant", "y"))])
    assert validate_file(p).num_examples == 2  # format only: no length check
    errs = errors_of(p, tokenizer=tok, max_seq_length=64, options=DataOptions(truncation="error"))
    assert len(errs) == 1 and errs[0]["line"] == 2 and errs[0]["field"] == "messages"
    assert (
        errs[0]["message"].startswith("line 2: messages: too long: ")
        and "(max_seq_length 64)" in errs[0]["message"]
        and 'hyperparameters.truncation to "truncate"' in errs[0]["message"]
    )
    pc = write(tmp_path, [{"prompt": "p" * 80, "completion": "c"}], "pc.jsonl")
    assert (
        errors_of(pc, tokenizer=tok, max_seq_length=64, options=DataOptions(truncation="error"))[0]["field"]
        == "prompt+completion"
    )
    rep = validate_file(p, tokenizer=tok, max_seq_length=512)
    assert (
        rep.num_tokens
        and rep.max_tokens
        and rep.num_loss_tokens
        and rep.num_truncated == rep.num_dropped == 0
    )


def test_max_errors_and_missing_file(tmp_path: Path) -> None:
    errs = errors_of(write(tmp_path, ["nope"] * 50), max_errors=5)
    assert len(errs) == 6 and errs[-1]["message"] == (
        "the check stopped after 5 errors, at line 5: the lines after it were not read"
    )
    # The summary counts the lines' errors, not the note, and says the check stopped (30 bad lines,
    # stopped at 20: "and 15 more", then the note; it said "and 16 more" with the note counted).
    with pytest.raises(DatasetValidationError) as exc:
        validate_file(write(tmp_path, ["nope"] * 30), max_errors=20)
    said = str(exc.value)
    assert said.count("line ") == 6 and "; and 15 more; the check stopped after 20 errors, at line 20" in said
    assert "file not found" in errors_of(tmp_path / "missing.jsonl")[0]["message"]


def _learned(tok, ex) -> str:  # type: ignore[no-untyped-def]
    return tok.decode([t for t in ex.labels if t != IGNORE_INDEX])


def test_loss_only_on_assistant_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    rec = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris.", "weight": 0},
            {"role": "user", "content": "And of Peru?"},
            {"role": "assistant", "content": "Lima, é."},
        ]
    }
    ex = tokenize_record(rec, "chat", tok)
    assert len(ex.labels) == len(ex.input_ids)
    assert _learned(tok, ex) == "Lima, é.<|end|>"
    assert tok.decode(ex.input_ids).startswith("<|bos|><|system|>Be brief.<|end|><|user|>")
    learned = [i for i, t in enumerate(ex.labels) if t != IGNORE_INDEX]
    assert all(ex.labels[i] == ex.input_ids[i] for i in learned)
    assert learned == list(range(learned[0], len(ex.input_ids)))  # the last turn, to the end


def test_prompt_completion_loss_on_completion(tok) -> None:  # type: ignore[no-untyped-def]
    ex = tokenize_record({"prompt": "2+2=", "completion": "4"}, "prompt_completion", tok)
    assert tok.decode(ex.input_ids) == "<|bos|>2+2=4<|end|>"
    assert _learned(tok, ex) == "4<|end|>"


def test_fallback_template_for_local_tokenizers(tok) -> None:  # type: ignore[no-untyped-def]
    from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE

    t = tok.__class__(
        tokenizer_object=tok.backend_tokenizer,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    ex = tokenize_record(
        chat(("user", "hi"), ("assistant", "yo"), ("user", "again"), ("assistant", "ok")), "chat", t
    )
    assert _learned(t, ex) == "yo<|end|>\nok<|end|>\n"


def test_load_examples_returns_tokenized(tmp_path: Path, tok) -> None:  # type: ignore[no-untyped-def]
    examples, rep = load_examples(write(tmp_path, [GOOD] * 3), tok, 64)
    assert len(examples) == rep.num_examples == 3 and rep.num_loss_tokens == 3 * examples[0].num_loss_tokens
