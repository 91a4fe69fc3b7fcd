"""``zenflow train SPEC.yaml`` / ``python -m trainer train``: one job locally, no server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.samples import TRAIN_FILE

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _spec(tmp_path: Path, **hp: object) -> Path:
    hyper = {"n_epochs": 1, "batch_size": 32, "max_seq_length": 128, "checkpoint_every": 2, **hp}
    p = tmp_path / "job.yaml"
    p.write_text(
        json.dumps(
            {
                "model": "tiny-llama",
                "training_file": str(TRAIN_FILE),
                "hyperparameters": hyper,
                "engine": {"mode": "device"},
                "device": "cpu",
            }
        )
    )
    return p


@pytest.mark.services  # a job process
def test_python_m_trainer_train(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "train", str(spec), "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    final = Path(proc.stdout.strip().splitlines()[-1])
    assert final == tmp_path / "out" / "final" and (final / "model.safetensors").is_file()
    assert "done: 4 steps" in proc.stderr and "checkpoint saved" in proc.stderr


def test_cli_in_process_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, max_steps=2)
    assert main(["train", str(spec), "--output-dir", str(tmp_path / "o"), "--json", "--no-resume"]) == 0
    events = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2] and events[-1][
        "type"
    ] == "run_finished"

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt-17\ntraining_file: x.jsonl\n")
    assert main(["train", str(bad)]) == 2
    assert "unknown model 'gpt-17'" in capsys.readouterr().err

    data = tmp_path / "empty.jsonl"
    data.write_text("")
    (tmp_path / "e.yaml").write_text(f"model: tiny-llama\ntraining_file: {data}\n")
    assert main(["train", str(tmp_path / "e.yaml"), "--output-dir", str(tmp_path / "e")]) == 2  # bad data
    assert "empty file: no examples" in capsys.readouterr().err


def test_exit_codes_bad_input_2_internal_error_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input (a model folder without a tokenizer, max_seq_length over GPT-2's n_positions) exits 2
    with the API's message and no traceback; weights that pass the header check but do not load are an
    internal error: exit 1 with the traceback."""
    from tests.model_folders import write_model_folder

    def train(model: Path, **hp: object) -> tuple[int, str]:
        p = tmp_path / f"{model.name}.yaml"
        p.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "training_file": str(TRAIN_FILE),
                    "device": "cpu",
                    "hyperparameters": {"max_steps": 1, "batch_size": 2, **hp},
                }
            )
        )
        rc = main(["train", str(p), "--output-dir", str(tmp_path / model.name), "--no-resume"])
        return rc, capsys.readouterr().err

    no_tok = write_model_folder(tmp_path / "no-tok", "llama", tokenizer=False)
    rc, err = train(no_tok)
    assert (
        rc == 2 and "Traceback" not in err and f"invalid model: model folder {no_tok}: no tokenizer" in err
    ), err

    gpt2 = write_model_folder(tmp_path / "gpt2", "gpt2", max_position_embeddings=64)
    rc, err = train(gpt2, max_seq_length=128)
    assert rc == 2 and "Traceback" not in err, err
    assert "hyperparameters.max_seq_length: must be at most 64, the model's maximum sequence length" in err

    garbage = write_model_folder(tmp_path / "garbage", "llama", weights=False)
    (garbage / "pytorch_model.bin").write_bytes(b"not a torch checkpoint")
    rc, err = train(garbage)
    assert rc == 1 and "Traceback" in err and "zenflow train: internal error" in err, err


def test_a_reinforcement_jobs_lines_show_its_rewards(capsys: pytest.CaptureFixture[str]) -> None:
    """``zenflow train``'s step lines of a reinforcement job show its rewards, its eval lines the validation
    reward (not the loss, which is the negative reward)."""
    from tests.trainer.rewards import reward_eval, reward_step
    from trainer.cli import _printer

    on_event = _printer(as_json=False, progress=False)
    on_event(reward_step())
    on_event(reward_eval())
    step_line, eval_line = capsys.readouterr().err.splitlines()
    assert step_line.endswith("reward 0.410 (min 0.000 max 1.000) completion tokens 12 grader errors 2"), (
        step_line
    )
    assert eval_line == "step 20: validation reward=0.440 (32 samples)"
