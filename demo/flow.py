"""The demo's run, step by step: the folder, team and server, then the job through the openai SDK, the
answers before and after it, and the console."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from demo.events import follow_events
from demo.folder import create_team, prepare
from demo.server import Server

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types import FileObject
    from openai.types.fine_tuning import FineTuningJob

#: The base the demo fine-tunes (trainer.samples.demo_base: pretrained on English, no geography).
BASE_MODEL = "docs-llama"
#: 128 examples / batch 8 = 16 steps an epoch (192 in all); the 1.4M-parameter base: ~2 steps/s on 2 cores.
N_EPOCHS = 12
#: The base's default learning rate is 7.0e-4 (by its size, trainer.model.catalog: a house style takes
#: it, docs/api.md "Learning rate"); new facts in 12 epochs take 3e-3 on this base, so 4.3 times that.
LR_MULTIPLIER = 4.3
#: Asked before and after fine-tuning, with the system prompt of the training file's examples that have
#: one. The first two are training examples word for word (system prompt included): the fine-tuned model
#: must answer them right. The third is the validation file's wording (never trained on; the fact is, in
#: other words): it shows how far a model this small generalises, right or not. Without the system
#: prompt even a trained question is off the training distribution, and whether a model this small
#: still answered it depended on the CPU's float rounding (right on the boxes CI had run on, wrong on an
#: AVX2 Zen 3, seed and data the same).
SYSTEM_PROMPT = "You are a concise geography assistant."
QUESTIONS = ("What is the capital of France?", "Capital of Japan?", "Name the capital of Japan.")


@dataclass(frozen=True)
class Question:
    """A demo question, whether the training file asks it word for word, and the data's answer to it."""

    text: str
    seen: bool
    expected: str

    @property
    def label(self) -> str:
        return (
            "[in the training data]"
            if self.seen
            else "[not in the training data: the validation file's wording]"
        )

    def verdict(self, answer: str) -> str:
        return "right" if self.expected in answer else f"wrong: the data says {self.expected!r}"


def demo_questions(train: Path, valid: Path) -> list[Question]:
    """:data:`QUESTIONS` marked from the data files: seen when a training example asks it with
    :data:`SYSTEM_PROMPT`, word for word; the expected answer is that example's (or the validation
    file's)."""
    trained = _answers(train)
    answers = {user: a for (_, user), a in (_answers(valid) | trained).items()}
    return [
        Question(q, (SYSTEM_PROMPT, q) in trained, trained.get((SYSTEM_PROMPT, q)) or answers[q])
        for q in QUESTIONS
    ]


def _answers(path: Path) -> dict[tuple[str | None, str], str]:
    """(system prompt or None, user message) -> the assistant's answer, for each example of ``path``."""
    out: dict[tuple[str | None, str], str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        turns = {m["role"]: m["content"] for m in json.loads(line)["messages"]}
        out[(turns.get("system"), turns["user"])] = turns["assistant"]
    return out


def run(data_dir: Path, *, timeout: float, fresh: bool, stay: bool) -> int:
    """The whole demo (see :mod:`demo`); 0 when every step succeeded."""
    from openai import OpenAI

    t0 = time.monotonic()
    env = prepare(data_dir, fresh=fresh)
    print(f"==> ZenFlow demo (data folder {data_dir}: ZENFLOW_DATA_DIR, as for every zenflow command)")
    team, key = create_team(env)
    server = Server(env, data_dir)
    ok = False
    signal.signal(signal.SIGHUP, _hang_up)  # its terminal closed: stop the server as Ctrl-C does
    try:
        server.wait_ready(timeout=120)
        print(f"==> zenflow serve is ready on {server.base} (log: {server.log_path})")
        client = OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=3)
        if not fine_tune_and_compare(client, server.base, key, team, timeout=timeout):
            return 1
        ok = True
        print(f"==> demo finished in {time.monotonic() - t0:.0f} s")
        offer_console(server, key, stay=stay)
        return 0
    except Exception as exc:
        print(f"demo failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        if not ok:
            server.print_log_tail()


def _hang_up(_sig: int, _frame: object) -> None:
    raise SystemExit(128 + signal.SIGHUP)  # past the except below, through its finally: server.stop()


def fine_tune_and_compare(client: OpenAI, base: str, key: str, team: str, *, timeout: float) -> bool:
    """Upload, ask the base, fine-tune it, show what the job left and ask the result the same questions;
    False when the job did not succeed."""
    train, valid = upload_files(client)
    before = ask_base_model(client)
    job = create_job(client, train, valid, team)
    print(f"==> created {job.id} on {job.model} (status {job.status}); following its events:")
    follow_events(base, key, job.id, timeout=timeout)
    job = client.fine_tuning.jobs.retrieve(job.id)
    print(
        f"==> {job.id} {job.status}; fine_tuned_model={job.fine_tuned_model} "
        f"trained_tokens={job.trained_tokens}"
    )
    if job.status != "succeeded":
        print(f"job did not succeed: {job.error}", file=sys.stderr)
        return False
    show_results(client, job)
    model = job.fine_tuned_model
    if not model:
        raise RuntimeError("the job succeeded without a fine_tuned_model")
    print(
        f"==> download it: curl -H 'Authorization: Bearer <key>' -o model.tar '{base}/v1/models/{model}/content'"
    )
    compare_answers(client, model, before)
    return True


def upload_files(client: OpenAI) -> tuple[FileObject, FileObject]:
    """The sample training and validation files, uploaded for fine-tuning."""
    from trainer.samples import TRAIN_FILE, VALID_FILE

    with TRAIN_FILE.open("rb") as fh:
        train = client.files.create(file=(TRAIN_FILE.name, fh), purpose="fine-tune")
    with VALID_FILE.open("rb") as fh:
        valid = client.files.create(file=(VALID_FILE.name, fh), purpose="fine-tune")
    print(f"uploaded {train.filename} -> {train.id} ({train.bytes} bytes), {valid.filename} -> {valid.id}")
    return train, valid


def ask_base_model(client: OpenAI) -> list[str]:
    """The base model's answers to the demo's questions, printed."""
    print(f"==> asking the base model {BASE_MODEL} before fine-tuning")
    before = [chat(client, BASE_MODEL, q.text) for q in _questions()]
    for q, a in zip(_questions(), before, strict=True):
        print(f"  user:  {q.text}  {q.label}\n  base:  {a}")
    return before


def _questions() -> list[Question]:
    from trainer.samples import TRAIN_FILE, VALID_FILE

    return demo_questions(TRAIN_FILE, VALID_FILE)


def create_job(client: OpenAI, train: FileObject, valid: FileObject, team: str) -> FineTuningJob:
    """The fine-tuning job on the base (idempotent per team)."""
    from trainer.samples import SPEC_FILE

    return client.fine_tuning.jobs.create(
        model=BASE_MODEL,
        training_file=train.id,
        validation_file=valid.id,
        suffix="capitals",
        seed=0,
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": N_EPOCHS,
                    "batch_size": 8,
                    "learning_rate_multiplier": LR_MULTIPLIER,
                }
            },
        },
        # The sample spec's ZenFlow settings (see its comments), made for short jobs on small models:
        # the first epoch synchronous, then the top quarter of columns reselected every step.
        extra_body={"engine": yaml.safe_load(SPEC_FILE.read_text())["engine"]},
        extra_headers={"Idempotency-Key": f"demo-{team}"},
    )


