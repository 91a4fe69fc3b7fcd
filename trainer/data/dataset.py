"""Training data: JSONL validation and tokenization with loss masks.

Four formats, one record per line (blank lines are skipped; every line of a file has the same format;
a UTF-8 byte order mark and CRLF line ends are accepted):

- chat: the OpenAI chat fine-tuning format, ``{"messages": [...], "tools": [...]}`` with roles system,
  developer, user, assistant and tool, text content (a string or text parts), assistant ``tool_calls``
  and ``weight`` 0/1 (weight 0 keeps the turn as context without loss): :mod:`trainer.data.chat_format`;
- prompt/completion: ``{"prompt": str, "completion": str}``;
- preference pairs (DPO): :mod:`trainer.data.preference`;
- reinforcement prompts: chat messages up to the model's turn plus the graders' fields,
  :mod:`trainer.data.reinforcement` (a reinforcement job's chat-shaped records; in an upload's check, a
  record with no assistant turn).

:func:`validate_file` checks a file and raises :class:`DatasetValidationError` whose ``.errors`` is a
list of ``{"line", "field", "message", "detail"}`` dicts; ``message`` is the full text, e.g.
``"line 3: messages[1].role: unknown role 'bot' (expected system, developer, user, assistant, tool)"``,
``detail`` the part after the field. Without a tokenizer only the format is checked; with one every
example is also rendered with its chat template (a template's refusal is a line's error, see
chat_format.RecordRefused) and tokenized, and examples over ``max_seq_length`` follow
:attr:`DataOptions.truncation`: ``truncate`` (keep the first max_seq_length tokens; an example left with
no learned token is dropped), ``drop`` or ``error``. The report counts and lists what was cut.
Lines are read and parsed by :mod:`trainer.data.jsonl` (lone surrogates and over-long integers are a
line's error there). The service bounds each example (:class:`ExampleLimits`: messages, characters,
tokens; each over it a line's error) and stops a check it no longer wants (``stop``, asked per line).
The whole check is linear in the file's size: spans by :mod:`trainer.data.chat_spans`, masks in one
pass.

Loss masks: only the tokens of learned assistant turns (content, tool calls and the template's
end-of-turn marker) carry loss; prompt/completion examples are ``bos + prompt + completion + eos``
with loss on the completion and eos. Labels use the Hugging Face convention: ``labels[t] ==
input_ids[t]`` where token t is learned, -100 elsewhere.

This module does not import torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from contract.hyperparameters import SystemMessage, Truncation
from contract.method import MethodName
from trainer.data.chat_format import ChatRenderer, RecordRefused, check_chat_record
from trainer.data.example import IGNORE_INDEX as IGNORE_INDEX  # re-exported: its old home
from trainer.data.example import Example as Example
from trainer.data.example import PreferencePair, RolloutPrompt
from trainer.data.jsonl import DataError, error_summary, parse_line, read_lines, stopped_note
from trainer.data.jsonl import data_error as _err
from trainer.data.preference import chat_records, check_preference_record, is_preference
from trainer.data.reinforcement import check_reinforcement_record, is_reinforcement_prompt, tokenize_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Format = Literal["chat", "prompt_completion", "preference", "reinforcement"]
#: Line numbers a report lists per kind (truncated, dropped); the counts are complete.
MAX_LISTED_LINES = 100


@dataclass(frozen=True)
class DataOptions:
    """How examples become training sequences (the job's ``truncation`` and ``system_message``)."""

    truncation: Truncation = "truncate"
    system_message: SystemMessage = "keep"
    #: The job's method: ``dpo`` takes preference pairs only, ``supervised`` chat or prompt/completion
    #: records only; None (an upload's check) takes any one format.
    method: MethodName | None = None
    #: A reinforcement job's completion tokens, kept out of max_seq_length for its prompts (the limit a
    #: check is given is what is left; its messages name both).
    completion_tokens: int = 0

    @classmethod
    def of(cls, hyperparameters: Any, method: MethodName, completion_tokens: int = 0) -> DataOptions:
        """The options a job's (requested or resolved) hyperparameters give, for its ``method``."""
        return cls(hyperparameters.truncation, hyperparameters.system_message, method, completion_tokens)


@dataclass(frozen=True)
class ExampleLimits:
    """Bounds of one example (None: unbounded), each over it a line's error; the service sets them
    (trainer.limits.JobLimits) so that no line costs more than they allow to check. Characters are the
    line's, before parsing; tokens the rendered example's, before truncation."""

    max_messages: int | None = None
    max_chars: int | None = None
    max_tokens: int | None = None


class CheckStopped(Exception):
    """:func:`validate_file` stopped because its ``stop`` callback said so (checked once per line)."""


class DatasetValidationError(ValueError):
    """A training or validation file failed validation; ``errors`` names line and field of each."""

    def __init__(self, path: str | Path, errors: list[DataError]) -> None:
        self.path = str(path)
        self.errors = errors
        super().__init__(f"{Path(path).name}: {error_summary(errors)}")


@dataclass
class DatasetReport:
    path: str
    format: Format
    #: Examples that train (after drops when a tokenizer was given).
    num_examples: int
    #: Filled when a tokenizer was given.
    num_tokens: int | None = None
    max_tokens: int | None = None
    num_loss_tokens: int | None = None
    max_seq_length: int | None = None
    truncation: Truncation | None = None
    #: Examples cut to max_seq_length / left out (too long under ``drop``, or with no learned token
    #: left after truncation); the first MAX_LISTED_LINES line numbers of each.
    num_truncated: int | None = None
    num_dropped: int | None = None
    truncated_lines: list[int] = field(default_factory=list)
    dropped_lines: list[int] = field(default_factory=list)
    #: A reinforcement file's item fields: every top-level field some row has (graders read them).
    fields: list[str] | None = None
    examples: list[Example] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "num_examples": self.num_examples,
            "num_tokens": self.num_tokens,
            "max_tokens": self.max_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "max_seq_length": self.max_seq_length,
            "truncation": self.truncation,
            "num_truncated": self.num_truncated,
            "num_dropped": self.num_dropped,
            **({"fields": self.fields} if self.fields is not None else {}),
            "truncated_lines": self.truncated_lines,
            "dropped_lines": self.dropped_lines,
        }

    def event_message(self, kind: str) -> str:
        """``Validated training file: 40 examples, 5120 tokens; 2 truncated to 512 tokens (lines 4, 9)``."""
        cut = self.cut_summary()
        return f"Validated {kind} file: {self.num_examples} examples, {self.num_tokens} tokens" + (
            f"; {cut}" if cut else ""
        )

    def cut_summary(self) -> str:
        """What over-long examples became, e.g. ``"2 truncated to 512 tokens (lines 4, 9); 1 dropped (line
        7)"``; empty when none was cut."""
        parts = []
        if self.num_truncated:
            parts.append(
                f"{self.num_truncated} truncated to {self.max_seq_length} tokens ({_lines_text(self.truncated_lines, self.num_truncated)})"
            )
        if self.num_dropped:
            why = _drop_reason(self.format, self.truncation)
            parts.append(
                f"{self.num_dropped} dropped, {why} ({_lines_text(self.dropped_lines, self.num_dropped)})"
            )
        return "; ".join(parts)


