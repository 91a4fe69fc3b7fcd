# The two commands: `make run` (the main job on embedded defaults) and `make test` (the test suite, what CI
# runs). Both bootstrap .venv, the pinned CPU torch, the package and the C++ optimizer build, idempotently.
# `make lint` is every static check `make test` runs; `make test-fast` the inner loop; `make test-floor` the
# engine's tests on the lowest torch pyproject.toml allows (CI runs it after `make test`).
.PHONY: bootstrap bootstrap-test run test lint test-fast test-floor

# Python caches the bytecode of what it imports (in __pycache__, inside .venv and the git-ignored
# folders of the tree) unless PYTHONDONTWRITEBYTECODE is set, as some shells and images set it. Every
# job rank, worker, template and test process imports torch and transformers; without the cache each
# compiles them again from source (about twice the CPU of the import itself: bench/import_cost.py), so
# the targets here always let Python write it.
unexport PYTHONDONTWRITEBYTECODE

bootstrap:
	@bash scripts/bootstrap.sh

# and, as root, the Debian tools only the tests use (prometheus, nginx, chromium)
bootstrap-test:
	@bash scripts/bootstrap.sh --test-tools

run: bootstrap
	@.venv/bin/python -m demo

test: bootstrap-test
	@bash scripts/test.sh

lint: bootstrap
	@bash scripts/lint.sh

test-fast: bootstrap-test
	@bash scripts/test-fast.sh

test-floor: bootstrap-test
	@bash scripts/test-floor.sh
