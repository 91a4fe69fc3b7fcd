"""The Python grader's sandbox limits as settings (store.settings, worker.grading): their defaults are
SandboxLimits' own, each ``ZENFLOW_PYTHON_GRADER_*`` variable reaches the limits a call runs under, and a
value out of bounds is refused at start."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from store.settings import Settings
from trainer.graders.sandbox import SandboxLimits
from worker.grading import sandbox_limits


def test_the_settings_defaults_are_the_sandbox_defaults() -> None:
    assert sandbox_limits(Settings(_env_file=None)) == SandboxLimits()  # type: ignore[call-arg]


def test_each_environment_variable_reaches_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "ZENFLOW_PYTHON_GRADER_CPU_SECONDS": "2.5",
        "ZENFLOW_PYTHON_GRADER_WALL_SECONDS": "7",
        "ZENFLOW_PYTHON_GRADER_MEMORY_BYTES": str(256 * 2**20),
        "ZENFLOW_PYTHON_GRADER_MAX_PROCESSES": "4",
        "ZENFLOW_PYTHON_GRADER_ALLOW_UNISOLATED": "true",
        "ZENFLOW_PYTHON_GRADER_OUTPUT_BYTES": "4096",
        "ZENFLOW_PYTHON_GRADER_FILE_BYTES": str(2**21),
        "ZENFLOW_PYTHON_GRADER_OPEN_FILES": "48",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    limits = sandbox_limits(Settings(_env_file=None))  # type: ignore[call-arg]
    assert limits == dataclasses.replace(
        SandboxLimits(),
        cpu_seconds=2.5,
        wall_seconds=7.0,
        memory_bytes=256 * 2**20,
        max_processes=4,
        allow_unisolated=True,
        output_bytes=4096,
        file_bytes=2**21,
        open_files=48,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ZENFLOW_PYTHON_GRADER_CPU_SECONDS", "0"),
        ("ZENFLOW_PYTHON_GRADER_WALL_SECONDS", "nan"),
        ("ZENFLOW_PYTHON_GRADER_MEMORY_BYTES", str(2**20)),
        ("ZENFLOW_PYTHON_GRADER_MAX_PROCESSES", "0"),
    ],
)
def test_a_limit_out_of_bounds_is_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("ZENFLOW_").lower()):
        Settings(_env_file=None)  # type: ignore[call-arg]