def show_results(client: OpenAI, job: FineTuningJob) -> None:
    """The job's checkpoints, its step metrics in short and its result files."""
    for c in client.fine_tuning.jobs.checkpoints.list(job.id).data:
        print(
            f"  checkpoint step {c.step_number}: {c.fine_tuned_model_checkpoint} "
            f"train_loss={c.metrics.train_loss} valid_loss={c.metrics.valid_loss}"
        )
    metrics = client.get(f"/fine_tuning/jobs/{job.id}/metrics", cast_to=dict)["data"]
    if metrics:
        stall = sum(m["stall_fraction"] for m in metrics) / len(metrics)
        print(
            f"  {len(metrics)} steps recorded; loss {metrics[0]['train_loss']:.3f} -> "
            f"{metrics[-1]['train_loss']:.3f}; mean stall fraction {stall:.3f}"
        )
    for file_id in job.result_files or []:  # the metrics CSV, fetched as with OpenAI
        csv_text = client.files.content(file_id).text
        print(
            f"  result file {file_id}: {len(csv_text.splitlines()) - 1} rows, columns "
            f"{csv_text.splitlines()[0] if csv_text else ''}"
        )


def compare_answers(client: OpenAI, model: str, before: list[str]) -> None:
    """The fine-tuned model asked the same questions, each answer printed beside the base's and judged
    against the data's answer; then how many of the questions it was trained on it answered right."""
    print(f"==> chatting with {model} (client.chat.completions.create, stream=True)")
    right = 0
    questions = _questions()
    for q, a in zip(questions, before, strict=True):
        after = chat(client, model, q.text)
        right += q.seen and q.verdict(after) == "right"
        print(
            f"  user:  {q.text}  {q.label}\n  before fine-tuning: {a}\n  after fine-tuning:  {after}  "
            f"({q.verdict(after)})"
        )
    seen = sum(q.seen for q in questions)
    print(f"==> {right} of the {seen} questions in the training data answered right")


def chat(client: OpenAI, model: str, question: str) -> str:
    """Ask ``model`` one question through the chat completions endpoint, streamed; the answer."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        max_tokens=48,  # byte-level tokens: one per character
        temperature=0,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def offer_console(server: Server, key: str, *, stay: bool) -> None:
    """The console's URL; with ``stay``, the server kept up for it until Ctrl-C."""
    if stay:
        print(f"==> console: {server.base}/console/ (paste the key {key}); serving until Ctrl-C")
        server.wait_for_interrupt()
    else:
        print(
            f"==> console: {server.base}/console/ (stops with this demo; `python -m demo --stay` keeps "
            "serving it; `zenflow serve` serves it too)"
        )
