"""Prometheus metrics of the inference endpoints, process-wide (one set however many apps a process
builds), served by the serving process's ``/metrics`` (``serving.server``), or the API's
(api.core.prometheus) when it runs the engine itself. Labels are bounded: the endpoint, the backend
and an outcome; never a model id (teams create those without limit).

* ``zenflow_inference_requests_total{endpoint, backend, outcome}``: ``ok``, ``rejected`` (429, queue
  full), ``timeout``, ``cancelled`` (the client went away), ``invalid`` (a 4xx found while running,
  e.g. a prompt over the model's context), ``error``.
* ``zenflow_inference_tokens_total{endpoint, kind}``: ``prompt`` and ``completion`` tokens the
  built-in backend computed, those of generations stopped early included.
* ``zenflow_inference_request_duration_seconds{endpoint, backend}``, from admission to the last token.
* ``zenflow_inference_time_to_first_token_seconds{endpoint}`` and
  ``zenflow_inference_queue_wait_seconds`` (built-in backend).
* ``zenflow_inference_batch_rows``: the choices each forward pass of the built-in backend decoded
  together (requests for the same model share them).
* ``zenflow_inference_slots_in_use`` (admitted requests: running plus waiting),
  ``zenflow_inference_models_loaded`` and ``zenflow_inference_model_bytes`` (the built-in backend's cache).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

#: Generations take tenths of a second to minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


@dataclass(frozen=True)
class _Metrics:
    requests: Counter
    tokens: Counter
    duration: Histogram
    first_token: Histogram
    queue_wait: Histogram
    batch_rows: Histogram
    slots: Gauge
    models: Gauge
    model_bytes: Gauge


_METRICS: _Metrics | None = None
_LOCK = threading.Lock()


def get() -> _Metrics:
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = _Metrics(
                Counter(
                    "zenflow_inference_requests_total",
                    "Inference requests by endpoint, backend and outcome.",
                    ("endpoint", "backend", "outcome"),
                ),
                Counter(
                    "zenflow_inference_tokens_total",
                    "Prompt and completion tokens computed by the built-in inference backend.",
                    ("endpoint", "kind"),
                ),
                Histogram(
                    "zenflow_inference_request_duration_seconds",
                    "Inference request time from admission to its last token.",
                    ("endpoint", "backend"),
                    buckets=DURATION_BUCKETS,
                ),
                Histogram(
                    "zenflow_inference_time_to_first_token_seconds",
                    "Time from admission to the first generated token (built-in backend).",
                    ("endpoint",),
                    buckets=FIRST_TOKEN_BUCKETS,
                ),
                Histogram(
                    "zenflow_inference_queue_wait_seconds",
                    "Time an admitted request waited for a generation thread (built-in backend).",
                    buckets=FIRST_TOKEN_BUCKETS,
                ),
                Histogram(
                    "zenflow_inference_batch_rows",
                    "Choices decoded together in one forward pass of the built-in backend.",
                    buckets=BATCH_BUCKETS,
                ),
                Gauge(
                    "zenflow_inference_slots_in_use",
                    "Admitted inference requests: running plus waiting.",
                    multiprocess_mode="livesum",
                ),
                Gauge(
                    "zenflow_inference_models_loaded",
                    "Models the built-in inference backend holds loaded.",
                    multiprocess_mode="livesum",
                ),
                Gauge(
                    "zenflow_inference_model_bytes",
                    "Bytes of the models the built-in backend holds loaded.",
                    multiprocess_mode="livesum",
                ),
            )
        return _METRICS


def model_loaded(nbytes: int) -> None:
    m = get()
    m.models.inc()
    m.model_bytes.inc(nbytes)


def model_unloaded(nbytes: int) -> None:
    m = get()
    m.models.dec()
    m.model_bytes.dec(nbytes)


def request_done(endpoint: str, backend: str, outcome: str, seconds: float | None = None) -> None:
    m = get()
    m.requests.labels(endpoint, backend, outcome).inc()
    if seconds is not None:
        m.duration.labels(endpoint, backend).observe(seconds)


def tokens(endpoint: str, prompt: int, completion: int) -> None:
    m = get()
    m.tokens.labels(endpoint, "prompt").inc(prompt)
    m.tokens.labels(endpoint, "completion").inc(completion)
