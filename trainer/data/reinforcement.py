"""OpenAI's reinforcement fine-tuning format: one prompt per line, ``{"messages": [...], "tools": [...],
...any other fields}``.

``messages`` is the conversation up to the model's turn (it must not end with an assistant message: the
model writes that turn during training, and the grader scores it). Every top-level field, ``messages``
included, is the row graders read as ``{{item.<field>}}``. A prompt is rendered by the model's chat
template with the generation prompt and tokenized without labels (:class:`RolloutPrompt`); its messages
are checked as a chat record's are, named in the same fields. No torch import.
"""

from __future__ import annotations

from typing import Any

from trainer.data.chat_format import ChatRenderer, Problem, check_chat_record, template_messages
from trainer.data.example import IGNORE_INDEX, RolloutPrompt


def check_reinforcement_record(rec: dict[str, Any]) -> list[Problem]:
    """The format problems of one reinforcement record (empty when it is valid)."""
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        return [("messages", "expected a non-empty list of messages (the prompt)")]
    problems = [p for p in check_chat_record(rec) if p[0] != "messages" or "nothing to learn" not in p[1]]
    if problems:
        return problems
    last = messages[-1]
    if last.get("role") == "assistant":
        return [
            (
                f"messages[{len(messages) - 1}].role",
                "the prompt ends with an assistant message: a reinforcement prompt ends before the "
                "model's turn (the model writes it during training and the grader scores it)",
            )
        ]
    return []


def is_reinforcement_prompt(rec: dict[str, Any]) -> bool:
    """A chat-shaped record that ends before the assistant's turn (an upload's check tells the formats
    apart by this; a job's method decides it)."""
    messages = rec.get("messages")
    return (
        isinstance(messages, list)
        and bool(messages)
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") != "assistant"
        and not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    )


def tokenize_prompt(rec: dict[str, Any], renderer: ChatRenderer) -> RolloutPrompt:
    """The prompt's tokens up to the assistant's turn, with the whole row as its ``item``; a template
    refusal raises chat_format.RecordRefused."""
    msgs = template_messages(rec["messages"], renderer.system_message)
    text = renderer.render_prompt(msgs, rec.get("tools") or None)
    ids = list(renderer.tokenizer(text, add_special_tokens=False)["input_ids"])
    return RolloutPrompt(ids, [IGNORE_INDEX] * len(ids), item=dict(rec))
