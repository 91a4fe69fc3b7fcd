"""Reading a JSONL data file line by line, each line's problems named by line and field.

:func:`read_lines` yields the non-blank lines (a UTF-8 byte order mark at the start is dropped, a line
that is not UTF-8 comes as None); :func:`parse_line` parses one into a JSON object or its errors
(:class:`DataError` dicts, made by :func:`data_error`). Besides invalid JSON, it refuses what JSON
allows but the data cannot hold, naming the field:

- a string with an unpaired UTF-16 surrogate escape (``"\\ud800"``): no tokenizer can encode it;
- an integer with more digits than Python converts (``sys.get_int_max_str_digits()``, 4300 by default).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict


class DataError(TypedDict):
    line: int | None
    field: str | None
    message: str
    detail: str


def data_error(line: int | None, fld: str | None, detail: str) -> DataError:
    """``{"line", "field", "message": "line 3: messages[1].role: <detail>", "detail"}``."""
    where = [p for p in (f"line {line}" if line is not None else None, fld) if p]
    return {"line": line, "field": fld, "message": ": ".join([*where, detail]), "detail": detail}


#: The detail of the note a check adds when it stops at its most errors (not a line's error).
CHECK_STOPPED = "the check stopped after"


def stopped_note(max_errors: int, line: int) -> DataError:
    return data_error(
        None, None, f"{CHECK_STOPPED} {max_errors} errors, at line {line}: the lines after it were not read"
    )


def error_summary(errors: Sequence[Mapping[str, Any]], shown: int = 5) -> str:
    """The first ``shown`` errors' messages, then how many more there are and, where the check stopped
    early, its note (never counted among the lines' errors)."""
    notes = [e for e in errors if str(e.get("detail", "")).startswith(CHECK_STOPPED)]
    lines = [e for e in errors if e not in notes]
    parts = [str(e.get("message") or e.get("detail") or "invalid") for e in lines[:shown]]
    if len(lines) > shown:
        parts.append(f"and {len(lines) - shown} more")
    parts += [str(e["message"]) for e in notes]
    return "; ".join(parts)


def read_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text or None when not valid UTF-8), skipping blank lines; a byte order
    mark at the start of the file is dropped."""
    with path.open("rb") as fh:
        for no, raw in enumerate(fh, start=1):
            if no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield no, None
                continue
            if text.strip():
                yield no, text


#: A \u escape of a UTF-16 surrogate (paired or not): only lines with one are searched for a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _LongInt:
    """Stands for an integer literal with too many digits, so that its field can be named."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _LongInt:
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > sys.get_int_max_str_digits() > 0 else int(text)


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    """(field path, value) of every key and value under ``value`` (``messages[0].content``), without
    recursion (the decoder already bounds the nesting)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, v = stack.pop()
        yield where, v
        if isinstance(v, dict):
            for k, item in v.items():
                key = k.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(k, str) else k
                path = f"{where}.{key}" if where else str(key)
                yield path, k
                stack.append((path, item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _value_errors(no: int, rec: Any) -> list[DataError]:
    """Lone surrogates and over-long integers under ``rec``, one error per field."""
    errors: list[DataError] = []
    for where, v in _walk(rec):
        if isinstance(v, _LongInt):
            errors.append(
                data_error(
                    no,
                    where or None,
                    f"a number with {v.digits} digits: numbers may have at most "
                    f"{sys.get_int_max_str_digits()} digits (give it as a string)",
                )
            )
        elif isinstance(v, str) and not _encodable(v):
            errors.append(
                data_error(
                    no,
                    where or None,
                    "contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff): text must be valid "
                    "Unicode (write a character above U+FFFF as the pair of its escapes, or as UTF-8)",
                )
            )
    return errors


def parse_line(no: int, text: str | None) -> tuple[dict[str, Any] | None, list[DataError]]:
    """One line as a JSON object, or its errors."""
    if text is None:
        return None, [data_error(no, None, "not valid UTF-8")]
    long_ints = False
    try:
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer over sys.get_int_max_str_digits(): parse again to name its field
            rec, long_ints = json.loads(text, parse_int=_parse_int), True
    except json.JSONDecodeError as e:
        return None, [data_error(no, None, f"invalid JSON: {e.msg} (column {e.colno})")]
    except RecursionError:  # the decoder recurses per nesting level: [[[[...]]]] 100,000 deep
        return None, [
            data_error(
                no,
                None,
                "invalid JSON: nested too deeply (a record is an object of messages, "
                "or of prompt and completion)",
            )
        ]
    if long_ints or _SURROGATE_ESCAPE.search(text):
        errors = _value_errors(no, rec)
        if errors:
            return None, errors
    if not isinstance(rec, dict):
        return None, [data_error(no, None, f"expected a JSON object, got {type(rec).__name__}")]
    return rec, []
