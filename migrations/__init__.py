"""Alembic migrations of the store/ schema; run them with ``zenflow db upgrade`` (or on API start)."""

from pathlib import Path

#: The directory holding alembic.ini, env.py and versions/ (works from a checkout and installed).
HERE = Path(__file__).resolve().parent
