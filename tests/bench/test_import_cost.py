"""bench.import_cost measures both ways in fresh interpreters (no speed asserted: only that each way
ran and was measured)."""

from __future__ import annotations

import json

import pytest

from bench import import_cost


def test_both_ways_are_measured_in_fresh_interpreters(capsys: pytest.CaptureFixture[str]) -> None:
    r = import_cost.measure(1, modules=("email.mime.text", "xml.dom.minidom"))
    assert r.runs == 1 and r.modules == ["email.mime.text", "xml.dom.minidom"]
    assert r.source_cpu_s >= 0 and r.cached_cpu_s >= 0 and r.source_wall_s > 0 and r.cached_wall_s > 0
    assert import_cost.main(["--runs", "1", "--json", "--modules", "email.mime.text"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"source_cpu_s", "cached_cpu_s", "cpu_ratio"} <= set(out) and out["modules"]
