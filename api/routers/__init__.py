"""HTTP routers, one resource each: files, fine-tuning jobs (with their pause and resume), their events,
models (and their downloads), chat and text completions, quotas, health."""
