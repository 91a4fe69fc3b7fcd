"""End-to-end runs (the SDK against a live API, a real Celery worker and job runner) share tests/api's
session fixtures: one database, one queue, the API's settings."""

from tests.api.conftest import data_dir, enqueued, pg_url, queue_name, redis_url, settings

__all__ = ["data_dir", "enqueued", "pg_url", "queue_name", "redis_url", "settings"]
