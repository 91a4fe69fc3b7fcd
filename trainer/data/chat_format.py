"""The OpenAI chat fine-tuning format: checking one record, and rendering it with a tokenizer's chat
template into text plus the character spans that carry loss.

A record is ``{"messages": [...], "tools": [...]}`` (``tools`` optional; ``parallel_tool_calls`` is
accepted and not used). A message has a ``role`` (system, developer, user, assistant, tool) and a
``content``: a string or a list of ``{"type": "text", "text": ...}`` parts; an assistant message may
instead (or also) carry ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments"}}]``, arguments a JSON object or its JSON text) and a ``weight`` of 0 or 1; a tool message
may name its ``tool_call_id``; any message may have a ``name``.

Before rendering, messages take the Hugging Face chat-template conventions: content joined into one
string (None for none), ``developer`` becomes ``system``, tool-call arguments are parsed into objects.
With ``system_message="fold"`` the system messages are moved to the start of the next user message,
for templates without a system role (Gemma-2's raises "System role not supported").

Loss spans (:meth:`ChatRenderer.render`): a learned assistant turn runs from the end of the
conversation before it rendered with the generation prompt to where the conversation up to and
including it stops agreeing with the whole conversation: its content, its tool calls and the
template's end-of-turn marker, also when the template puts eos only at the very end (Phi-3). A
template that marks the end of an assistant turn with no special token (and so would never teach the
model to stop) gets the eos token appended to each assistant turn's content (not to tool-call turns,
whose calls such a template renders after the content). The spans are found in time linear in the
conversation's length, prefixes rendered for the first turns only (:mod:`trainer.data.chat_spans`).

Template failures are :class:`RecordRefused` with the field and a message saying what to do.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from contract.hyperparameters import SystemMessage
from trainer.data.chat_spans import loss_spans

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "developer", "user", "assistant", "tool")
SYSTEM_ROLES = ("system", "developer")
#: (field, detail): one problem of a record, the caller adds the line.
Problem = tuple[str | None, str]

FOLD_HINT = (
    'set hyperparameters.system_message to "fold" to put the system messages at the start of '
    "the next user message, or remove them from the data"
)


class RecordRefused(ValueError):
    """One record cannot be rendered with this tokenizer's chat template (``field``: where, ``detail``: why)."""

    def __init__(self, field: str | None, detail: str) -> None:
        self.field, self.detail = field, detail
        super().__init__(f"{field}: {detail}" if field else detail)


# --- checking ----------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A bounded repr for messages: deep or long values are cut short (``reprlib``), never recursed into."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def _check_content(m: dict[str, Any], f: str) -> list[Problem]:
    content = m.get("content")
    if content is None:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            return []
        return [(f"{f}.content", "missing")]
    if isinstance(content, str):
        return []
    if not isinstance(content, list) or not content:
        return [(f"{f}.content", "expected a string or a non-empty list of text parts")]
    problems: list[Problem] = []
    for j, part in enumerate(content):
        pf = f"{f}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            what = f"content part of type {_shown(kind)}" if kind else "a content part without type 'text'"
            problems.append(
                (pf, f'{what}: only text parts ({{"type": "text", "text": ...}}) can be trained on')
            )
        elif not isinstance(part.get("text"), str):
            problems.append((f"{pf}.text", "expected a string"))
    return problems


def _check_tool_calls(calls: Any, f: str) -> list[Problem]:
    if not isinstance(calls, list) or not calls:
        return [(f, "expected a non-empty list of tool calls")]
    problems: list[Problem] = []
    for j, call in enumerate(calls):
        cf = f"{f}[{j}]"
        if not isinstance(call, dict):
            problems.append((cf, "expected an object with type 'function' and a function"))
            continue
        if call.get("type", "function") != "function":
            problems.append(
                (f"{cf}.type", f"unsupported tool call type {_shown(call.get('type'))} (expected 'function')")
            )
        fn = call.get("function")
        if not isinstance(fn, dict):
            problems.append((f"{cf}.function", 'missing (expected {"name": ..., "arguments": ...})'))
            continue
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            problems.append((f"{cf}.function.name", "missing"))
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as exc:  # ValueError: an integer of over 4300 digits
                why = "" if isinstance(exc, json.JSONDecodeError | RecursionError) else " (a number too long)"
                problems.append((f"{cf}.function.arguments", f"not valid JSON{why}"))
                continue
        if not isinstance(args, dict):
            problems.append((f"{cf}.function.arguments", "expected a JSON object (or its JSON text)"))
    return problems


