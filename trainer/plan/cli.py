"""``zenflow plan SPEC.yaml --gpu h200 [--gpus 8] --host-memory 2TiB [--json]``: the memory and speed
plan of a job on a machine, without running it (:mod:`trainer.plan.planner`).

``--gpus N`` plans the job on N GPUs of one box (the spec's ``resources.gpus`` otherwise): the host
figures given by flags (memory, cores, CPU AdamW GB/s) are the whole box's, which the job's N ranks
share (each rank is planned with 1/N of them); a named GPU's typical host and a worker's capacity are
already one GPU's share. A fix that adds GPUs assumes each brings the same share as the planned ones.

The machine is a known GPU (``--gpu``, see :data:`trainer.plan.gpus.KNOWN_GPUS`; an ambiguous name such
as ``a100`` is refused with its variants; ``cpu`` for a CPU run; default this host's). Its host figures
(memory, cores, CPU AdamW and PCIe GB/s, locked-memory limit) are, in order: the flags; a worker's
measured capacity (``--capacity FILE``: what ``python -m worker.capacity.measure`` prints on that box,
the figures a registered worker plans its queue's jobs with); for a named GPU its typical host
(:class:`trainer.plan.gpus.Host`), never this machine's; without ``--gpu`` this host's. The output
says which figures are assumed, given or measured. The number of examples is the training file's
line count when the file exists (``--num-examples`` overrides it). Exit codes: 0 the job fits, 3 it
does not (the problems say what to change), 2 bad input (spec, model or machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from trainer.plan.gpus import KNOWN_GPUS, Machine, format_bytes, host_memory_bytes, parse_bytes, usable_cores
from trainer.plan.records import Plan

EXIT_FITS = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``plan`` to ``subparsers`` (from ``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "plan",
        help="whether a job fits a machine, its memory per component and predicted speed",
        description="Plan a job spec (YAML) on a machine: memory per component, settings for its 'auto' "
        "values, predicted step time per engine mode. Nothing is loaded or run.",
        epilog="exit codes: 0 fits, 3 does not fit (see the problems), 2 bad input",
    )
    p.add_argument("spec", type=Path, help="job spec (YAML)")
    p.add_argument(
        "--gpu",
        default=None,
        help=f"GPU model ({', '.join(KNOWN_GPUS)}) or 'cpu' (default: this host's GPU, else its CPU)",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        help="host memory, e.g. 128GiB (default: the named GPU's typical host, else this host's)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=None,
        help="CPU cores for the job (default: the named GPU's typical host, else this host's usable cores)",
    )
    p.add_argument(
        "--cpu-adam-gbps",
        type=float,
        default=None,
        help="measured CPU AdamW GB/s (default: per-core estimate)",
    )
    p.add_argument(
        "--pcie-gbps", type=float, default=None, help="host<->device GB/s (default: from the PCIe generation)"
    )
    p.add_argument(
        "--locked-memory",
        default=None,
        help="locked-memory limit (ulimit -l), e.g. 64GiB (default: unlimited)",
    )
    p.add_argument(
        "--num-examples", type=int, default=None, help="training examples (default: the file's lines)"
    )
    p.add_argument(
        "--capacity",
        type=Path,
        default=None,
        help="a worker's measured capacity (JSON of 'python -m worker.capacity.measure' on the box)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs (ranks) of one box the job runs on (default: the spec's resources.gpus); the host "
        "figures given are the box's, shared by the ranks",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
    return p


def _measured(path: Path) -> dict[str, Any]:
    """The figures of a worker's capacity record (``python -m worker.capacity.measure``), as one GPU's
    share of its host (its peers train at the same time), keyed like the flags."""
    cap = json.loads(path.read_text())
    if not isinstance(cap, dict) or not isinstance(cap.get("host_memory_bytes"), int):
        raise ValueError(f"{path}: not a worker capacity record (python -m worker.capacity.measure)")
    share = max(1, int(cap.get("gpus_on_host") or 1)) if cap.get("device_type") == "cuda" else 1
    adam = cap.get("cpu_adam_gbps")
    return {
        "gpu": cap.get("gpu_name") if cap.get("device_type") == "cuda" else "cpu",
        "gpu_memory_bytes": cap.get("gpu_memory_bytes") or None,
        "host_memory_bytes": max(1, cap["host_memory_bytes"] // share),
        "cores": max(1, int(cap["cores"]) // share),
        "cpu_adam_gbps": float(adam) / share if adam else None,
        "pcie_gbps": cap.get("pcie_gbps"),
        "locked_memory_bytes": cap.get("locked_memory_bytes"),
    }


def _machine(args: argparse.Namespace, ranks: int = 1) -> Machine:
    """The machine of one rank: host figures given by flags are the box's, shared by ``ranks``."""
    given: dict[str, Any] = {
        "host_memory_bytes": parse_bytes(args.host_memory) // ranks if args.host_memory else None,
        "cores": max(1, args.cores // ranks) if args.cores else None,
        "cpu_adam_gbps": args.cpu_adam_gbps / ranks if args.cpu_adam_gbps else None,
        "pcie_gbps": args.pcie_gbps,
        "locked_memory_bytes": parse_bytes(args.locked_memory) if args.locked_memory else None,
    }
    measured = _measured(args.capacity) if args.capacity else {}
    gpu = args.gpu or measured.get("gpu")
    figures = {k: v if v is not None else measured.get(k) for k, v in given.items()}
    labels = {
        "host_memory": "host_memory_bytes",
        "cores": "cores",
        "cpu_adam": "cpu_adam_gbps",
        "pcie": "pcie_gbps",
    }

    def label(machine: Machine) -> Machine:  # given by a flag, or measured by the worker
        sources: dict[str, str] = {}
        for name, key in labels.items():
            if given[key] is not None:
                sources[name] = (
                    "given" if ranks == 1 or key == "pcie_gbps" else f"given (the box's, 1/{ranks} a rank)"
                )
            elif measured.get(key) is not None:
                sources[name] = "measured (--capacity)"
        return machine.model_copy(update={"sources": machine.sources.model_copy(update=sources)})

    if gpu is None:  # this host's GPU (or its CPU), with the figures given here
        found = Machine.detect()
        update = {k: v for k, v in figures.items() if v is not None}
        return label(Machine.model_validate({**found.model_dump(), **update}))
    if gpu.lower() == "cpu":
        return label(
            Machine.for_cpu(
                host_memory_bytes=figures["host_memory_bytes"] or host_memory_bytes(),
                cores=figures["cores"] or usable_cores(),
                cpu_adam_gbps=figures["cpu_adam_gbps"],
                locked_memory_bytes=figures["locked_memory_bytes"],
                source="this host's" if figures["cores"] is None else "given",
            )
        )
    return label(
        Machine.for_gpu(
            gpu,
            host_memory_bytes=figures["host_memory_bytes"],
            cores=figures["cores"],
            cpu_adam_gbps=figures["cpu_adam_gbps"],
            pcie_gbps=figures["pcie_gbps"],
            locked_memory_bytes=figures["locked_memory_bytes"],
            gpu_memory_bytes=measured.get("gpu_memory_bytes"),
        )
    )


def _count_examples(path: Path) -> int | None:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip()) or None
    except OSError:
        return None


