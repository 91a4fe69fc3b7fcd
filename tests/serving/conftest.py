"""The API's fixtures (its PostgreSQL database, Redis, settings), for the tests that put an API in front
of the serving process."""

from tests.api.conftest import data_dir, pg_url, queue_name, redis_url, settings

__all__ = ["data_dir", "pg_url", "queue_name", "redis_url", "settings"]
