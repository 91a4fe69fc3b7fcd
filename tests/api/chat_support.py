"""Helpers of the inference tests: a tiny model folder in a job's ``final/`` layout, registered as a
team's ``ft:`` model, and reading the API's Prometheus samples."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from fastapi import FastAPI

from tests.api.conftest import TeamKey


def write_model_folder(folder: Path, seed: int, *, adapter: bool = False) -> Path:
    """tiny-llama from ``seed`` saved like a job's ``final/`` (safetensors, config, byte tokenizer with
    its chat template); with ``adapter`` also an ``adapter/`` folder, as a LoRA run leaves."""
    import torch

    from trainer.model.catalog import load_model, load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    model = load_model("tiny-llama", dtype=torch.float32, seed=seed)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    if adapter:
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    return folder


def register_fine_tuned(app: FastAPI, team: TeamKey, folder: Path, suffix: str = "chat") -> str:
    """A succeeded job of ``team`` whose final model is ``folder``; its ``ft:`` id."""
    from store.model_ids import register_final
    from store.orm import File, FineTuningJob, JobStatus

    with app.state.sessionmaker() as s:
        f = File(
            team_id=team.id,
            filename="train.jsonl",
            purpose="fine-tune",
            bytes=1,
            sha256="0" * 64,
            storage_path=str(folder / "unused.jsonl"),
        )
        s.add(f)
        s.flush()
        job = FineTuningJob(
            team_id=team.id,
            model="tiny-llama",
            training_file_id=f.id,
            suffix=suffix,
            status=JobStatus.succeeded.value,
            seed=secrets.randbelow(1000),
        )
        s.add(job)
        s.flush()
        model_id = register_final(s, job, str(folder)).id
        s.commit()
    return model_id


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0
