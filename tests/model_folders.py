"""Tiny local Hugging Face model folders of real architectures, built offline for tests.

:func:`write_model_folder` writes what a user brings as a base model: ``config.json`` of a transformers
config class (Llama, Qwen2, Mistral, GPT-2, Phi-3, Gemma-2), a ``tokenizers`` tokenizer (byte-level BPE
without merges, or WordLevel over a word list) with that family's special tokens and a chat template
in that family's format, and safetensors weights from a seeded random init (a few thousand
parameters). Every piece can be left out or changed to build the broken and unusual folders the data
and model intake must handle (no eos, no pad, no chat template, a template refusing the system role,
no weights, a vocabulary with spare rows).

The templates here are compact equivalents of each family's format, written for these tests: what
matters is their behaviour (Gemma-2 raises on a system message, Phi-3 appends eos only at the end of
the conversation, the ChatML one renders ``tools`` and ``tool_calls``), not byte equality with a
published tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Llama-3 style: header tokens around the role, <|eot_id|> ends every turn (and is the eos).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: ChatML (Qwen2) with tool support: ``tools`` go into the system turn, assistant ``tool_calls`` as
#: <tool_call> blocks, ``tool`` messages as <tool_response> blocks in a user turn.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{- '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{%- for tc in m['tool_calls'] or [] %}{{ '\\n<tool_call>\\n' }}"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "{{- '\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: ChatML without tool support (a ``tools`` list is ignored, tool calls are not rendered).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Gemma-2 style: no system role (raises), user/model turns must alternate, <end_of_turn> ends a turn.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

#: Phi-3 style: <|end|> ends every turn, the eos (<|endoftext|>) only closes the whole conversation.
PHI3_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ('system', 'user', 'assistant') %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

#: Mistral-instruct style: [INST] user [/INST] answer</s>; no system role in the format.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

#: Plain-text markers and no special end-of-turn token (for a tokenizer without eos).
PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers model_type, small config values, special tokens and template."""

    model_type: str
    config: dict[str, Any]
    specials: tuple[str, ...]
    bos: str | None
    eos: str | None
    pad: str | None
    template: str | None
    extra: dict[str, Any] = field(default_factory=dict)


_DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)

FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        _DECODER,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        LLAMA3_TEMPLATE,
    ),
    "qwen2": Family(
        "qwen2",
        _DECODER,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None,
        "<|im_end|>",
        "<|endoftext|>",
        CHATML_TOOLS_TEMPLATE,
    ),
    "mistral": Family(
        "mistral",
        {**_DECODER, "sliding_window": None},
        ("<unk>", "<s>", "</s>"),
        "<s>",
        "</s>",
        None,
        MISTRAL_TEMPLATE,
    ),
    "gpt2": Family(
        "gpt2",
        dict(n_embd=32, n_layer=1, n_head=2),
        ("<|endoftext|>",),
        "<|endoftext|>",
        "<|endoftext|>",
        None,
        None,
    ),
    "phi3": Family(
        "phi3",
        _DECODER,
        ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        None,
        "<|endoftext|>",
        "<|endoftext|>",
        PHI3_TEMPLATE,
    ),
    "gemma2": Family(
        "gemma2",
        {**_DECODER, "head_dim": 16, "query_pre_attn_scalar": 16},
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        "<pad>",
        GEMMA2_TEMPLATE,
    ),
}

#: Words of the WordLevel vocabulary (anything else is <unk>).
WORDS = (
    "hi",
    "hello",
    "yes",
    "no",
    "what",
    "is",
    "the",
    "weather",
    "in",
    "paris",
    "sunny",
    "ok",
    "be",
    "brief",
    "capital",
    "of",
    "france",
    "lima",
    "peru",
    "and",
    "a",
    "b",
    "c",
    "?",
    ".",
    ",",
    ":",
)

DEFAULT = "default"


