"""``zenflow train SPEC.yaml``: run one fine-tuning job locally, without any server.

:func:`register` adds the ``train`` subcommand to an argparse subparsers object (``api.cli.main`` wires it
into the ``zenflow`` entry point; the handler is ``args.func(args) -> int``); ``python -m trainer
train SPEC.yaml`` runs it standalone. Ctrl-C once asks the loop to stop after the current step
(checkpoint, resumable by running the same command again); twice aborts.

Before training, the spec gets the API's model checks (trainer.model.folder_check: config, weights, tokenizer;
max_seq_length within the model's position limit). Exit codes: 0 done; 2 bad input (the spec, its
model or its data: one message saying what, no traceback); 1 an internal error (with its traceback);
130 stopped by Ctrl-C.

``--nproc N`` (default: the spec's ``resources.gpus``) runs the job as N data-parallel ranks on this
machine: the command starts N copies of itself under torch's elastic agent
(:class:`trainer.run.launch.NodeRanks`: one GPU each, or gloo CPU ranks without GPUs or with ``device:
cpu``), which takes them all down when one fails; a process started with the ``env://`` variables
(WORLD_SIZE > 1: by ``--nproc``, or by ``torchrun``) is one rank and launches nothing. Rank 0 prints;
the others print only their own internal errors. Ctrl-C reaches every rank. A rank killed by a signal
makes the command exit 128 + the signal number.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.events import (
    CheckpointSaved,
    EvalEvent,
    Event,
    EventCallback,
    LogEvent,
    PreferenceMetrics,
    RewardMetrics,
    RunStarted,
    StepEvent,
)

if TYPE_CHECKING:
    from trainer.run.distributed import DistContext
    from trainer.run.loop import TrainResult
    from trainer.spec import JobSpec

#: ``zenflow train``'s exit code for bad input: the spec, its model or its data (the message says what).
EXIT_BAD_INPUT = 2
#: ``zenflow train``'s exit code for an internal error (printed with its traceback).
EXIT_INTERNAL_ERROR = 1
#: Stopped by Ctrl-C (resumable by running the same command again).
EXIT_INTERRUPTED = 130


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``train`` to ``subparsers`` (from ``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "train",
        help="run one fine-tuning job locally (no server)",
        description="Run one fine-tuning job from a YAML spec (see trainer/samples/tiny-llama.yaml).",
        epilog="exit codes: 0 done, 2 bad input (spec, model or data), 1 internal error, 130 interrupted",
    )
    p.add_argument("spec", type=Path, help="job spec (YAML)")
    p.add_argument("--output-dir", type=Path, default=None, help="override the spec's output_dir")
    p.add_argument("--no-resume", action="store_true", help="start afresh, deleting earlier checkpoints")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    p.add_argument("--json", action="store_true", help="print every event as a JSON line on stdout")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="data-parallel ranks on this machine (default: the spec's resources.gpus): one per GPU, "
        "or gloo CPU ranks without GPUs",
    )
    p.set_defaults(func=cmd_train)
    return p


def _printer(as_json: bool, progress: bool) -> EventCallback:
    """The ``on_event`` callback of ``zenflow train``: JSON lines on stdout, or messages on stderr."""

    def write(msg: str) -> None:
        if progress:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def on_event(ev: Event) -> None:
        if as_json:
            print(json.dumps(ev.as_dict(), default=str), flush=True)
            return
        match ev:
            case LogEvent():
                write(ev.message)
            case RunStarted():
                write(
                    f"Training {ev.total_steps} steps from step {ev.start_step} on {ev.device} ({ev.dtype}, "
                    f"mode {ev.mode}, {ev.trainable_parameters:,}/{ev.num_parameters:,} trainable parameters)"
                )
            case StepEvent() if not progress and (ev.step % 10 == 0 or ev.step == ev.total_steps):
                write(
                    f"step {ev.step}/{ev.total_steps} loss {ev.loss:.4f} lr {ev.lr:.2e} "
                    f"{ev.tokens_per_second:.0f} tok/s stall {ev.stall_fraction:.0%}"
                    + _preference(ev.preference)
                    + _reward(ev.reward)
                )
            case EvalEvent():
                write(_eval_line(ev))
            case CheckpointSaved():
                write(f"checkpoint saved: {ev.path}")

    return on_event


def _preference(p: PreferenceMetrics | None) -> str:
    """A DPO step's or evaluation's figures for a printed line (nothing for supervised jobs)."""
    return "" if p is None else f" margin {p.reward_margin:.3f} preference accuracy {p.accuracy:.0%}"


def _reward(r: RewardMetrics | None) -> str:
    """A reinforcement step's rewards for a printed line (nothing for other methods)."""
    if r is None:
        return ""
    errors = f" grader errors {r.grader_errors}" if r.grader_errors else ""
    return (
        f" reward {r.reward_mean:.3f} (min {r.reward_min:.3f} max {r.reward_max:.3f})"
        f" completion tokens {r.completion_tokens_mean:.0f}{errors}"
    )