#: The project's own source tree: a warning raised from a file under it is the user's to read (a
#: deprecated spec key); one from a library (transformers reading a config.json's ``rope_scaling``,
#: torch) is about that library's internals, and would print above the plan.
_OWN_CODE = Path(__file__).resolve().parents[2]


def own_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of ``caught`` raised from this project's code (not its virtual environment)."""
    out = []
    for w in caught:
        path = Path(w.filename).resolve()
        if path.is_relative_to(_OWN_CODE) and "site-packages" not in path.parts:
            out.append(str(w.message))
    return list(dict.fromkeys(out))


def cmd_plan(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from trainer.spec import load_spec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            spec = load_spec(args.spec, output_dir=Path("."))
            if args.gpus is not None:
                resources = spec.resources.model_validate({**spec.resources.model_dump(), "gpus": args.gpus})
                spec = spec.model_copy(update={"resources": resources})
            machine = _machine(args, spec.resources.gpus)
            from trainer.resolve import plan_spec

            n = args.num_examples or _count_examples(spec.training_file)
            plan = plan_spec(spec, machine, num_examples=n)
        except (OSError, ValueError, ValidationError) as exc:  # ValidationError is a ValueError
            print(f"zenflow plan: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))
    for message in own_warnings(caught):  # after the plan, plainly; the libraries' not at all
        print(f"zenflow plan: warning: {message}", file=sys.stderr)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


def _size(n: int) -> str:
    return f"{format_bytes(n):>11s}"


def format_plan(plan: Plan) -> str:
    """The plan as a text table."""
    m, s = plan.machine, plan.settings
    lines = [
        f"model        {plan.model}: {plan.params:,} parameters, {plan.trainable_params:,} trainable, {plan.dtype}",
        f"machine      {m.gpu_name}: {_size(m.gpu_memory_bytes).strip()} device, {_size(m.host_memory_bytes).strip()} "
        f"host, {m.cores} cores, PCIe {m.pcie_gbps:g} GB/s, CPU AdamW {m.cpu_adam_gbps:g} GB/s",
        *(f"  {k:13s}{v}" for k, v in m.sources.items()),
        f"step         batch {plan.batch_size} x {plan.max_seq_length} tokens",
        *(
            [
                f"rollout      sampling ~{plan.generation_seconds:.3g} s of each step's "
                f"~{plan.step_seconds:.3g} s (in every mode's step s below); its KV cache and logits "
                f"{format_bytes(plan.rollout_cache_bytes)} (rollout_kv_cache: what exceeds the "
                "activations' peak)"
            ]
            if plan.generation_seconds
            else []
        ),
        f"settings     {'' if plan.fits else 'none fits; the closest: '}mode {s.mode}, micro_batch_size {s.micro_batch_size}, gradient_checkpointing "
        f"{str(s.gradient_checkpointing).lower()}, packing {str(s.packing).lower()}, accumulate_on {s.accumulate_on}, "
        f"update_interval {s.update_interval}, shard_params {str(s.shard_params).lower()}",
        f"fits         {'yes' if plan.fits else 'NO'}{' (only with sharded weights)' if plan.fits_only_sharded else ''}",
        f"ranks        {plan.ranks}: the memory below is one rank's; the host's for all ranks "
        f"{format_bytes(plan.host_bytes_all_ranks)}",
        "",
        f"device memory {_size(plan.device_bytes)} of {_size(plan.device_capacity_bytes).strip()} usable "
        f"({format_bytes(plan.device_reserve_bytes)} reserve: allocator fragmentation, workspaces)",
        *(f"  {k:22s}{_size(v)}" for k, v in plan.device.items()),
        f"host memory   {_size(plan.host_bytes)} of {_size(plan.host_capacity_bytes).strip()} usable "
        f"({format_bytes(plan.host_reserve_bytes)} reserve: OS, driver, page cache)",
        *(f"  {k:22s}{_size(v)}" for k, v in plan.host.items()),
        "",
        f"{'mode':9s}{'fits':>5s}{'step s':>10s}{'tokens/s':>12s}{'gpu s':>9s}{'link s':>9s}{'pcie s':>9s}"
        f"{'cpu s':>9s}  bound",
    ]
    for name, e in plan.modes.items():
        lines.append(
            f"{name:9s}{'yes' if e.fits else 'no':>5s}{e.step_seconds:10.3f}{e.tokens_per_second:12,.0f}"
            f"{e.gpu_seconds:9.3f}{e.interconnect_seconds:9.3f}{e.pcie_seconds:9.3f}{e.cpu_seconds:9.3f}  {e.bound}"
        )
    if plan.reasons:
        lines += ["", *(f"- {r}" for r in plan.reasons)]
    if plan.problems:
        lines += ["", *(f"! {'.'.join(p.loc)}: {p.message}" for p in plan.problems)]
    return "\n".join(lines)