def _drop_reason(fmt: str, truncation: str | None) -> str:
    """Why an over-long example was dropped: a reinforcement prompt has no completion to keep (its room
    is max_seq_length less max_completion_tokens), the others lost every trained token to truncation."""
    if fmt == "reinforcement":
        return "no room for the completion (max_seq_length less max_completion_tokens)"
    return "too long" if truncation == "drop" else "no assistant token left after truncation"


def _lines_text(lines: list[int], count: int) -> str:
    shown = ", ".join(str(n) for n in lines[:10])
    more = f" and {count - min(len(lines), 10)} more" if count > min(len(lines), 10) else ""
    return f"line{'s' if count > 1 else ''} {shown}{more}"


class _TooMany(Exception):
    pass


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


#: A chat record's own top-level fields; a prompt with others carries a grader's item fields.
_CHAT_FIELDS = frozenset({"messages", "tools", "parallel_tool_calls"})


def _record_format(rec: dict[str, Any], method: MethodName | None, file_fmt: Format | None) -> Format | None:
    """A record's format: a reinforcement job's chat-shaped records are prompts; in an upload's check
    (no method) so is a record with no assistant turn that carries other fields or sits in a file of
    prompts (a bare one is a chat record missing its answer)."""
    if is_preference(rec):
        return "preference"
    if "messages" in rec:
        rl = method == "reinforcement" or (
            method is None
            and is_reinforcement_prompt(rec)
            and (file_fmt == "reinforcement" or (file_fmt is None and bool(set(rec) - _CHAT_FIELDS)))
        )
        return "reinforcement" if rl else "chat"
    if "prompt" in rec or "completion" in rec:
        return "prompt_completion"
    return None