def build_tokenizer(
    specials: list[str],
    *,
    kind: str = "bpe",
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
    unk: str | None = None,
    chat_template: str | None = None,
    model_max_length: int = 256,
) -> Any:
    """A ``PreTrainedTokenizerFast``: ``bpe`` (byte-level, no merges: any text) or ``wordlevel``
    (whitespace and punctuation split over :data:`WORDS`, the rest ``unk``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = list(dict.fromkeys([*specials, *(t for t in (bos, eos, pad, unk) if t)]))
    vocab = {tok: i for i, tok in enumerate(names)}
    if kind == "bpe":
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    elif kind == "wordlevel":
        for w in WORDS:
            vocab.setdefault(w, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk or names[0]))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok.add_special_tokens(names)
    kw = {k: v for k, v in dict(bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk).items() if v}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=chat_template, model_max_length=model_max_length, **kw
    )


def write_model_folder(
    path: str | Path,
    arch: str = "llama",
    *,
    chat_template: str | None = DEFAULT,
    eos: bool = True,
    bos: bool = True,
    pad: bool | None = None,
    unk: bool = False,
    tokenizer_kind: str = "bpe",
    extra_specials: tuple[str, ...] = (),
    spare_vocab: int = 0,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool | None = None,
    weights: bool = True,
    tokenizer: bool = True,
    seed: int = 0,
) -> Path:
    """Write a tiny model folder of ``arch`` (a :data:`FAMILIES` key) to ``path`` and return it.

    ``chat_template``: the family's (``"default"``), another template string, or None (no template).
    ``eos``/``bos``/``unk``: whether the tokenizer names that token (with ``eos=False`` the family's
    eos stays in the vocabulary as a special token, so a template may still use it as its end-of-turn
    marker; combine with ``chat_template=None`` or :data:`PLAIN_TEMPLATE` for no marker at all);
    ``pad``: None = the family's choice. ``spare_vocab``: embedding rows beyond the tokenizer's vocabulary (as real models pad
    theirs). ``weights``/``tokenizer`` False leave those files out.
    """
    from transformers import AutoConfig

    fam = FAMILIES[arch]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    template = fam.template if chat_template == DEFAULT else chat_template
    pad_tok = fam.pad if pad is None else (fam.pad or "<pad>") if pad else None
    eos_tok = fam.eos if eos else None
    unk_tok = "<unk>" if unk or tokenizer_kind == "wordlevel" else None
    specials = list(fam.specials) + list(extra_specials)  # eos=False: the token stays, only unnamed
    tok = build_tokenizer(
        specials,
        kind=tokenizer_kind,
        bos=fam.bos if bos else None,
        eos=eos_tok,
        pad=pad_tok,
        unk=unk_tok,
        chat_template=template,
        model_max_length=max_position_embeddings,
    )
    if tokenizer:
        tok.save_pretrained(out)

    def tid(t: str | None) -> int | None:
        return None if t is None else int(tok.convert_tokens_to_ids(t))

    ids = dict(
        bos_token_id=tid(fam.bos if bos else None), eos_token_id=tid(eos_tok), pad_token_id=tid(pad_tok)
    )
    sizes = dict(fam.config)
    if fam.model_type == "gpt2":
        sizes["n_positions"] = max_position_embeddings
    else:
        sizes["max_position_embeddings"] = max_position_embeddings
    if tie_word_embeddings is not None:
        sizes["tie_word_embeddings"] = tie_word_embeddings
    cfg = AutoConfig.for_model(fam.model_type, vocab_size=len(tok) + spare_vocab, **sizes, **ids)
    if weights:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(out, safe_serialization=True)
    else:
        cfg.save_pretrained(out)
    return out


def jsonl(path: str | Path, records: list[Any]) -> Path:
    """Write ``records`` (dicts, or raw strings written as they are) one per line."""
    p = Path(path)
    p.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8"
    )
    return p


#: An OpenAI chat fine-tuning record with a tool list, an assistant tool call and the tool's answer.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOL_CALL_RECORD: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather "},
                {"type": "text", "text": "in Paris?"},
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ],
    "tools": [WEATHER_TOOL],
}