def _eval_line(ev: EvalEvent) -> str:
    """An evaluation's line: a reinforcement job's validation reward (its loss is the negative reward)."""
    if ev.reward is not None:
        return f"step {ev.step}: validation reward={ev.reward.reward_mean:.3f} ({ev.reward.samples} samples)"
    return f"step {ev.step}: validation loss {ev.valid_loss:.4f}" + _preference(ev.preference)


def _bad_input(e: BaseException) -> str | None:
    """The message for an error in what the user gave (spec, model, data), None for anything else."""
    from trainer.data.dataset import DatasetValidationError
    from trainer.model.catalog import UnknownModelError
    from trainer.model.folder_check import ModelFolderError
    from trainer.run.loop import ResumeMismatchError

    if isinstance(e, DatasetValidationError):
        return "\n  ".join([f"invalid data in {e.path}:", *(str(err["message"]) for err in e.errors)])
    if isinstance(e, ModelFolderError | UnknownModelError):
        return f"invalid model: {e}"
    if isinstance(e, ResumeMismatchError):
        return str(e)
    return None


def _check_spec(spec: JobSpec) -> list[str]:
    """What the API refuses at create that is about the model: its folder (config, weights, tokenizer)
    and max_seq_length over its position limit. Raises ModelFolderError."""
    from trainer.limits import model_limit_errors
    from trainer.model.catalog import check_model

    check_model(spec.model)
    return [f"{'.'.join(e.loc)}: {e.message}" for e in model_limit_errors(spec)]


