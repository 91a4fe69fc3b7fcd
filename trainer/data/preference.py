"""OpenAI's preference (DPO) format: one pair per line,
``{"input": {"messages": [...], "tools": [...]}, "preferred_output": [assistant messages],
"non_preferred_output": [assistant messages]}``.

A pair is two chat records sharing the input: input + preferred_output (chosen) and input +
non_preferred_output (rejected). Each is checked by :func:`trainer.data.chat_format.check_chat_record`,
its problems named in the pair's own fields (``input.messages[2].role``, ``preferred_output[0].content``),
and rendered by the model's chat template like a chat example; only the output's assistant tokens are
learned (the input's assistant turns get weight 0), so the DPO loss compares what follows the shared
prompt. No torch import.
"""

from __future__ import annotations

from typing import Any

from trainer.data.chat_format import Problem, check_chat_record

#: The keys that make a record a preference pair (any one of them).
PREFERENCE_KEYS = ("input", "preferred_output", "non_preferred_output")
OUTPUTS = ("preferred_output", "non_preferred_output")


def is_preference(rec: dict[str, Any]) -> bool:
    return any(k in rec for k in PREFERENCE_KEYS)


def chat_records(rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chosen and rejected chat records of a checked pair (the input's assistant turns weight 0)."""
    inp = rec["input"]
    context = [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in inp["messages"]]
    tools = {"tools": inp["tools"]} if inp.get("tools") is not None else {}
    return tuple(  # type: ignore[return-value]
        {"messages": [*context, *rec[key]], **tools} for key in OUTPUTS
    )


def pair_field(fld: str, n_input: int, output: str) -> str:
    """``messages[i]...`` of a pair's chat record (its input has ``n_input`` messages, then ``output``'s)
    as the pair's own field."""
    if not fld.startswith("messages["):
        return f"input.{fld}" if fld == "tools" or fld.startswith("tools[") else output
    i, rest = fld[len("messages[") :].split("]", 1)
    k = int(i)
    return f"input.messages[{k}]{rest}" if k < n_input else f"{output}[{k - n_input}]{rest}"


def check_preference_record(rec: dict[str, Any]) -> list[Problem]:
    """The format problems of one preference record (empty when it is valid)."""
    inp = rec.get("input")
    if inp is None:
        return [("input", "missing (expected an object with 'messages')")]
    if not isinstance(inp, dict):
        return [("input", "expected an object with 'messages' (and optional 'tools')")]
    messages = inp.get("messages")
    problems = _shape_problems(rec, messages)
    if problems:
        return problems
    assert isinstance(messages, list)
    problems = _chat_problems(rec, len(messages))
    if not problems and rec["preferred_output"] == rec["non_preferred_output"]:
        problems.append(("non_preferred_output", "the same as preferred_output (nothing to prefer)"))
    return problems


def _shape_problems(rec: dict[str, Any], messages: Any) -> list[Problem]:
    """The pair's shape: input messages, and each output a non-empty list of assistant messages."""
    problems: list[Problem] = []
    if not isinstance(messages, list) or not messages:
        problems.append(("input.messages", "expected a non-empty list of messages"))
    for key in OUTPUTS:
        out = rec.get(key)
        if not isinstance(out, list) or not out:
            problems.append(
                (key, "missing" if out is None else "expected a non-empty list of assistant messages")
            )
            continue
        for j, m in enumerate(out):
            if not isinstance(m, dict) or m.get("role") != "assistant":
                problems.append(
                    (f"{key}[{j}].role", "must be 'assistant' (an output is the assistant's reply)")
                )
    return problems


def _chat_problems(rec: dict[str, Any], n_input: int) -> list[Problem]:
    """Both chat records' problems, named in the pair's fields (the shared input's once)."""
    problems: list[Problem] = []
    for key, chat in zip(OUTPUTS, chat_records(rec), strict=True):
        for fld, detail in check_chat_record(chat):
            name = key if fld is None or fld == "messages" else pair_field(fld, n_input, key)
            if key == OUTPUTS[1] and name.startswith("input"):
                continue  # the input's problems are named once
            problems.append((name, detail))
    return problems
