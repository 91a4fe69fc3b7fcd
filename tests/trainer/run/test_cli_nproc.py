"""``zenflow train SPEC --nproc N``: the job as N local data-parallel ranks (gloo CPU ranks here), started
and supervised by the command itself; rank 0 prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.samples import TRAIN_FILE

ROOT = Path(__file__).resolve().parents[3]


def _spec(tmp_path: Path, *, device: str = "cpu", gpus: int | None = None) -> Path:
    body: dict[str, object] = {
        "model": "tiny-llama",
        "training_file": str(TRAIN_FILE),
        "device": device,
        "hyperparameters": {
            "n_epochs": 1,
            "batch_size": 8,
            "max_steps": 4,
            "max_seq_length": 128,
            "checkpoint_every": 2,
        },
        "engine": {"mode": "zenflow", "update_interval": 2, "select_interval": 4},
    }
    if gpus is not None:
        body["resources"] = {"gpus": gpus}
    p = tmp_path / "job.yaml"
    p.write_text(json.dumps(body))
    return p


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "trainer", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.services  # job processes
def test_spec_resources_gpus_is_the_default_nproc_and_rank_zero_prints(tmp_path: Path) -> None:
    """``resources.gpus: 2`` without --nproc launches two ranks, and one of them prints; ``--nproc 1``
    overrides it."""
    spec = _spec(tmp_path, gpus=2)
    out = tmp_path / "two"
    proc = _train(str(spec), "--output-dir", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [str(out / "final")]  # one rank printed the result
    assert proc.stderr.count("done: 4 steps") == 1 and proc.stderr.count("Training 4 steps") == 1, proc.stderr
    ckpt = out / "checkpoint-000004"
    assert sorted(p.name for p in ckpt.glob("engine-rank*")) == [
        "engine-rank00000-of-00002.pt",
        "engine-rank00000-of-00002.safetensors",
        "engine-rank00001-of-00002.pt",
        "engine-rank00001-of-00002.safetensors",
    ]  # both ranks trained (each shard: its skeleton and its streamed tensors)
    assert (out / "final" / "model.safetensors").is_file()
    one = _train(str(spec), "--output-dir", str(tmp_path / "one"), "--nproc", "1", "--json", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    steps = [
        e
        for e in map(json.loads, (ln for ln in one.stdout.splitlines() if ln.startswith("{")))
        if e["type"] == "step"
    ]
    assert len(steps) == 4 and {(s["engine"]["rank"], s["engine"]["world_size"]) for s in steps} == {(0, 1)}
    assert not list((tmp_path / "one" / "checkpoint-000004").glob("engine-rank*-of-00002*"))


def test_nproc_refuses_more_gpus_than_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any rank starts (in this process: nothing is launched)."""
    from trainer.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["train", str(_spec(tmp_path, device="cuda")), "--nproc", "2"]) == 2
    assert "--nproc 2 needs 2 GPUs, 0 visible" in capsys.readouterr().err
    assert main(["train", str(_spec(tmp_path)), "--nproc", "0"]) == 2
    assert "gpus" in capsys.readouterr().err
