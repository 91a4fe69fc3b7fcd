"""scripts/bootstrap.sh (issue 27 item 6), run in a scratch copy with a stand-in ``.venv/bin/python``:
one line per stage with its seconds, pip's output in the log and not on the terminal, nothing at all
once done, and a failing stage's log tail shown; the tools only the tests use installed only for the test
targets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "${ZENFLOW_CPU_ADAM_BUILD:+[build=$ZENFLOW_CPU_ADAM_BUILD] }$*" >> "$(dirname "$0")/../calls"
if [ "${FAIL_ON:-}" != "" ] && [[ "$*" == *"$FAIL_ON"* ]]; then
  echo "ERROR: no matching distribution for $FAIL_ON"; exit 1
fi
echo "WARNING: Location 'file:///opt/x/simple/pip/' is ignored: noise pip prints"
"""


def _scratch(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("bootstrap.sh", "wordnet_layout.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "offload" / "csrc").mkdir(parents=True)
    (repo / "offload" / "cpu_adam_build.py").write_text("# stand-in\n")
    (repo / "offload" / "csrc" / "cpu_adam.cpp").write_text("// stand-in\n")
    py = repo / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "id").write_text("#!/bin/sh\necho 1000\n")  # not root: no apt-get stage here
    (fake_bin / "id").chmod(0o755)
    return repo


def _run(repo: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    full = {**os.environ, "PATH": f"{repo.parent / 'bin'}:{os.environ['PATH']}", **env}
    t = time.monotonic()
    done = subprocess.run(
        ["bash", "scripts/bootstrap.sh"], cwd=repo, env=full, capture_output=True, text=True, timeout=60
    )
    return done, time.monotonic() - t


def test_quiet_stages_then_nothing_when_done(tmp_path: Path) -> None:
    repo = _scratch(tmp_path)
    first, _ = _run(repo)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.strip().splitlines()
    stage = re.compile(r"bootstrap: .+ +\d+\.\d s")
    assert all(stage.fullmatch(line.split(" (log:")[0]) for line in lines), lines
    names = " | ".join(lines)
    for what in ("pip, setuptools, wheel", "torch==", "pip install -e .[dev]", "C++ CPU optimizer"):
        assert what in names, names
    assert "WARNING" not in first.stdout + first.stderr  # pip's noise is in the log only
    log = (repo / ".venv" / "bootstrap.log").read_text()
    assert "noise pip prints" in log
    calls = (repo / ".venv" / "calls").read_text().splitlines()
    assert len(calls) == 4 and "-q" in calls[0] and "ninja" in calls[0]
    # the package install builds the C++ optimizer against the venv's torch (setup.py), then the build
    # step finds it up to date
    assert calls[2].startswith("[build=require] ") and "--no-build-isolation -e .[dev]" in calls[2]
    assert calls[3] == "-m offload.cpu_adam_build"

    again, seconds = _run(repo)
    assert again.returncode == 0 and again.stdout == again.stderr == "", again.stderr
    assert seconds < 5 and len((repo / ".venv" / "calls").read_text().splitlines()) == 4

    (repo / "offload" / "csrc" / "cpu_adam.cpp").write_text("// changed\n")  # only the build again
    third, _ = _run(repo)
    assert "C++ CPU optimizer" in third.stderr and "torch" not in third.stderr


def test_a_failing_stage_shows_the_log_tail(tmp_path: Path) -> None:
    repo = _scratch(tmp_path)
    done, _ = _run(repo, FAIL_ON="torch==")
    assert done.returncode == 1
    assert "FAILED" in done.stderr and "no matching distribution for torch==" in done.stderr
    assert not (repo / ".venv" / ".zenflow-bootstrap").exists()  # tried again next time


def test_only_the_test_targets_install_the_tools_the_tests_use() -> None:
    """`make run` (and lint) bootstrap without the Debian tools only the tests use (prometheus, nginx,
    chromium); `make test`, `test-fast` and `test-floor` ask for them (``--test-tools``)."""

    def commands(target: str) -> list[str]:
        out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True)
        return [line for line in out.stdout.splitlines() if "scripts/bootstrap.sh" in line]

    for target in ("run", "lint"):
        assert commands(target) == ["bash scripts/bootstrap.sh"], target
    for target in ("test", "test-fast", "test-floor"):
        assert commands(target) == ["bash scripts/bootstrap.sh --test-tools"], target
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    for tool in ("prometheus (apt-get)", "nginx (apt-get)", "chromium (apt-get)"):
        gate = script[: script.index(f'optional "{tool}"')].rsplit("\nif ", 1)[1]
        assert gate.startswith('[ "$test_tools" = 1 ]'), (tool, gate)