def _env_world() -> int:
    """WORLD_SIZE of this process (1 when unset): > 1 means it is one rank of a launched group."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def cmd_train(args: argparse.Namespace) -> int:
    """Exit codes: 0 done; 2 bad input (the spec, its model or its data; the message says what, no
    traceback); 1 an internal error (with its traceback); 130 stopped by Ctrl-C (resumable)."""
    import warnings

    from pydantic import ValidationError

    from contract.resources import Resources
    from trainer.spec import load_spec

    def refuse(msg: str) -> int:
        print(f"zenflow train: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT

    world = _env_world()
    try:
        with warnings.catch_warnings(record=True) as caught:  # a deprecated spec key: said once, plainly
            warnings.simplefilter("always", FutureWarning)
            spec = load_spec(args.spec, output_dir=args.output_dir)
        if world == 1 or os.environ.get("RANK") == "0":
            for w in caught:
                print(f"zenflow train: warning: {w.message}", file=sys.stderr)
        problems = _check_spec(spec)
        nproc = world if world > 1 else (args.nproc if args.nproc is not None else spec.resources.gpus)
        if nproc != spec.resources.gpus:
            spec = spec.model_copy(update={"resources": Resources(gpus=nproc)})
    except (OSError, ValueError, ValidationError) as e:
        return refuse(_bad_input(e) or f"invalid spec {args.spec}: {e}")
    if problems:
        return refuse(f"invalid spec {args.spec}: " + "; ".join(problems))
    if world == 1 and nproc > 1:
        return _launch(args, spec, nproc, refuse)
    dist = None
    if world > 1:
        from trainer.run.distributed import init_from_env

        dist = init_from_env(device=spec.device)
    try:
        return _train(args, spec, dist, refuse)
    finally:
        if dist is not None:
            from trainer.run.distributed import shutdown

            shutdown(dist)


def _train(
    args: argparse.Namespace, spec: JobSpec, dist: DistContext | None, refuse: Callable[[str], int]
) -> int:
    """This process's part of the run: all of it, or one rank's (``dist``; rank 0 prints)."""
    main_rank = dist is None or dist.is_main
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    progress = progress and not args.json and main_rank
    cancel = threading.Event()
    previous = _stop_on_sigint(cancel, main_rank)
    from trainer.run.loop import run_training

    try:
        result = run_training(
            spec,
            on_event=_printer(args.json, progress) if main_rank else None,
            should_cancel=cancel.is_set,
            resume=not args.no_resume,
            progress=progress,
            dist=dist,
        )
    except KeyboardInterrupt:
        return _aborted(main_rank)
    except Exception as e:
        return _failed(e, dist, cancel, refuse)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return _finished(result) if main_rank else 0


def _stop_on_sigint(cancel: threading.Event, main_rank: bool) -> Any:
    """Ctrl-C sets ``cancel`` (the run stops after this step), a second one aborts; the previous
    handler, to restore (None off the main thread, where no handler is set)."""

    def on_sigint(_sig: int, _frame: Any) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        if main_rank:
            print("\nstopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, on_sigint)


def _aborted(main_rank: bool) -> int:
    if main_rank:
        print("aborted", file=sys.stderr)
    return EXIT_INTERRUPTED if main_rank else 0


def _failed(
    e: Exception, dist: DistContext | None, cancel: threading.Event, refuse: Callable[[str], int]
) -> int:
    """The exit code of a run that raised: bad input (said by rank 0), an abort, or an internal error."""
    main_rank = dist is None or dist.is_main
    msg = _bad_input(e)
    if msg is not None:  # every rank sees it; rank 0 says it
        return refuse(msg) if main_rank else 0
    if dist is not None and cancel.is_set():  # aborting: a peer that left first broke the collective
        return _aborted(main_rank)
    traceback.print_exc(file=sys.stderr)
    where = f" (rank {dist.rank})" if dist is not None else ""
    print(f"zenflow train: internal error{where}: {type(e).__name__}: {e}", file=sys.stderr)
    return EXIT_INTERNAL_ERROR


def _finished(result: TrainResult) -> int:
    """Rank 0's last words: where a cancelled run stopped, or the losses and the model's folder."""
    if result.cancelled:
        print(
            f"stopped at step {result.steps}/{result.total_steps}; run the same command to resume "
            f"({result.last_checkpoint})",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    vl = f", validation loss {result.valid_loss:.4f}" if result.valid_loss is not None else ""
    tl = f"{result.train_loss:.4f}" if result.train_loss is not None else "n/a"
    print(f"done: {result.steps} steps, training loss {tl}{vl}", file=sys.stderr)
    print(result.final_model_dir)
    return 0


def _visible_gpus(device: str) -> list[str]:
    """The GPUs the ranks may take: CUDA_VISIBLE_DEVICES's entries, else as many as CUDA counts (none
    for ``device: cpu``)."""
    if device == "cpu":
        return []
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _launch(args: argparse.Namespace, spec: JobSpec, nproc: int, refuse: Callable[[str], int]) -> int:
    """Run the job as ``nproc`` ranks of this same command (one GPU each, or CPU ranks) under torch's
    elastic agent (:class:`trainer.run.launch.NodeRanks`); the first failing rank's code (a signal: 128 +
    its number)."""
    import uuid

    from trainer.run.launch import NodeRanks

    gpus = _visible_gpus(spec.device)
    if len(gpus) < nproc and (gpus or spec.device == "cuda"):
        return refuse(
            f"--nproc {nproc} needs {nproc} GPUs, {len(gpus)} visible (device: cpu runs the ranks on the CPU)"
        )
    argv = [sys.executable, "-m", "trainer", "train", str(Path(args.spec).resolve())]
    argv += ["--output-dir", str(spec.output_dir), "--nproc", str(nproc)]
    argv += ["--no-resume"] if args.no_resume else []
    argv += ["--json"] if args.json else []  # only rank 0 prints
    argv += [] if args.progress is None else ["--progress" if args.progress else "--no-progress"]
    ranks = NodeRanks(
        argv,
        nproc_per_node=nproc,
        run_id=f"zenflow-train-{uuid.uuid4().hex[:12]}",
        devices=gpus[:nproc] if gpus else None,
        env=os.environ,
    )

    def forward(sig: int, _frame: Any) -> None:  # Ctrl-C: every rank stops after this step
        ranks.terminate(sig)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    )
    try:
        with ranks:
            end = ranks.start().wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if end.code < 0:
        who = f"rank {end.rank}" if end.rank is not None else "the launcher"
        print(f"zenflow train: {who} killed by signal {-end.code}", file=sys.stderr)
        return 128 - end.code
    if end.code != 0 and end.rank not in (None, 0):
        print(f"zenflow train: rank {end.rank} exited with code {end.code}", file=sys.stderr)
    return end.code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))
