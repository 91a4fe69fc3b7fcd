"""``zenflow quotas``' figures (the command end to end: tests/api/test_quotas.py)."""

from __future__ import annotations

import pytest

from api.cli.quotas import _shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.0, "0.00"),
        (0.004, "0.004"),  # a short CPU job: was "0.00"
        (0.0123, "0.012"),
        (0.00004, "0.00004"),
        (0.5, "0.5"),
        (1.0, "1.00"),
        (1234.567, "1,234.57"),
        (None, "unlimited"),
    ],
)
def test_gpu_hours_keep_two_significant_digits_below_an_hour(value: float | None, shown: str) -> None:
    assert _shown("gpu_hours", value) == shown