def _check_tools(tools: Any) -> list[Problem]:
    if not isinstance(tools, list):
        return [("tools", "expected a list of tools")]
    problems: list[Problem] = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            problems.append((f"tools[{j}]", 'expected {"type": "function", "function": {"name": ...}}'))
        elif not isinstance(fn.get("name"), str) or not fn["name"]:
            problems.append((f"tools[{j}].function.name", "missing"))
    return problems


def check_chat_record(rec: dict[str, Any]) -> list[Problem]:
    """The format problems of one chat record (empty when it is valid)."""
    messages = rec["messages"]
    if not isinstance(messages, list):
        return [("messages", "expected a list of messages")]
    if not messages:
        return [("messages", "empty list (no messages)")]
    problems: list[Problem] = _check_tools(rec["tools"]) if rec.get("tools") is not None else []
    for i, m in enumerate(messages):
        problems += _check_message(m, f"messages[{i}]")
    return problems or _nothing_learned(messages)


def _check_message(m: Any, f: str) -> list[Problem]:
    """One message's problems, ``f`` its field (``messages[i]``)."""
    if not isinstance(m, dict):
        return [(f, "expected an object with role and content")]
    role = m.get("role")
    problems: list[Problem] = []
    if "role" not in m:
        problems.append((f"{f}.role", "missing"))
    elif role not in ROLES:
        problems.append((f"{f}.role", f"unknown role {_shown(role)} (expected {', '.join(ROLES)})"))
    problems += _check_content(m, f)
    if "tool_calls" in m and m["tool_calls"] is not None:
        if role != "assistant":
            problems.append((f"{f}.tool_calls", "only assistant messages make tool calls"))
        else:
            problems += _check_tool_calls(m["tool_calls"], f"{f}.tool_calls")
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            problems.append((f"{f}.{key}", "expected a string"))
    return problems + _check_weight(m, role, f)


def _check_weight(m: dict[str, Any], role: Any, f: str) -> list[Problem]:
    if "weight" not in m:
        return []
    if role != "assistant":
        return [(f"{f}.weight", "only assistant messages take a weight")]
    if m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
        return [(f"{f}.weight", "must be 0 or 1")]
    return []