FORMAT_NAMES = {
    "chat": "chat (messages)",
    "prompt_completion": "prompt/completion",
    "preference": "preference (input, preferred_output, non_preferred_output)",
    "reinforcement": "reinforcement prompt (messages up to the model's turn, with the graders' fields)",
}
#: The formats a job of each method trains on (an upload's check, method None, takes any one).
METHOD_FORMATS: dict[MethodName | None, tuple[Format, ...]] = {
    "supervised": ("chat", "prompt_completion"),
    "dpo": ("preference",),
    "reinforcement": ("reinforcement",),
    None: ("chat", "prompt_completion", "preference", "reinforcement"),
}
#: Item fields a reinforcement file's report lists (the union of its rows' top-level fields), at most.
MAX_LISTED_FIELDS = 200
#: The field a record's whole-example problems are named at, by format.
_WHOLE = {
    "chat": "messages",
    "prompt_completion": "prompt+completion",
    "preference": "input",
    "reinforcement": "messages",
}


def _method_problem(rf: Format, method: MethodName | None) -> DataError | None:
    """A record of the wrong kind for the job's method (None: fine)."""
    if method == "dpo" and rf != "preference":
        return _err(None, "input", f"a DPO job trains on preference pairs, not {FORMAT_NAMES[rf]} records")
    if method == "supervised" and rf == "preference":
        return _err(None, "input", "a preference pair in a supervised job: DPO data needs method type 'dpo'")
    if method == "reinforcement" and rf != "reinforcement":
        return _err(
            None,
            _WHOLE[rf],
            f"a reinforcement job trains on prompts (messages), not {FORMAT_NAMES[rf]} records",
        )
    return None


@dataclass
class _Lengths:
    """What the length policy did to one file's examples."""

    max_len: int | None
    policy: Truncation
    #: Tokens of max_seq_length kept for a reinforcement prompt's completion (``max_len`` is what is left).
    reserved: int = 0
    truncated: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    num_truncated: int = 0
    num_dropped: int = 0

    def fit(self, no: int, fmt: Format, ex: Example) -> Example | DataError | None:
        """The example to train on, an error (policy ``error``), or None (dropped)."""
        pair = ex if isinstance(ex, PreferencePair) else None
        n = max(len(ex.input_ids), len(pair.rejected.input_ids) if pair is not None else 0)
        if self.max_len is None or n <= self.max_len:
            return ex
        if self.policy == "error":
            return _err(
                no,
                _WHOLE[fmt],
                f"too long: {n} tokens ({self._limit()}); shorten it, raise "
                'max_seq_length, or set hyperparameters.truncation to "truncate" or "drop"',
            )
        if self.policy == "truncate" and not isinstance(ex, RolloutPrompt):  # a cut prompt loses its question
            cut = (
                pair.cut(self.max_len)
                if pair is not None
                else Example(ex.input_ids[: self.max_len], ex.labels[: self.max_len])
            )
            if _learns(cut):
                self.num_truncated += 1
                if len(self.truncated) < MAX_LISTED_LINES:
                    self.truncated.append(no)
                return cut
        self.num_dropped += 1
        if len(self.dropped) < MAX_LISTED_LINES:
            self.dropped.append(no)
        return None

    def _limit(self) -> str:
        if not self.reserved:
            return f"max_seq_length {self.max_len}"
        total = (self.max_len or 0) + self.reserved
        return f"max_seq_length {total} less the {self.reserved} of its completion, max_completion_tokens"


def _learns(ex: Example) -> bool:
    """Every sequence of the example (both of a pair) has a learned token (a prompt's are sampled)."""
    if isinstance(ex, RolloutPrompt):
        return bool(ex.input_ids)
    return ex.num_loss_tokens > 0 and (not isinstance(ex, PreferencePair) or ex.rejected.num_loss_tokens > 0)


def _over(what: str, n: int, limit: int, split: str = "it") -> str:
    return (
        f"too long: {n:,} {what}, over this server's limit of {limit:,} per example; "
        f"split {split} into several examples"
    )


def validate_file(
    path: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_seq_length: int | None = None,
    options: DataOptions | None = None,
    max_errors: int = 20,
    keep_examples: bool = False,
    limits: ExampleLimits | None = None,
    stop: Callable[[], bool] | None = None,
) -> DatasetReport:
    """Check a JSONL file; with a tokenizer also render, tokenize and apply ``options.truncation`` at
    ``max_seq_length``. An example over ``limits`` is its line's error.

    Returns a DatasetReport (with the tokenized examples when ``keep_examples``); raises
    DatasetValidationError listing up to ``max_errors`` problems, or CheckStopped as soon as
    ``stop()`` is true (asked before each line).
    """
    path = Path(path)
    opts = options or DataOptions()
    if not path.is_file():
        raise DatasetValidationError(path, [_err(None, None, f"file not found: {path}")])
    check = _FileCheck(
        opts=opts,
        caps=limits or ExampleLimits(),
        tokenizer=tokenizer,
        renderer=ChatRenderer(tokenizer, opts.system_message) if tokenizer is not None else None,
        lengths=_Lengths(max_seq_length, opts.truncation, opts.completion_tokens),
        max_errors=max_errors,
        keep_examples=keep_examples,
    )
    no = 0
    try:
        for no, text in read_lines(path):
            if stop is not None and stop():
                raise CheckStopped(f"stopped at line {no}")
            check.line(no, text)
    except _TooMany:
        check.errors.append(stopped_note(max_errors, no))
    return check.report(path)


