"""Persistence shared by the API and the workers: settings, ORM models, sessions.

The database is the source of truth for jobs, events, checkpoints and worker heartbeats; the broker
is only transport. Both api/ and trainer/ import this package; it imports neither.
"""
