"""A succeeded job's result file: its per-step metrics as CSV, a ``fine-tune-results`` file of its team.

The OpenAI shape lists it in the job's ``result_files``, so clients fetch it as they do there
(``client.files.content(job.result_files[0])``). The columns start with OpenAI's ``step``,
``train_loss``, ``valid_loss``; ours follow (learning rate, throughput, step and stall seconds, GPU
utilization, CPU optimizer seconds, bytes each way), then a reinforcement job's rewards
(``REWARD_COLUMNS``). The CSV is written next to uploads
(``files_dir/<team>/<file id>.csv``, through a temp file and a rename) and its row is added to the
caller's session, so it lands in the same transaction as the job's end state; a transaction that
fails leaves at most an unreferenced file on disk, never a row without its bytes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.ids import new_id
from store.orm import File, FineTuningJob, JobStepMetric

RESULTS_PURPOSE = "fine-tune-results"
RESULTS_FILENAME = "step_metrics.csv"
COLUMNS = (
    "step",
    "train_loss",
    "valid_loss",
    "lr",
    "tokens_per_second",
    "step_seconds",
    "stall_seconds",
    "stall_fraction",
    "gpu_utilization",
    "cpu_optimizer_seconds",
    "bytes_device_to_host",
    "bytes_host_to_device",
)


def _cell(v: object) -> object:
    return "" if v is None else v


#: A reinforcement job's columns after those (OpenAI's RFT names): the step's figures from the row's
#: ``method_metrics``, then the validation reward (the negative of ``valid_loss``, which is what the
#: method minimises), then one ``train_sub_reward/<grader>`` column per sub-reward of a multi grader.
REWARD_COLUMNS = {
    "train_mean_reward": "reward_mean",
    "train_min_reward": "reward_min",
    "train_max_reward": "reward_max",
    "train_completion_tokens_mean": "completion_tokens_mean",
    "train_truncated_fraction": "truncated_fraction",
    "train_grader_errors": "grader_errors",
    "train_generation_seconds": "generation_seconds",
    "train_grading_seconds": "grading_seconds",
}
VALID_REWARD_COLUMN = "valid_mean_reward"
SUB_REWARD_PREFIX = "train_sub_reward/"


def metrics_csv(session: Session, job_id: str) -> tuple[bytes, int]:
    """The job's step metrics as CSV bytes (oldest step first) and the number of rows; a reinforcement
    job's (any step with rewards) has the reward columns too."""
    rows = list(
        session.scalars(
            select(JobStepMetric).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
        )
    )
    rewarded = any((r.method_metrics or {}).get("reward_mean") is not None for r in rows)
    subs = sorted({k for r in rows for k in (r.method_metrics or {}).get("sub_rewards") or {}})
    header = [*COLUMNS]
    if rewarded:
        header += [*REWARD_COLUMNS, VALID_REWARD_COLUMN, *(SUB_REWARD_PREFIX + k for k in subs)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for r in rows:
        cells = [_cell(getattr(r, c)) for c in COLUMNS]
        if rewarded:
            cells += _reward_cells(r, subs)
        w.writerow(cells)
    return buf.getvalue().encode(), len(rows)


def _reward_cells(r: JobStepMetric, subs: list[str]) -> list[object]:
    figures = r.method_metrics or {}
    sub_rewards = figures.get("sub_rewards") or {}
    valid = -r.valid_loss if r.valid_loss is not None else None
    return [
        *(_cell(figures.get(k)) for k in REWARD_COLUMNS.values()),
        _cell(valid),
        *(_cell(sub_rewards.get(k)) for k in subs),
    ]


def add_results_file(session: Session, job: FineTuningJob, files_dir: Path) -> File:
    """Write the job's metrics CSV under ``files_dir`` and add its File row; sets ``job.result_files``."""
    data, n = metrics_csv(session, job.id)
    file_id = new_id("file")
    final = Path(files_dir) / job.team_id / f"{file_id}.csv"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_suffix(".csv.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    row = File(
        id=file_id,
        team_id=job.team_id,
        filename=RESULTS_FILENAME,
        purpose=RESULTS_PURPOSE,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        storage_path=str(final),
        num_examples=n,
        status="processed",
    )
    session.add(row)
    job.result_files = [*(job.result_files or []), file_id]
    return row
