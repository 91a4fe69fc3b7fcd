"""Inference on base and fine-tuned models: ``/v1/chat/completions`` and ``/v1/completions``.

``schemas`` (request and response bodies), ``service`` (a request end to end, JSON or server-sent
events), ``worker`` (bounded admission and the generation threads), ``builtin`` and ``generation``
(transformers ``generate``), ``model_cache`` (loaded models within a budget), ``vllm`` (forwarding to
a vLLM server), ``metrics`` (Prometheus).
"""
