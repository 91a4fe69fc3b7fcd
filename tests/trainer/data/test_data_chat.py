"""The OpenAI chat format with real architectures' tokenizers and templates (tests/model_folders.py):
tool calls and tools, content parts, developer role, BOM and CRLF, template refusals as line errors
(and the system-message fold), over-long examples under each truncation policy, and tokenizers
without eos or pad."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.model_folders import PLAIN_TEMPLATE, TOOL_CALL_RECORD, jsonl, write_model_folder
from trainer.data.chat_format import ChatRenderer
from trainer.data.dataset import (
    IGNORE_INDEX,
    DataOptions,
    DatasetValidationError,
    Example,
    tokenize_record,
    validate_file,
)
from trainer.model.catalog import load_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tokenizer-only folders (no weights: nothing here runs a model)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": write_model_folder(root / "qwen2", "qwen2", weights=False),
        "llama": write_model_folder(root / "llama", "llama", weights=False),
        "gemma2": write_model_folder(root / "gemma2", "gemma2", weights=False),
        "phi3": write_model_folder(root / "phi3", "phi3", weights=False),
        "llama-no-eos": write_model_folder(root / "llama-no-eos", "llama", eos=False, weights=False),
        "bare-no-eos": write_model_folder(
            root / "bare", "llama", eos=False, chat_template=None, weights=False
        ),
        "plain-no-eos": write_model_folder(
            root / "plain", "llama", eos=False, chat_template=PLAIN_TEMPLATE, weights=False
        ),
    }


def tok_of(folders: dict[str, Path], name: str) -> Any:
    return load_tokenizer(str(folders[name]))


def learned_runs(tok: Any, ex: Example) -> list[str]:
    """The learned tokens as decoded runs; also checks labels are the ids there and -100 elsewhere."""
    runs: list[str] = []
    cur: list[int] = []
    for i, label in zip(ex.input_ids, ex.labels, strict=True):
        assert label in (i, IGNORE_INDEX)
        if label != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs, cur = [*runs, tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def errors_of(path: Path, **kw: Any) -> list[dict[str, Any]]:
    with pytest.raises(DatasetValidationError) as ei:
        validate_file(path, **kw)
    return [dict(e) for e in ei.value.errors]


CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
}


def test_tool_calling_example_learns_the_calls_and_answers_only(folders: dict[str, Path]) -> None:
    tok = tok_of(folders, "qwen2")
    ex = tokenize_record(TOOL_CALL_RECORD, "chat", tok)
    text = tok.decode(ex.input_ids)
    assert (
        '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    )  # tools= rendered
    assert "What is the weather in Paris?" in text  # the two text parts joined
    # Byte-level tokens: the runs are the mask exactly (assistant tool call + answer, each with <|im_end|>\n).
    assert learned_runs(tok, ex) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "Sunny.<|im_end|>\n",
    ]
    zero = copy.deepcopy(TOOL_CALL_RECORD)
    zero["messages"][2]["weight"] = 0
    assert learned_runs(tok, tokenize_record(zero, "chat", tok)) == ["Sunny.<|im_end|>\n"]


def test_tool_file_validates_with_bom_and_crlf(tmp_path: Path, folders: dict[str, Path]) -> None:
    lines = [json.dumps(TOOL_CALL_RECORD), json.dumps(CHAT)]
    path = tmp_path / "tools.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    assert validate_file(path).num_examples == 2
    rep = validate_file(path, tokenizer=tok_of(folders, "qwen2"), max_seq_length=1024)
    assert rep.num_examples == 2 and rep.num_loss_tokens and rep.num_truncated == 0


def test_developer_role_renders_as_system(folders: dict[str, Path]) -> None:
    tok = tok_of(folders, "qwen2")
    rec = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    assert tok.decode(tokenize_record(rec, "chat", tok).input_ids).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>"
    )


def test_format_errors_of_the_openai_fields(tmp_path: Path) -> None:
    bad = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                },
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "q", "tool_calls": []},
                {"role": "assistant", "content": "a"},
            ]
        },
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "tools": {"f": 1},
        },
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
    ]
    got = [(e["line"], e["field"]) for e in errors_of(jsonl(tmp_path / "bad.jsonl", bad))]
    assert got == [
        (1, "messages[0].content[0]"),
        (2, "messages[1].tool_calls[0].function.arguments"),
        (3, "messages[0].tool_calls"),
        (4, "tools"),
        (5, "messages[1].content"),
    ]


def test_template_without_tool_support_is_a_line_error(tmp_path: Path, folders: dict[str, Path]) -> None:
    calls_only = copy.deepcopy(TOOL_CALL_RECORD)
    del calls_only["tools"]
    path = jsonl(tmp_path / "t.jsonl", [CHAT, TOOL_CALL_RECORD, calls_only])
    errs = errors_of(path, tokenizer=tok_of(folders, "llama"), max_seq_length=1024)
    assert [(e["line"], e["field"]) for e in errs] == [(2, "tools"), (3, "messages[2].tool_calls")]
    assert "does not render tools (it has no tool support)" in errs[0]["message"]


def test_gemma_refuses_system_names_the_line_and_fold_passes(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    tok = tok_of(folders, "gemma2")
    no_system = {"messages": CHAT["messages"][1:]}
    path = jsonl(tmp_path / "g.jsonl", [no_system, CHAT])
    errs = errors_of(path, tokenizer=tok, max_seq_length=512)
    assert [(e["line"], e["field"]) for e in errs] == [(2, "messages[0]")]
    assert "System role not supported" in errs[0]["message"]
    assert 'set hyperparameters.system_message to "fold"' in errs[0]["message"]
    rep = validate_file(
        path,
        tokenizer=tok,
        max_seq_length=512,
        options=DataOptions(system_message="fold"),
        keep_examples=True,
    )
    assert rep.num_examples == 2
    assert "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>" in tok.decode(rep.examples[1].input_ids)
    assert learned_runs(tok, rep.examples[1]) == ["hello<end_of_turn>\n", "ok<end_of_turn>\n"]


def test_phi3_learns_the_end_marker_of_every_turn(folders: dict[str, Path]) -> None:
    """Phi-3's template puts eos only after the whole conversation: each turn still learns <|end|>."""
    tok = tok_of(folders, "phi3")
    assert learned_runs(tok, tokenize_record(CHAT, "chat", tok)) == [
        "hello<|end|>\n",
        "ok<|end|>\n<|endoftext|>",
    ]


