"""bench/rollout.py on tiny sizes: one row per setting, the shares and ratios consistent with the
seconds they come from (no speed asserted)."""

from __future__ import annotations

import json

import pytest

from bench import rollout as bench

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_rows_per_setting_and_the_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "1", "--batch", "2", "--samples", "2,3", "--max-tokens", "4", "--json"]
    rows = bench.main(argv)
    printed = json.loads(capsys.readouterr().out)
    assert [(r["samples_per_prompt"], r["max_completion_tokens"]) for r in printed["rows"]] == [
        (2, 4),
        (3, 4),
    ]
    for r in rows:
        assert 0 < r.tokens_per_step <= 2 * r.samples_per_prompt * 4
        assert r.rollout_tok_s > 0 and r.forward_tok_s > 0
        assert r.gen_over_forward == pytest.approx(r.forward_tok_s / r.rollout_tok_s)
        assert 0 < r.generate_share < 1 and 0 <= r.grade_share < 1 and 0 < r.train_share < 1
        assert r.generate_share + r.grade_share + r.train_share <= 1 + 1e-9
        assert 0 <= r.reward_mean <= 1


def test_the_table_prints_a_row_per_setting(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--steps", "1", "--batch", "1", "--samples", "2", "--max-tokens", "3,5"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("docs-llama on keyword_rl_train.jsonl")
    body = [line.split() for line in out[2:]]
    assert [(b[0], b[1]) for b in body] == [("2", "3"), ("2", "5")]
    assert all(b[5].endswith("x") for b in body)
