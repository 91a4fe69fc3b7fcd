"""The worker's Prometheus metrics: a job's training steps, the worker's /metrics, its GPUs."""
