"""Loss spans and masks in time linear in the conversation (trainer.data.chat_spans, issue 25): a
4000-message line renders about twice the messages of a 2000-message one and takes about twice as
long (it took minutes), and the windowed spans of a long conversation are the ones rendering every
prefix gives (the definition), for every template family of tests/model_folders.py."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.model_folders import PLAIN_TEMPLATE, TOOL_CALL_RECORD, write_model_folder
from trainer.data import chat_spans
from trainer.data.chat_format import ChatRenderer, template_messages
from trainer.data.dataset import IGNORE_INDEX, _mask_by_spans, validate_file
from trainer.model.catalog import load_tokenizer

#: Qwen3's rule: an assistant turn after the last user message renders an empty think block.
THINK_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

FOLDERS: dict[str, dict[str, Any]] = {
    "qwen2": {"arch": "qwen2"},
    "llama": {"arch": "llama"},
    "gemma2": {"arch": "gemma2"},
    "phi3": {"arch": "phi3"},
    "mistral": {"arch": "mistral"},
    "gpt2": {"arch": "gpt2"},
    "plain-no-eos": {"arch": "llama", "eos": False, "chat_template": PLAIN_TEMPLATE},
    "bare-no-eos": {"arch": "llama", "eos": False, "chat_template": None},
    "think": {"arch": "qwen2", "chat_template": THINK_TEMPLATE},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    out = {"tiny-llama": "tiny-llama"}
    for name, kw in FOLDERS.items():
        kw = dict(kw)
        out[name] = str(write_model_folder(root / name, kw.pop("arch"), weights=False, **kw))
    return out


def prefix_spans(r: ChatRenderer, full: str, msgs: list[dict[str, Any]], tools: Any) -> list[tuple[int, int]]:
    """The definition: each learned turn's prefix rendered (O(N^2) renders; the old implementation)."""
    eos = r.tokenizer.eos_token or ""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        span = None
        try:
            before = r._render(msgs[:i], tools, gen=True)
            upto = r._render(msgs[: i + 1], tools)
            end = chat_spans.common_prefix(upto, full)
            if full.startswith(before) and len(before) >= cursor and end > len(before):
                span = (len(before), end)
        except Exception:
            span = None
        span = span or chat_spans.located(full, m["content"], eos, cursor)
        if span is not None:
            spans.append(span)
            cursor = span[1]
    return spans


def conversation(n: int, *, system: bool, weights: bool, repeat: bool, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}] if system else []
    for k in range(n // 2):
        user = "Continue." if repeat else f"question {k} " + "x" * rng.randint(0, 20)
        reply: dict[str, Any] = {
            "role": "assistant",
            "content": "Sure." if repeat else f"answer {k} " + "y" * rng.randint(0, 20),
        }
        if weights and k % 3 == 1:
            reply["weight"] = 0
        msgs += [{"role": "user", "content": user}, reply]
    return {"messages": msgs}


@pytest.mark.parametrize("name", ["tiny-llama", *FOLDERS])
def test_windowed_spans_are_the_prefix_spans(models: dict[str, str], name: str) -> None:
    """80 messages: the turns past the first 32 come from windows, and agree with the definition."""
    tok = load_tokenizer(models[name])
    compared = 0
    for system in (False, True):
        for fold in ("keep", "fold"):
            for weights, repeat in ((False, False), (True, False), (False, True)):
                rec = conversation(80, system=system, weights=weights, repeat=repeat)
                r = ChatRenderer(tok, fold)
                try:
                    full, spans = r.render(rec)
                except ValueError:  # a template refusing the system role (kept): nothing to compare
                    continue
                msgs = template_messages(rec["messages"], fold)
                if r.append_eos:
                    msgs = [
                        {**m, "content": m["content"] + r.append_eos} if m["role"] == "assistant" else m
                        for m in msgs
                    ]
                assert spans == prefix_spans(r, full, msgs, None), (system, fold, weights, repeat)
                assert len(spans) == sum(m["role"] == "assistant" and m.get("weight", 1) for m in msgs)
                compared += 1
    assert compared >= 6


def test_windowed_spans_of_tool_turns(models: dict[str, str]) -> None:
    tok = load_tokenizer(models["qwen2"])
    rec = json.loads(json.dumps(TOOL_CALL_RECORD))
    turns = [m for m in rec["messages"] if m["role"] != "system"]
    rec["messages"] += [json.loads(json.dumps(m)) for _ in range(12) for m in turns]
    r = ChatRenderer(tok)
    full, spans = r.render(rec)
    assert len(rec["messages"]) > chat_spans.EXACT_PREFIX_MESSAGES
    assert spans == prefix_spans(r, full, template_messages(rec["messages"]), rec["tools"])


def _alternating(path: Path, n: int) -> Path:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} hello"} for i in range(n)]
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    return path


