"""JSONL lines nested too deeply to parse, and values too deep or long to quote: a validation error
naming the line (where the API validates at upload and where the runner loads the data), never a
RecursionError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.dataset import DatasetValidationError, load_examples, validate_file

GOOD = json.dumps({"prompt": "1+1=", "completion": "2"})


def _file(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "deep",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"prompt": ' + '{"a":' * 50_000 + "1" + "}" * 50_000 + ', "completion": "x"}',
    ],
)
def test_deeply_nested_line_is_a_validation_error(tmp_path: Path, deep: str) -> None:
    from trainer.data.tokenizer import build_byte_tokenizer

    path = _file(tmp_path, GOOD, deep, GOOD)
    for check in (lambda: validate_file(path), lambda: load_examples(path, build_byte_tokenizer(), 64)):
        with pytest.raises(DatasetValidationError) as err:
            check()
        assert [(e["line"], e["detail"].split(" (")[0]) for e in err.value.errors] == [
            (2, "invalid JSON: nested too deeply")
        ]
        assert "line 2: invalid JSON: nested too deeply" in str(err.value)


def test_unknown_role_is_quoted_short(tmp_path: Path) -> None:
    role = "[" * 800 + "]" * 800  # parses, but is no role; its repr must not recurse 800 deep
    chat = '{"messages": [{"role": ' + role + ', "content": "q"}, {"role": "assistant", "content": "a"}]}'
    path = _file(
        tmp_path,
        chat,
        json.dumps(
            {"messages": [{"role": "x" * 10_000, "content": "q"}, {"role": "assistant", "content": "a"}]}
        ),
    )
    with pytest.raises(DatasetValidationError) as err:
        validate_file(path)
    details = [(e["line"], e["field"], e["detail"]) for e in err.value.errors]
    assert [d[:2] for d in details] == [(1, "messages[0].role"), (2, "messages[0].role")]
    assert all(d[2].startswith("unknown role ") and len(d[2]) < 200 for d in details), details
