# The two commands: `make run` (the main job on embedded defaults) and `make test` (the test suite).
# Both bootstrap .venv, the pinned CPU torch, the package and the C++ optimizer build, idempotently.
.PHONY: bootstrap run test lint bench

bootstrap:
	@bash scripts/bootstrap.sh

run: bootstrap
	@.venv/bin/python -m api.demo

test: bootstrap
	@bash scripts/test.sh

lint: bootstrap
	@.venv/bin/ruff check .
