"""A training file's first examples as a model will see them (``GET /v1/files/{id}/preview``).

Each example is rendered and tokenized by the training's own code (trainer.data.chat_format's
ChatRenderer, trainer.data.dataset.tokenize_record) with the model's tokenizer
(trainer.model.catalog.load_tokenizer, cached per model and its config's size and mtime), and cut into
pieces of text that are learned (carry loss) or not. Token counts come from at most
:data:`MAX_COUNTED_LINES` lines and :data:`MAX_COUNTED_CHARS` characters (a request's work is bounded
whatever the file: it runs in a thread of the API process). Lines that are not valid examples, or are over the server's bounds of
one example (trainer.limits), are skipped: the upload and the job's check report those.

This module imports the job library only; its functions are blocking (call them in a thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.jobs.check_worker import tokenizer_for
from contract.hyperparameters import SystemMessage
from trainer.data.chat_format import ChatRenderer, RecordRefused, check_chat_record
from trainer.data.dataset import ExampleLimits, tokenize_record
from trainer.data.jsonl import parse_line, read_lines

#: Lines whose token counts the preview gives (the histogram's).
MAX_COUNTED_LINES = 2000
#: Characters of the file's lines read for the counts: the preview stops at the line that passes it.
MAX_COUNTED_CHARS = 4_000_000
#: Examples rendered in full (the ``limit`` parameter's bound).
MAX_PREVIEW_EXAMPLES = 50


@dataclass(frozen=True)
class PreviewRequest:
    path: str
    #: What trainer.model.catalog.load_tokenizer takes: a built-in name or a model folder.
    model: str
    max_seq_length: int
    system_message: SystemMessage
    limits: ExampleLimits
    limit: int


def pieces(text: str, spans: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """``text`` cut at the spans' bounds: ``[{"text", "learned"}]``, concatenating to ``text``."""
    out: list[dict[str, Any]] = []
    at = 0
    for start, end in sorted(spans):
        start, end = max(start, at), min(end, len(text))
        if start > at:
            out.append({"text": text[at:start], "learned": False})
        if end > start:
            out.append({"text": text[start:end], "learned": True})
            at = end
    if at < len(text):
        out.append({"text": text[at:], "learned": False})
    return out


def _record(no: int, text: str | None, limits: ExampleLimits) -> tuple[dict[str, Any], str] | None:
    """A valid record within the bounds and its format, or None."""
    if text is not None and limits.max_chars is not None and len(text.rstrip()) > limits.max_chars:
        return None
    rec, errors = parse_line(no, text)
    if rec is None or errors:
        return None
    if isinstance(rec.get("messages"), list):
        if limits.max_messages is not None and len(rec["messages"]) > limits.max_messages:
            return None
        return (rec, "chat") if not check_chat_record(rec) else None
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str) and rec["completion"]:
        return rec, "prompt_completion"
    return None


def build_preview(req: PreviewRequest) -> dict[str, Any]:
    """``{"examples": [...], "token_counts": [...], "truncated_at": int | None}`` (see the module)."""
    tokenizer = tokenizer_for(req.model)
    renderer = ChatRenderer(tokenizer, req.system_message)
    examples: list[dict[str, Any]] = []
    counts: list[int] = []
    longest = 0
    spans: list[tuple[int, int]]
    chars = 0
    for seen, (no, text) in enumerate(read_lines(Path(req.path)), start=1):
        chars += len(text or "")
        if seen > MAX_COUNTED_LINES or (chars > MAX_COUNTED_CHARS and seen > 1):
            break
        found = _record(no, text, req.limits)
        if found is None:
            continue
        rec, fmt = found
        shown = len(examples) < req.limit
        try:
            ex = tokenize_record(
                rec, "chat" if fmt == "chat" else "prompt_completion", tokenizer, renderer=renderer
            )
            if not shown:
                rendered, spans = "", []
            elif fmt == "chat":
                rendered, spans = renderer.render(rec)
            else:
                prompt, completion = rec["prompt"], rec["completion"]
                rendered, spans = prompt + completion, [(len(prompt), len(prompt) + len(completion))]
        except RecordRefused:
            continue
        n = len(ex.input_ids)
        if not ex.num_loss_tokens or (req.limits.max_tokens is not None and n > req.limits.max_tokens):
            continue
        counts.append(n)
        longest = max(longest, n)
        if shown:
            examples.append(
                {
                    "line": no,
                    "pieces": pieces(rendered, spans),
                    "tokens": n,
                    "learned_tokens": ex.num_loss_tokens,
                }
            )
    return {
        "examples": examples,
        "token_counts": counts,
        "max_seq_length": req.max_seq_length,
        "truncated_at": req.max_seq_length if longest > req.max_seq_length else None,
    }