#: A line's record and its format, once its format checks passed.
_Record = tuple[dict[str, Any], Format]


@dataclass
class _FileCheck:
    """One file's check, line by line: the errors so far, the file's format and the examples' totals."""

    opts: DataOptions
    caps: ExampleLimits
    tokenizer: PreTrainedTokenizerBase | None
    renderer: ChatRenderer | None
    lengths: _Lengths
    max_errors: int
    keep_examples: bool
    errors: list[DataError] = field(default_factory=list)
    #: The file's format, set by its first good record (line ``fmt_line``).
    fmt: Format | None = None
    fmt_line: int = 0
    count: int = 0
    num_tokens: int = 0
    max_tokens: int = 0
    loss_tokens: int = 0
    fields: set[str] = field(default_factory=set)
    examples: list[Example] = field(default_factory=list)

    def line(self, no: int, text: str | None) -> None:
        """One line: its errors added (raising _TooMany at ``max_errors``), or its example counted."""
        found = self._record(no, text)
        if isinstance(found, list):
            self._add(found)
            return
        if found[1] == "reinforcement" and len(self.fields) < MAX_LISTED_FIELDS:
            self.fields.update(list(found[0])[: MAX_LISTED_FIELDS - len(self.fields)])
        if self.tokenizer is None:
            self.count += 1
            return
        fitted = self._example(no, *found)
        if isinstance(fitted, list):
            self._add(fitted)
        elif fitted is not None:
            self._keep(fitted)

    def _add(self, new: list[DataError]) -> None:
        self.errors.extend(new)
        if len(self.errors) >= self.max_errors:
            raise _TooMany

    def _record(self, no: int, text: str | None) -> _Record | list[DataError]:
        """The line parsed and its format checked: the record, or the line's errors."""
        if text is not None and self.caps.max_chars is not None and len(text.rstrip()) > self.caps.max_chars:
            return [_err(no, None, _over("characters", len(text.rstrip()), self.caps.max_chars))]
        rec, errs = parse_line(no, text)
        if rec is None:
            return errs
        rf = _record_format(rec, self.opts.method, self.fmt)
        if rf is None:
            return [_err(no, "messages", "missing (expected 'messages', or 'prompt' and 'completion')")]
        if (wrong := _method_problem(rf, self.opts.method)) is not None:
            return [_err(no, wrong["field"], wrong["detail"])]
        if (mixed := self._mixed_format(no, rf)) is not None:
            return [mixed]
        errs = self._field_errors(no, rec, rf)
        return errs if errs else (rec, rf)

    def _mixed_format(self, no: int, rf: Format) -> DataError | None:
        """A record whose format is not the file's (the first record's sets it)."""
        if self.fmt is None:
            self.fmt, self.fmt_line = rf, no
            return None
        if rf == self.fmt:
            return None
        key = {"prompt_completion": "prompt", "preference": "input"}.get(rf, "messages")
        return _err(
            no, key, f"{FORMAT_NAMES[rf]} record in a {FORMAT_NAMES[self.fmt]} file (line {self.fmt_line})"
        )

    def _field_errors(self, no: int, rec: dict[str, Any], rf: Format) -> list[DataError]:
        if rf == "chat":
            n = len(rec["messages"]) if isinstance(rec["messages"], list) else 0
            if self.caps.max_messages is not None and n > self.caps.max_messages:
                return [
                    _err(no, "messages", _over("messages", n, self.caps.max_messages, "the conversation"))
                ]
            return [_err(no, f, d) for f, d in check_chat_record(rec)]
        if rf == "preference":
            return [_err(no, f, d) for f, d in check_preference_record(rec)]
        if rf == "reinforcement":
            return [_err(no, f, d) for f, d in check_reinforcement_record(rec)]
        return _check_prompt_completion(no, rec)

    def _example(self, no: int, rec: dict[str, Any], rf: Format) -> Example | list[DataError] | None:
        """The record tokenized and fitted to max_seq_length: the example to train on, the line's
        errors, or None (dropped by the length policy)."""
        assert self.tokenizer is not None
        try:
            ex = tokenize_record(rec, rf, self.tokenizer, renderer=self.renderer)
        except RecordRefused as e:
            return [_err(no, e.field, e.detail)]
        longest = max(len(ex.input_ids), len(ex.rejected.input_ids) if isinstance(ex, PreferencePair) else 0)
        if self.caps.max_tokens is not None and longest > self.caps.max_tokens:
            return [_err(no, _WHOLE[rf], _over("tokens", longest, self.caps.max_tokens))]
        if not _learns(ex):
            fld = {"prompt_completion": "completion", "preference": "input"}.get(rf, "messages")
            return [_err(no, fld, "no tokens to learn from")]
        fitted = self.lengths.fit(no, rf, ex)
        if fitted is None or isinstance(fitted, Example):
            return fitted
        return [fitted]

    def _keep(self, fitted: Example) -> None:
        self.count += 1
        seqs = [fitted, fitted.rejected] if isinstance(fitted, PreferencePair) else [fitted]
        self.num_tokens += sum(len(q.input_ids) for q in seqs)
        self.max_tokens = max(self.max_tokens, *(len(q.input_ids) for q in seqs))
        self.loss_tokens += sum(q.num_loss_tokens for q in seqs)
        if self.keep_examples:
            self.examples.append(fitted)

    def report(self, path: Path) -> DatasetReport:
        """The file's report; raises DatasetValidationError when a line failed or no example is left."""
        if not self.errors and self.count == 0:
            self.errors.append(self._no_example())
        if self.errors:
            raise DatasetValidationError(path, self.errors)
        assert self.fmt is not None
        report = DatasetReport(str(path), self.fmt, self.count, examples=self.examples)
        if self.fmt == "reinforcement":
            report.fields = sorted(self.fields)
        if self.tokenizer is not None:
            lengths = self.lengths
            report.num_tokens, report.max_tokens = self.num_tokens, self.max_tokens
            report.num_loss_tokens = self.loss_tokens
            report.max_seq_length, report.truncation = lengths.max_len, self.opts.truncation
            report.num_truncated, report.num_dropped = lengths.num_truncated, lengths.num_dropped
            report.truncated_lines, report.dropped_lines = lengths.truncated, lengths.dropped
        return report

    def _no_example(self) -> DataError:
        if self.lengths.num_dropped:
            return _err(
                None,
                None,
                f"no example left: all {self.lengths.num_dropped} were dropped as longer "
                f"than max_seq_length {self.lengths.max_len} (truncation: {self.opts.truncation})",
            )
        return _err(None, None, "empty file: no examples")


