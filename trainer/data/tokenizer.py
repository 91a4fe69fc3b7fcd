"""Byte-level tokenizer for the built-in model configs, and chat templates.

The built-in models (``tiny-llama`` ...) have no tokenizer files to download, so they use a
byte-level vocabulary built here with the ``tokenizers`` library: six special tokens, then one token
per byte (256). Any UTF-8 text round-trips. The tokenizer is wrapped as a
``transformers.PreTrainedTokenizerFast`` with bos/eos/pad tokens and a chat template, and is saved
with every checkpoint so that ``AutoTokenizer.from_pretrained(checkpoint_dir)`` loads it.

Chat format of the built-in template::

    <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>

``<|end|>`` is the eos token, so generation stops at the end of an assistant turn.

Local tokenizers are made ready for fine-tuning by :func:`ensure_chat_ready` (template, eos, pad);
:func:`end_of_turn_token` and :func:`stop_token_ids` say where a template ends an assistant turn and
what generation must stop on (:func:`align_generation_config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

#: Each assistant tool call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after the
#: content (Hugging Face's chat-template conventions: ``tools=``, ``message.tool_calls``).
_TOOL_CALLS = (
    "{% for call in message.tool_calls or [] %}<tool_call>{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
)

#: Chat template of the byte-level tokenizer (the role markers are single special tokens); a tool list
#: goes as JSON into a system turn before the conversation.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}" + _TOOL_CALLS + "<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Fallback for a local tokenizer that ships no chat template: plain-text role markers, eos after
#: assistant turns so the fine-tuned model learns to stop; a tool list as JSON in a ``<|tools|>`` turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% if tools %}{{ '<|tools|>\\n' }}{{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    + _TOOL_CALLS
    + "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def build_byte_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-5 are special tokens, 6-261 the 256 byte values."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=BYTE_CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="right",
    )


def byte_vocab_size() -> int:
    """Vocabulary size of :func:`build_byte_tokenizer` (special tokens + 256 bytes)."""
    return len(SPECIAL_TOKENS) + 256


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The special token the chat template puts after an assistant turn's content (``<|eot_id|>``,
    ``<|im_end|>``, ``<end_of_turn>``, Phi-3's ``<|end|>``, or eos), or None when it puts none."""
    probe = "zq"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}], tokenize=False
        )
    except Exception:  # a template that refuses even this conversation marks nothing we can use
        return None
    assert isinstance(text, str)
    at = text.rfind(probe)
    if at < 0:
        return None
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    for tid in tokenizer(text[at + len(probe) :], add_special_tokens=False)["input_ids"]:
        if tid in special:
            return str(tokenizer.convert_ids_to_tokens(tid))
    return None


def ensure_chat_ready(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give a loaded tokenizer what fine-tuning needs, adding a token only when nothing can serve.

    - a chat template (:data:`DEFAULT_CHAT_TEMPLATE` when it has none);
    - an eos token: without one, the template's end-of-turn marker becomes eos (no new token); with no
      marker either, ``<|end|>`` is added as eos (the model's embeddings then grow by one row:
      trainer.model.catalog.load_model) and the renderer appends it to every assistant turn
      (trainer.data.chat_format), so the model learns to stop;
    - a pad token: eos. Padding never reaches the loss or attention (attention mask, labels -100), so
      reusing eos needs no new token and keeps a LoRA adapter valid for the base vocabulary.
    """
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if tokenizer.eos_token is None:
        marker = end_of_turn_token(tokenizer)
        if marker is not None:
            tokenizer.eos_token = marker
        else:
            tokenizer.add_special_tokens({"eos_token": EOS})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids generation stops on: eos, and the template's end-of-turn marker when that differs."""
    ids: list[int] = []
    for tok in (tokenizer.eos_token, end_of_turn_token(tokenizer)):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok else None
        if isinstance(tid, int) and tid not in ids:
            ids.append(tid)
    return ids


def align_generation_config(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's generation config stop where fine-tuning taught it to (every stop token) and pad
    with the tokenizer's pad token; the config is saved with every checkpoint and the final model."""
    gen = getattr(model, "generation_config", None)
    ids = stop_token_ids(tokenizer)
    if gen is None or not ids:
        return
    gen.eos_token_id = ids[0] if len(ids) == 1 else ids
    if tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
