"""Chat and text completions (``/v1/chat/completions``, ``/v1/completions``), a layer of its own beside
``worker/`` and, deployed, a process of its own (``python -m serving``).

The API's routes talk to an engine client (``client``: ``EngineClient``), never to the engine: the engine
in this process (``local``: the per-request caps, then ``vllm`` forwarding or the ``builtin`` backend) or
the serving process's (``remote``, to ``server``). ``config`` (the inference settings), ``errors`` (the
error envelope), ``schemas`` (request and response bodies), ``responses`` (OpenAI's shapes, whole or
streamed), ``prometheus`` (metrics). The built-in backend is ``builtin/``: ``engine`` (a request run),
``team_shares`` (admission by team), ``generation_pool`` and ``tickets`` (the preparing threads, the bridge
to the event loop), ``prepare`` (a request prepared), ``batcher`` and ``generation`` (the requests for one
model decoded together), ``detokenize`` and ``sampling`` (text as it is made), ``model_cache`` (loaded
models within a budget).
"""
