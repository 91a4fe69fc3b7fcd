"""Inference on base and fine-tuned models: ``/v1/chat/completions`` and ``/v1/completions``.

``schemas`` (request and response bodies), ``service`` (a request end to end, JSON or server-sent
events, the per-request caps), ``admission`` (slots shared between teams), ``generation_pool`` and
``tickets`` (the preparing threads, the bridge to the event loop), ``builtin`` (a request prepared),
``batcher`` and ``generation`` (the requests for one model decoded together), ``detokenize`` and
``sampling`` (text as it is made), ``model_cache`` (loaded models within a budget), ``vllm`` (forwarding
to a vLLM server), ``metrics`` (Prometheus).
"""
