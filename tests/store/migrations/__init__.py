"""One module per Alembic revision whose upgrade or downgrade moves data: ``check(url, tmp)`` migrates a
database holding rows of the revision before to it (and on to head where it checks drift) and back,
asserting what became of the rows. tests/store/test_migrations.py runs each on PostgreSQL and SQLite."""