def _long_file(tmp_path: Path) -> Path:
    short = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 80}]}
    long_prompt = {"messages": [{"role": "user", "content": "q" * 80}, {"role": "assistant", "content": "a"}]}
    return jsonl(tmp_path / "long.jsonl", [short, long_answer, short, long_prompt, long_answer])


@pytest.mark.parametrize("policy", ["truncate", "drop", "error"])
def test_truncation_policies_count_and_name_the_lines(
    tmp_path: Path, folders: dict[str, Path], policy: str
) -> None:
    tok, path = tok_of(folders, "llama"), _long_file(tmp_path)
    kw: dict[str, Any] = dict(tokenizer=tok, max_seq_length=64, options=DataOptions(truncation=policy))  # type: ignore[arg-type]
    if policy == "error":
        errs = errors_of(path, **kw)
        assert [(e["line"], e["field"]) for e in errs] == [(2, "messages"), (4, "messages"), (5, "messages")]
        assert (
            "(max_seq_length 64)" in errs[0]["message"] and "hyperparameters.truncation" in errs[0]["message"]
        )
        return
    rep = validate_file(path, keep_examples=True, **kw)
    assert all(len(ex.input_ids) <= 64 for ex in rep.examples) and rep.truncation == policy
    if policy == "truncate":
        # lines 2 and 5 keep their first 64 tokens; line 4's answer lies past the cut: dropped, and said so
        assert (rep.num_examples, rep.num_truncated, rep.truncated_lines) == (4, 2, [2, 5])
        assert (rep.num_dropped, rep.dropped_lines) == (1, [4])
        assert rep.cut_summary() == (
            "2 truncated to 64 tokens (lines 2, 5); "
            "1 dropped, no assistant token left after truncation (line 4)"
        )
    else:
        assert (rep.num_examples, rep.num_truncated, rep.num_dropped, rep.dropped_lines) == (
            2,
            0,
            3,
            [2, 4, 5],
        )
    assert rep.as_dict()["num_dropped"] == rep.num_dropped
    only_long = jsonl(
        tmp_path / "only_long.jsonl", [json.loads(ln) for ln in path.read_text().splitlines()[3:4]]
    )
    assert "no example left" in errors_of(only_long, **kw)[0]["message"]


def test_no_eos_reuses_the_templates_end_of_turn_marker(folders: dict[str, Path]) -> None:
    from trainer.data.tokenizer import stop_token_ids

    tok = tok_of(folders, "llama-no-eos")
    assert tok.eos_token == tok.pad_token == "<|eot_id|>"  # no token added: the marker serves as eos and pad
    assert len(tok) == len(tok_of(folders, "llama"))
    assert learned_runs(tok, tokenize_record(CHAT, "chat", tok)) == ["hello<|eot_id|>", "ok<|eot_id|>"]
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|eot_id|>")]


@pytest.mark.parametrize("name", ["bare-no-eos", "plain-no-eos"])
def test_no_eos_and_no_marker_adds_one_end_token_learned_after_every_turn(
    folders: dict[str, Path], name: str
) -> None:
    tok = tok_of(folders, name)
    assert tok.eos_token == tok.pad_token == "<|end|>" and len(tok) == len(tok_of(folders, "llama")) + 1
    assert learned_runs(tok, tokenize_record(CHAT, "chat", tok)) == ["hello<|end|>\n", "ok<|end|>\n"]


def test_pad_is_eos_not_a_new_token(folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(folders["llama"]))
    assert raw.pad_token is None
    tok = tok_of(folders, "llama")
    assert tok.pad_token == tok.eos_token == "<|eot_id|>" and len(tok) == len(raw)


def test_gemma_stops_on_eos_and_end_of_turn(folders: dict[str, Path]) -> None:
    from trainer.data.tokenizer import end_of_turn_token, stop_token_ids

    tok = tok_of(folders, "gemma2")
    assert end_of_turn_token(tok) == "<end_of_turn>"
    assert stop_token_ids(tok) == [
        tok.convert_tokens_to_ids("<eos>"),
        tok.convert_tokens_to_ids("<end_of_turn>"),
    ]


def test_renderer_options_are_per_file(folders: dict[str, Path]) -> None:
    tok = tok_of(folders, "gemma2")
    text, spans = ChatRenderer(tok, "fold").render(CHAT)
    assert [text[a:b] for a, b in spans] == ["hello<end_of_turn>\n", "ok<end_of_turn>\n"]
