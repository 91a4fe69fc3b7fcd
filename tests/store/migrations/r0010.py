"""Migration 0010: checksums cached for the old download tar are cleared (the next download computes
the new tar's), on PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from api import migrate
from store.db import make_engine
from tests.store.migrations.r0005 import JOB, ROWS


def check(url: str, tmp: Path) -> None:
    outputs = tmp / "out"
    (outputs / "final").mkdir(parents=True)
    migrate.upgrade(url, "0004")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            ftm = f"'{outputs / 'final'}'"
            conn.execute(
                text(JOB.format(id="ftjob-1", model="tiny-llama", status="succeeded", suffix="NULL", ftm=ftm))
            )
        migrate.upgrade(url, "0009")  # 0005 registers the job's final model
        with engine.begin() as conn:
            conn.execute(text("UPDATE models SET content_sha256 = 'old', adapter_sha256 = 'old'"))
        migrate.upgrade(url, "0010")
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT content_sha256, adapter_sha256 FROM models")).all()
        assert rows and all(tuple(r) == (None, None) for r in rows)
        migrate.downgrade(url, "0009")
    finally:
        engine.dispose()