def _nothing_learned(messages: list[dict[str, Any]]) -> list[Problem]:
    """A valid record's last problem: no assistant message, or none with weight 1."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if not assistants:
        return [("messages", "no assistant message (nothing to learn from)")]
    if not any(m.get("weight", 1) == 1 for m in assistants):
        return [("messages", "every assistant message has weight 0 (nothing to learn from)")]
    return []


# --- normalizing ------------------------------------------------------------------------------------


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments")
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def template_messages(
    messages: list[dict[str, Any]], system_message: SystemMessage = "keep"
) -> list[dict[str, Any]]:
    """Validated OpenAI messages in chat-template form (see the module docstring); ``weight`` is kept.

    Raises RecordRefused when ``fold`` finds a system message with no user message after it.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m["role"] in SYSTEM_ROLES else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant" and msg["content"] is None:
            msg["content"] = ""  # templates concatenate content; a tool-call turn has none
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call(c) for c in m["tool_calls"]]
        for key in ("name", "tool_call_id", "weight"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return _fold_system(out) if system_message == "fold" else out


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[tuple[int, str]] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            pending.append((i, m["content"]))
            continue
        if m["role"] == "user" and pending:
            m = {**m, "content": "\n\n".join([*(c for _, c in pending), m["content"]])}
            pending = []
        out.append(m)
    if pending:
        raise RecordRefused(
            f"messages[{pending[0][0]}]",
            "a system message with no user message after it cannot be folded into one (system_message: fold)",
        )
    return out


# --- rendering --------------------------------------------------------------------------------------


def _template_refusal(exc: Exception, messages: list[dict[str, Any]]) -> RecordRefused:
    """A template's exception as the data error the user can act on: when it is about roles, which of
    the data's roles the template may lack (system: fold it; tool: a model with tool support)."""
    text = str(exc).strip() or type(exc).__name__
    low = text.lower()
    detail = f"the model's chat template refused this conversation: {text}"
    roles = [m["role"] for m in messages]
    about_roles = "role" in low or "system" in low or "tool" in low
    hints: list[str] = []
    field = "messages"
    if about_roles and "system" in roles and ("system" in low or "tool" not in low):
        field = f"messages[{roles.index('system')}]"
        lead = (
            "This model's chat template has no system role"
            if "system" in low
            else "If the template has no system role"
        )
        hints.append(f"{lead}: {FOLD_HINT}")
    if about_roles and "tool" in roles and ("tool" in low or "system" not in low):
        field = field if hints else f"messages[{roles.index('tool')}]"
        hints.append(
            "If it does not take tool messages, train tool use on a model whose template supports "
            "tools, or remove the tool turns"
        )
    if "alternate" in low:
        hints.append("Give user and assistant messages in turns, user first")
    if hints:
        detail += (" " if detail.endswith((".", "!", "?")) else ". ") + ". ".join(hints)
    return RecordRefused(field, detail)


class ChatRenderer:
    """Renders validated chat records with one tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_message: SystemMessage = "keep") -> None:
        from trainer.data.tokenizer import end_of_turn_token

        self.tokenizer, self.system_message = tokenizer, system_message
        eos = tokenizer.eos_token
        #: Appended to every assistant turn when the template ends it with no special token.
        self.append_eos = eos if eos and end_of_turn_token(tokenizer) is None else None

    def _render(
        self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool = False
    ) -> str:
        plain = [{k: v for k, v in m.items() if k != "weight"} for m in msgs]
        tool_list: list[Any] | None = list(tools) if tools else None
        out = self.tokenizer.apply_chat_template(
            plain, tools=tool_list, tokenize=False, add_generation_prompt=gen
        )
        assert isinstance(out, str)
        return out

    def render_prompt(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """Template-form messages up to the assistant's turn, with the generation prompt (a reinforcement
        prompt, trainer.data.reinforcement); raises RecordRefused."""
        try:
            return self._render(msgs, tools, gen=True)
        except Exception as exc:  # jinja2 TemplateError from raise_exception, or a template's own bug
            raise _template_refusal(exc, msgs) from exc

    def render(self, rec: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its loss spans; raises RecordRefused."""
        msgs = template_messages(rec["messages"], self.system_message)
        if self.append_eos:  # not on tool-call turns: these templates render the calls after the content
            msgs = [
                {**m, "content": m["content"] + self.append_eos}
                if m["role"] == "assistant" and not m.get("tool_calls")
                else m
                for m in msgs
            ]
        tools = rec.get("tools") or None
        try:
            full = self._render(msgs, tools)
        except Exception as exc:  # jinja2 TemplateError from raise_exception, or a template's own bug
            raise _template_refusal(exc, msgs) from exc
        self._check_tool_support(full, msgs, tools)
        spans = self._spans(full, msgs, tools)
        if not spans:
            raise RecordRefused(
                "messages",
                "the assistant turns could not be found in the conversation the "
                "model's chat template renders, so no token can be learned",
            )
        return full, spans

    def _check_tool_support(
        self, full: str, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        def same_without(strip: Callable[[dict[str, Any]], dict[str, Any]], drop_tools: bool) -> bool:
            try:
                return self._render([strip(m) for m in msgs], None if drop_tools else tools) == full
            except Exception:
                return False

        if tools and same_without(lambda m: m, drop_tools=True):
            raise RecordRefused(
                "tools",
                "the model's chat template does not render tools (it has no tool "
                "support): train tool use on a model whose template takes tools=, or remove 'tools'",
            )
        calls = [i for i, m in enumerate(msgs) if m.get("tool_calls")]
        if calls and same_without(
            lambda m: {k: v for k, v in m.items() if k != "tool_calls"}, drop_tools=False
        ):
            raise RecordRefused(
                f"messages[{calls[0]}].tool_calls",
                "the model's chat template does not render "
                "assistant tool calls (it has no tool support): use a model whose template does",
            )

    def _spans(
        self, full: str, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[tuple[int, int]]:
        return loss_spans(
            lambda m, gen: self._render(m, tools, gen), full, msgs, self.tokenizer.eos_token or ""
        )