def test_a_4000_message_line_renders_linearly_many_messages(tmp_path: Path, models: dict[str, str]) -> None:
    """Messages rendered by the whole check (the full text, windows, prefixes): 2N over N within 2.5
    (rendering every prefix made it 4x)."""
    tok = load_tokenizer(models["qwen2"])
    rendered = 0
    apply = tok.apply_chat_template

    def counting(messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        nonlocal rendered
        rendered += len(messages)
        return apply(messages, *args, **kwargs)

    tok.apply_chat_template = counting  # type: ignore[method-assign,assignment]
    counts = []
    for n in (2000, 4000):
        rendered = 0
        validate_file(_alternating(tmp_path / f"{n}.jsonl", n), tokenizer=tok, max_seq_length=256)
        counts.append(rendered)
    assert counts[1] / counts[0] <= 2.5, counts
    assert counts[1] <= 20 * 4000, counts  # a few renders of each message, not one per prefix


def test_a_long_message_line_is_checked_in_linear_time(tmp_path: Path, models: dict[str, str]) -> None:
    """The whole check (parse, render, tokenize, mask) of 2000 messages over 1000 runs at most 2.2x the
    Python lines (counted by a trace function: the same count on any machine, load or no load)."""
    tok = load_tokenizer(models["tiny-llama"])
    paths = {n: _alternating(tmp_path / f"{n}.jsonl", n) for n in (1000, 2000)}

    def lines_run(n: int) -> int:
        count = 0

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal count
            count += event == "line"
            return trace

        sys.settrace(trace)
        try:
            validate_file(paths[n], tokenizer=tok, max_seq_length=1024)
        finally:
            sys.settrace(None)
        return count

    lines_run(1000)  # first use: imports and caches are not the check's own lines
    small, large = lines_run(1000), lines_run(2000)
    assert small > 10_000 and large <= 2.2 * small, (small, large)


def test_masks_are_the_tokens_ending_inside_a_span() -> None:
    """One pass over tokens and spans marks what ``any(a < end <= b)`` marks, offsets out of order too."""
    rng = random.Random(1)

    class Tok:
        def __init__(self, offsets: list[tuple[int, int]]) -> None:
            self.offsets = offsets

        def __call__(self, text: str, **_: Any) -> dict[str, Any]:
            return {"input_ids": list(range(len(self.offsets))), "offset_mapping": self.offsets}

    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 400), 20))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, 20, 2)]
        offsets = []
        for _ in range(150):
            s = rng.randrange(0, 400)
            offsets.append((s, s + rng.randrange(0, 6)))
        if rng.random() < 0.5:
            offsets.sort()
        ex = _mask_by_spans(Tok(offsets), "", spans, False)  # type: ignore[arg-type]
        want = [
            t if e > s and any(a < e <= b for a, b in spans) else IGNORE_INDEX
            for t, (s, e) in enumerate(offsets)
        ]
        assert ex.labels == want


def test_common_prefix_agrees_with_a_character_loop() -> None:
    rng = random.Random(2)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 700)))
        b = a[: rng.randrange(0, len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(0, 50)))
        i, j = rng.randrange(0, 3), rng.randrange(0, 3)
        want = 0
        while i + want < len(a) and j + want < len(b) and a[i + want] == b[j + want]:
            want += 1
        assert chat_spans.common_prefix(a, b, i, j) == want
