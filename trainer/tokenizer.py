"""Byte-level tokenizer for the built-in model configs, and chat templates.

The built-in models (``tiny-llama`` ...) have no tokenizer files to download, so they use a
byte-level vocabulary built here with the ``tokenizers`` library: six special tokens, then one token
per byte (256). Any UTF-8 text round-trips. The tokenizer is wrapped as a
``transformers.PreTrainedTokenizerFast`` with bos/eos/pad tokens and a chat template, and is saved
with every checkpoint so that ``AutoTokenizer.from_pretrained(checkpoint_dir)`` loads it.

Chat format of the built-in template::

    <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>

``<|end|>`` is the eos token, so generation stops at the end of an assistant turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

#: Chat template of the byte-level tokenizer (the role markers are single special tokens).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Fallback for a local tokenizer that ships no chat template: plain-text role markers, eos after
#: assistant turns so the fine-tuned model learns to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
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


def ensure_chat_ready(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give a loaded tokenizer a pad token (eos) and a chat template when it lacks them."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": PAD})
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer
