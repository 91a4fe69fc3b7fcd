"""``make run``: the whole service on embedded defaults, end to end, in a few minutes on a laptop.

1. creates a team and an API key with the CLI, in the data folder every ``zenflow`` command uses
   (``ZENFLOW_DATA_DIR``, default ./var; the other ``ZENFLOW_*`` settings are kept too), so keys made
   with ``zenflow keys create`` work against ``--stay``'s server;
2. starts ``zenflow serve`` (API + in-process Celery worker on kombu's SQLAlchemy transport) on a free
   loopback port;
3. with the official openai SDK: uploads the sample dataset, asks the base model (``docs-llama``, a small
   Llama pretrained on English docstrings, shipped in trainer/samples/models: trainer.samples.demo_base)
   the demo's questions, and creates a job on it;
4. follows the job's server-sent event stream to the end, printing each event;
5. lists the checkpoints and the metrics, and how to download the model;
6. asks the fine-tuned model the same questions through the openai SDK (``chat.completions.create``,
   streamed), printing each answer before and after fine-tuning, and
   prints the console's URL; on a terminal it keeps serving until Ctrl-C so the console can be opened.

Exits non-zero when any step fails (the server's log tail is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer.run.launch import free_port

if TYPE_CHECKING:
    from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
#: The base the demo fine-tunes (trainer.samples.demo_base: pretrained on English, no geography).
BASE_MODEL = "docs-llama"
#: 128 examples / batch 8 = 16 steps an epoch (192 in all); the 1.4M-parameter base: ~2 steps/s on 2 cores.
N_EPOCHS = 12
#: Base learning rate of a local base is 1e-5 (trainer.model.catalog); this small one learns at 3e-3.
LR_MULTIPLIER = 300.0
#: Asked before and after fine-tuning: the first as in the training file less its system prompt, the
#: second in the validation file's wording (never trained on).
QUESTIONS = ("What is the capital of France?", "Name the capital of Japan.")


def data_folder(data_dir: Path | None = None) -> Path:
    """The demo's data folder by the rule of every ``zenflow`` command (:class:`store.settings.Settings`:
    ``ZENFLOW_DATA_DIR`` or ``.env``, default ``var``), or ``--data-dir``; absolute."""
    from store.settings import Settings

    return (data_dir if data_dir is not None else Settings().data_dir).resolve()


def _env(data_dir: Path) -> dict[str, str]:
    """Our environment, ``ZENFLOW_*`` included, with the data folder made absolute (the CLI and the
    server run from the repository root)."""
    env = dict(os.environ)
    env["ZENFLOW_DATA_DIR"] = str(data_dir)
    env["ZENFLOW_MODEL_ROOTS"] = _with_demo_root(env.get("ZENFLOW_MODEL_ROOTS", ""))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _with_demo_root(roots: str) -> str:
    """``ZENFLOW_MODEL_ROOTS`` (``:``-separated or a JSON list) with the demo base's root added."""
    from trainer.samples import MODELS_DIR

    if roots.strip().startswith("["):
        return json.dumps([*json.loads(roots), str(MODELS_DIR)])
    return ":".join([*filter(None, roots.split(":")), str(MODELS_DIR)])


def _cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "api.cli.main", *args],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zenflow serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("zenflow serve did not become ready")


def _follow_events(base: str, key: str, job_id: str, timeout: float) -> None:
    """Print the job's events from its SSE stream until it ends (reconnecting with Last-Event-ID)."""
    import httpx

    last: str | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
        if last:
            headers["Last-Event-ID"] = last
        try:
            with httpx.stream(
                "GET",
                f"{base}/v1/fine_tuning/jobs/{job_id}/events",
                headers=headers,
                timeout=httpx.Timeout(10, read=60),
            ) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        last = line[4:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        if data == "[DONE]":
                            return
                        ev = json.loads(data)
                        _print_event(ev)
        except httpx.HTTPError as exc:
            print(f"  (event stream interrupted: {exc}; reconnecting)")
            time.sleep(1)
    raise RuntimeError("the job did not finish in time")


def _print_event(ev: dict[str, Any]) -> None:
    """One line per event; per-step metrics events only every 16th step (the rest are in /metrics)."""
    raw = ev.get("data")
    data: dict[str, Any] = raw if isinstance(raw, dict) else {}
    step = data.get("step")
    if (
        ev.get("type") == "metrics"
        and isinstance(step, int)
        and step % 16
        and step not in (1, data.get("total_steps"))
    ):
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(ev["created_at"]))
    msg = ev["message"]
    if ev.get("type") == "metrics" and isinstance(data.get("stall_fraction"), int | float):
        msg = f"{msg} (stall {data['stall_fraction']:.1%})"
    print(f"  {stamp} {ev['level']:5s} {msg}")


def _chat(client: OpenAI, model: str, question: str) -> str:
    """Ask ``model`` one question through the chat completions endpoint, streamed; the answer."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=48,  # byte-level tokens: one per character
        temperature=0,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def run(data_dir: Path, *, timeout: float, fresh: bool, stay: bool) -> int:
    from openai import OpenAI

    from trainer.samples import SPEC_FILE, TRAIN_FILE, VALID_FILE

    t0 = time.monotonic()
    if data_dir.exists() and fresh:
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    env = _env(data_dir)
    print(f"==> ZenFlow demo (data folder {data_dir}: ZENFLOW_DATA_DIR, as for every zenflow command)")

    team = f"demo-{int(time.time())}"
    print(_cli(env, "teams", "create", team))
    key = _cli(env, "keys", "create", "--team", team, "--name", "demo", "-q").splitlines()[-1]
    print(f"API key created for {team}: {key[:11]}... (shown once)")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = data_dir / "serve.log"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ok = False
    try:
        _wait_ready(base, proc, timeout=120)
        print(f"==> zenflow serve is ready on {base} (log: {log_path})")
        client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=3)

        with TRAIN_FILE.open("rb") as fh:
            train = client.files.create(file=(TRAIN_FILE.name, fh), purpose="fine-tune")
        with VALID_FILE.open("rb") as fh:
            valid = client.files.create(file=(VALID_FILE.name, fh), purpose="fine-tune")
        print(
            f"uploaded {train.filename} -> {train.id} ({train.bytes} bytes), {valid.filename} -> {valid.id}"
        )

        print(f"==> asking the base model {BASE_MODEL} before fine-tuning")
        before = [_chat(client, BASE_MODEL, q) for q in QUESTIONS]
        for q, a in zip(QUESTIONS, before, strict=True):
            print(f"  user:  {q}\n  base:  {a}")

        job = client.fine_tuning.jobs.create(
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
        print(f"==> created {job.id} on {job.model} (status {job.status}); following its events:")
        _follow_events(base, key, job.id, timeout=timeout)

        job = client.fine_tuning.jobs.retrieve(job.id)
        print(
            f"==> {job.id} {job.status}; fine_tuned_model={job.fine_tuned_model} "
            f"trained_tokens={job.trained_tokens}"
        )
        if job.status != "succeeded":
            print(f"job did not succeed: {job.error}", file=sys.stderr)
            return 1
        ckpts = client.fine_tuning.jobs.checkpoints.list(job.id).data
        for c in ckpts:
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
        model = job.fine_tuned_model
        if not model:
            raise RuntimeError("the job succeeded without a fine_tuned_model")
        print(
            f"==> download it: curl -H 'Authorization: Bearer <key>' -o model.tar '{base}/v1/models/{model}/content'"
        )
        print(f"==> chatting with {model} (client.chat.completions.create, stream=True)")
        for q, a in zip(QUESTIONS, before, strict=True):
            print(f"  user:  {q}\n  before fine-tuning: {a}\n  after fine-tuning:  {_chat(client, model, q)}")
        ok = True
        print(f"==> demo finished in {time.monotonic() - t0:.0f} s")
        if stay:
            print(f"==> console: {base}/console/ (paste the key {key}); serving until Ctrl-C")
            _wait_for_interrupt(proc)
        else:
            print(
                f"==> console: {base}/console/ (stops with this demo; `python -m api.demo --stay` keeps "
                "serving it; `zenflow serve` serves it too)"
            )
        return 0
    except Exception as exc:
        print(f"demo failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(proc)
        log_file.close()
        if not ok:
            tail = log_path.read_text(errors="replace").splitlines()[-40:]
            print("---- zenflow serve log (tail) ----", *tail, sep="\n", file=sys.stderr)


def _wait_for_interrupt(proc: subprocess.Popen[bytes]) -> None:
    """Keep the server up (for the console) until Ctrl-C or until it exits by itself."""
    try:
        while proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="default: ZENFLOW_DATA_DIR (./var), as for every zenflow command",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the job")
    p.add_argument(
        "--fresh", action="store_true", help="delete the data folder first (its teams, keys, jobs)"
    )
    p.add_argument(
        "--keep", action="store_true", help=argparse.SUPPRESS
    )  # the default now; old scripts pass it
    p.add_argument(
        "--stay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep serving after the demo, for the console (default: when stdin is a terminal)",
    )
    args = p.parse_args(argv)
    stay = sys.stdin.isatty() if args.stay is None else args.stay
    return run(data_folder(args.data_dir), timeout=args.timeout, fresh=args.fresh, stay=stay)


if __name__ == "__main__":
    sys.exit(main())
