"""The training data: JSONL validation and tokenization (``dataset``), the OpenAI chat format
(``chat_format``), the built-in tokenizer (``tokenizer``), batches and the loss (``batching``) and
padding-free packing (``packing``)."""
