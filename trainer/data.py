"""Training data: JSONL validation and tokenization with loss masks.

Two formats, one record per line (blank lines are skipped; every line of a file has the same format):

- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str, "weight": 0|1}, ...]}``
  (``weight`` is optional, assistant messages only; weight 0 keeps the turn as context without loss);
- prompt/completion: ``{"prompt": str, "completion": str}``.

:func:`validate_file` checks a file and raises :class:`DatasetValidationError` whose ``.errors`` is a
list of ``{"line", "field", "message", "detail"}`` dicts; ``message`` is the full text, e.g.
``"line 3: messages[1].role: unknown role 'bot' (expected system, user, assistant)"``, ``detail`` the
part after the field. Without a tokenizer only the format is checked (the API does this at upload);
with a tokenizer and ``max_seq_length`` every example is also tokenized and checked for length (the
runner does this when the job starts).

Loss masks: chat examples are rendered with the tokenizer's chat template and only the tokens of
assistant turns (content and the template's end-of-turn marker) carry loss; prompt/completion
examples are ``bos + prompt + completion + eos`` with loss on the completion and eos. Labels use
the Hugging Face convention: ``labels[t] == input_ids[t]`` where token t is learned, -100 elsewhere.

This module does not import torch.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100
Format = Literal["chat", "prompt_completion"]


class DataError(TypedDict):
    line: int | None
    field: str | None
    message: str
    detail: str


class DatasetValidationError(ValueError):
    """A training or validation file failed validation; ``errors`` names line and field of each."""

    def __init__(self, path: str | Path, errors: list[DataError]) -> None:
        self.path = str(path)
        self.errors = errors
        shown = "; ".join(e["message"] for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(f"{Path(path).name}: {shown}{more}")


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass
class DatasetReport:
    path: str
    format: Format
    num_examples: int
    #: Filled when a tokenizer was given.
    num_tokens: int | None = None
    max_tokens: int | None = None
    num_loss_tokens: int | None = None
    examples: list[Example] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "num_examples": self.num_examples,
            "num_tokens": self.num_tokens,
            "max_tokens": self.max_tokens,
            "num_loss_tokens": self.num_loss_tokens,
        }


def _err(line: int | None, fld: str | None, detail: str) -> DataError:
    where = [p for p in (f"line {line}" if line is not None else None, fld) if p]
    return {
        "line": line,
        "field": fld,
        "message": ": ".join([*where, detail]),
        "detail": detail,
    }


class _TooMany(Exception):
    pass


def _lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text or None when not valid UTF-8), skipping blank lines."""
    with path.open("rb") as fh:
        for no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield no, None
                continue
            if text.strip():
                yield no, text


def _shown(value: Any) -> str:
    """A bounded repr for messages: deep or long values are cut short (``reprlib``), never recursed into."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def _check_chat(no: int, messages: Any) -> list[DataError]:
    if not isinstance(messages, list):
        return [_err(no, "messages", "expected a list of messages")]
    if not messages:
        return [_err(no, "messages", "empty list (no messages)")]
    errs: list[DataError] = []
    learned = assistants = 0
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            errs.append(_err(no, f, "expected an object with role and content"))
            continue
        role = m.get("role")
        if "role" not in m:
            errs.append(_err(no, f"{f}.role", "missing"))
        elif role not in ROLES:
            errs.append(_err(no, f"{f}.role", f"unknown role {_shown(role)} (expected {', '.join(ROLES)})"))
        if "content" not in m or m["content"] is None:
            errs.append(_err(no, f"{f}.content", "missing"))
        elif not isinstance(m["content"], str):
            errs.append(_err(no, f"{f}.content", "expected a string"))
        if "weight" in m:
            if role != "assistant":
                errs.append(_err(no, f"{f}.weight", "only assistant messages take a weight"))
            elif m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
                errs.append(_err(no, f"{f}.weight", "must be 0 or 1"))
        if role == "assistant":
            assistants += 1
            if m.get("weight", 1) == 1:
                learned += 1
    if not errs:
        if assistants == 0:
            errs.append(_err(no, "messages", "no assistant message (nothing to learn from)"))
        elif learned == 0:
            errs.append(_err(no, "messages", "every assistant message has weight 0 (nothing to learn from)"))
    return errs


def _check_prompt_completion(no: int, rec: dict[str, Any]) -> list[DataError]:
    errs: list[DataError] = []
    for key in ("prompt", "completion"):
        if key not in rec or rec[key] is None:
            errs.append(_err(no, key, "missing"))
        elif not isinstance(rec[key], str):
            errs.append(_err(no, key, "expected a string"))
    if not errs and not rec["completion"].strip():
        errs.append(_err(no, "completion", "empty (nothing to learn from)"))
    return errs


def _record_format(rec: dict[str, Any]) -> Format | None:
    if "messages" in rec:
        return "chat"
    if "prompt" in rec or "completion" in rec:
        return "prompt_completion"
    return None


FORMAT_NAMES = {"chat": "chat (messages)", "prompt_completion": "prompt/completion"}


def validate_file(
    path: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_seq_length: int | None = None,
    max_errors: int = 20,
    keep_examples: bool = False,
) -> DatasetReport:
    """Check a JSONL file; with a tokenizer also tokenize and check lengths against max_seq_length.

    Returns a DatasetReport (with the tokenized examples when ``keep_examples``); raises
    DatasetValidationError listing up to ``max_errors`` problems.
    """
    path = Path(path)
    errors: list[DataError] = []

    def add(new: list[DataError]) -> None:
        errors.extend(new)
        if len(errors) >= max_errors:
            raise _TooMany

    if not path.is_file():
        raise DatasetValidationError(path, [_err(None, None, f"file not found: {path}")])
    fmt: Format | None = None
    fmt_line = 0
    count = 0
    num_tokens = max_tokens = loss_tokens = 0
    examples: list[Example] = []
    try:
        for no, text in _lines(path):
            if text is None:
                add([_err(no, None, "not valid UTF-8")])
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                add([_err(no, None, f"invalid JSON: {e.msg} (column {e.colno})")])
                continue
            except RecursionError:  # the decoder recurses per nesting level: [[[[...]]]] 100,000 deep
                add([_err(no, None, "invalid JSON: nested too deeply (a record is an object of messages, "
                                    "or of prompt and completion)")])
                continue
            if not isinstance(rec, dict):
                add([_err(no, None, f"expected a JSON object, got {type(rec).__name__}")])
                continue
            rf = _record_format(rec)
            if rf is None:
                add([_err(no, "messages", "missing (expected 'messages', or 'prompt' and 'completion')")])
                continue
            if fmt is None:
                fmt, fmt_line = rf, no
            elif rf != fmt:
                key = "messages" if rf == "chat" else "prompt"
                add([_err(no, key, f"{FORMAT_NAMES[rf]} record in a {FORMAT_NAMES[fmt]} file (line {fmt_line})")])
                continue
            errs = _check_chat(no, rec["messages"]) if rf == "chat" else _check_prompt_completion(no, rec)
            if errs:
                add(errs)
                continue
            count += 1
            if tokenizer is None:
                continue
            ex = tokenize_record(rec, rf, tokenizer)
            n = len(ex.input_ids)
            if max_seq_length is not None and n > max_seq_length:
                fld = "messages" if rf == "chat" else "prompt+completion"
                add([_err(no, fld, f"too long: {n} tokens (max_seq_length {max_seq_length})")])
                continue
            if ex.num_loss_tokens == 0:
                add([_err(no, "messages" if rf == "chat" else "completion", "no tokens to learn from")])
                continue
            num_tokens += n
            max_tokens = max(max_tokens, n)
            loss_tokens += ex.num_loss_tokens
            if keep_examples:
                examples.append(ex)
    except _TooMany:
        errors.append(_err(None, None, f"stopped after {max_errors} errors"))
    if not errors and count == 0:
        errors.append(_err(None, None, "empty file: no examples"))
    if errors:
        raise DatasetValidationError(path, errors)
    assert fmt is not None
    report = DatasetReport(str(path), fmt, count, examples=examples)
    if tokenizer is not None:
        report.num_tokens, report.max_tokens, report.num_loss_tokens = num_tokens, max_tokens, loss_tokens
    return report


def load_examples(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> tuple[list[Example], DatasetReport]:
    """Validate and tokenize a whole file (raises DatasetValidationError)."""
    report = validate_file(path, tokenizer=tokenizer, max_seq_length=max_seq_length, keep_examples=True)
    return report.examples, report


# --- tokenization -----------------------------------------------------------------------------


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], gen: bool = False) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert isinstance(out, str)
    return out


def chat_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss (learned assistant turns).

    A turn's span runs from the end of the rendered prefix with the generation prompt to the end of
    the rendered prefix including the turn, so it holds the content and the end-of-turn marker. For
    templates whose prefixes do not nest (rare), the content is located in the text instead.
    """
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _render(tokenizer, msgs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    eos = tokenizer.eos_token or ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        span: tuple[int, int] | None = None
        try:
            before = _render(tokenizer, msgs[:i], gen=True)
            upto = _render(tokenizer, msgs[: i + 1])
            if full.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
                span = (len(before), len(upto))
        except Exception:  # templates that refuse partial conversations
            span = None
        if span is None:
            start = full.find(m["content"], cursor)
            if start < 0:
                continue
            end = start + len(m["content"])
            if eos and full.startswith(eos, end):
                end += len(eos)
            span = (start, end)
        spans.append(span)
        cursor = span[1]
    return full, spans


def _mask_by_spans(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
) -> Example:
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        if e > s and any(e > a and s < b for a, b in spans):
            labels[t] = ids[t]
    return Example(ids, labels)


def tokenize_record(rec: dict[str, Any], fmt: Format, tokenizer: PreTrainedTokenizerBase) -> Example:
    """Token ids and labels of one validated record."""
    if fmt == "chat":
        text, spans = chat_spans(tokenizer, rec["messages"])
        return _mask_by_spans(tokenizer, text, spans, add_special_tokens=False)
    prompt, completion = rec["prompt"], rec["completion"]
    ex = _mask_by_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))], True)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is not None and (not ex.input_ids or ex.input_ids[0] != bos):
        ex.input_ids.insert(0, bos)
        ex.labels.insert(0, IGNORE_INDEX)
    if eos is not None and (not ex.input_ids or ex.input_ids[-1] != eos):
        ex.input_ids.append(eos)
        ex.labels.append(eos)
    return ex