def load_examples(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    options: DataOptions | None = None,
) -> tuple[list[Example], DatasetReport]:
    """Validate and tokenize a whole file (raises DatasetValidationError)."""
    report = validate_file(
        path, tokenizer=tokenizer, max_seq_length=max_seq_length, options=options, keep_examples=True
    )
    return report.examples, report


# --- tokenization -----------------------------------------------------------------------------


def _mask_by_spans(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
) -> Example:
    """Tokens ending inside a span are learned (a token that starts before the span counts: the span
    starts mid-token only in the prompt's last token; one that ends after it does not: the span's end
    may fall inside the next turn's marker). One pass over tokens and spans together (both in text
    order; a token ending before its predecessor finds its span by bisection)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    spans = sorted(spans)
    ends = [b for _, b in spans]
    k, last = 0, 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        if e <= s:
            continue
        if e < last:
            k = bisect_left(ends, e)
        last = e
        while k < len(spans) and ends[k] < e:  # the first span ending at or after e
            k += 1
        if k < len(spans) and spans[k][0] < e:
            labels[t] = ids[t]
    return Example(ids, labels)


def tokenize_record(
    rec: dict[str, Any],
    fmt: Format,
    tokenizer: PreTrainedTokenizerBase,
    *,
    renderer: ChatRenderer | None = None,
) -> Example:
    """Token ids and labels of one validated record (a preference record: a :class:`PreferencePair`); a
    chat record the template refuses raises RecordRefused."""
    if fmt == "preference":
        chosen, rejected = (
            tokenize_record(r, "chat", tokenizer, renderer=renderer) for r in chat_records(rec)
        )
        return PreferencePair(chosen.input_ids, chosen.labels, rejected)
    if fmt == "reinforcement":
        return tokenize_prompt(rec, renderer or ChatRenderer(tokenizer))
    if fmt == "chat":
        text, spans = (renderer or ChatRenderer(tokenizer)).render(rec)
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
