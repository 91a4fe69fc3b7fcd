"""The built-in backend: transformers models decoded by our own batched loop in threads of the process
that runs the engine (``serving.local``)."""
