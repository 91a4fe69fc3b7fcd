"""The plan against what really happens: memory planned vs measured per component (on the CPU), the
plan's predicted zenflow/offload speed ratio for 1B/3B/8B Llama-shaped models on H100 and H200, and
padded vs packed tokens/s on the sample data.

    python -m bench.memory                        # all three sections, tables
    python -m bench.memory --json                 # the same as one JSON document
    python -m bench.memory --models tiny-llama --no-packing --seq 64
    python -m bench.memory --models '' --gpus '' --no-packing --run --device cuda --run-model small-llama

Measured, per built-in model (fp32 on the CPU, a padded micro-batch of ``--micro-batch`` x ``--seq``):

- parameters and gradients: the loaded model's tensors;
- activations: every tensor autograd saves for backward during one forward and the loss (counted
  with ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters excluded), plus
  with activation checkpointing the decoder layers' inputs the checkpoints keep; planned is
  :func:`trainer.plan.shapes.activation_bytes`'s ``saved_bytes``;
- engine: ``ZenFlowEngine.memory()`` (measured from its tensors) and ``StepMetrics.host_bytes`` after
  one step, per mode, against :func:`trainer.plan.engine.engine_bytes`.

Speed ratios: :func:`trainer.resolve.plan_spec` on each GPU with 128 GiB of host memory and 32 cores,
batch 8 x 2048, engine defaults (and zenflow with ``accumulate_on: device``); the ratio is offload's
predicted step time over zenflow's (a prediction: ``bench/gpu_check.sh`` measures it on a GPU).
DeepSpeed: the plan's model-state bytes (weights, gradients, optimizer state; on the host the engine's
state) of one GPU for the same shapes beside DeepSpeed's published estimators of model-state memory
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``, the formulas of
its "Memory Requirements" docs, reimplemented here: :func:`deepspeed_estimates`), 1 GPU, 1 node,
their default ``additional_buffer_factor`` 1.5 on the CPU side. Activations are in neither.
Packing: :func:`bench.packing.compare` on the sample data. ``--run`` (``--device cuda`` on a GPU host):
a short ``run_training`` per engine mode on long synthetic examples, its plan (from the run's events)
against the measured step time, peak device memory and the engine's reported host bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SAMPLES = Path(__file__).resolve().parents[1] / "trainer" / "samples"
#: Llama-3-family shapes (public configs) for the speed table.
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    "llama-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        head_dim=128,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        head_dim=128,
    ),
}


# --- measuring -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _layer_inputs(model: Any, into: dict[int, int]) -> Iterator[None]:
    """Record the decoder layers' input storages (what non-reentrant checkpoints keep alive)."""
    layers = model.get_decoder().layers

    def pre(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        into.setdefault(h.untyped_storage().data_ptr(), h.untyped_storage().nbytes())

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def saved_activation_bytes(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """Bytes autograd keeps for backward over one forward and the trainer's loss (each storage once,
    parameters excluded); with checkpointing on, plus the layer inputs the checkpoints hold."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, storage.nbytes())
        return t

    ckpt = bool(
        getattr(model, "is_activation_checkpointing", None)
        or getattr(model, "is_gradient_checkpointing", False)
    )
    layer_inputs: dict[int, int] = {}
    hooks = _layer_inputs(model, layer_inputs) if ckpt else contextlib.nullcontext()
    with hooks, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum"
        )
    del loss, logits
    for ptr, n in layer_inputs.items():
        seen.setdefault(ptr, n)
    return sum(seen.values())


def padded_batch(
    vocab: int, micro_batch: int, seq: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and a right-padding mask (the first row one quarter padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (micro_batch, seq), generator=g)
    mask = torch.ones(micro_batch, seq, dtype=torch.long)
    mask[0, seq - seq // 4 :] = 0
    return ids, mask


def engine_measured(model: Any, config: Any) -> dict[str, int]:
    """One engine step on ``model`` (CPU) and what the engine reports it holds."""
    from offload.engine import ZenFlowEngine

    with ZenFlowEngine(model, config) as engine:
        g = torch.Generator().manual_seed(0)
        for i in range(5):  # a window, a new epoch and the reselection at its end (zenflow's stash)
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
            metrics = engine.step()
            if i == 0:
                engine.new_epoch()
        mem = engine.memory()
        engine.zero_grad()
    return {
        "host": mem.host_bytes,
        "reported_host": metrics.host_bytes,
        "device_state": mem.device_state_bytes,
        "device_buffers": mem.device_buffer_bytes,
    }


def memory_rows(name: str, micro_batch: int, seq: int) -> list[dict[str, Any]]:
    """Planned vs measured per component for built-in model ``name`` (fp32 on the CPU)."""
    from offload.config import EngineConfig
    from trainer.model.catalog import load_model
    from trainer.plan.engine import engine_bytes
    from trainer.plan.shapes import activation_bytes, model_shape

    shape = model_shape(name)
    model = load_model(name, dtype=torch.float32, seed=0)
    model.train()
    rows = [
        {
            "component": "parameters",
            "planned": shape.params * 4,
            "measured": sum(p.numel() * p.element_size() for p in model.parameters()),
        },
        {
            "component": "gradients",
            "planned": shape.trainable_params * 4,
            "measured": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        },
    ]
    ids, mask = padded_batch(shape.vocab, micro_batch, seq)
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        planned = activation_bytes(shape, micro_batch, seq, 4, checkpointing=ckpt).saved_bytes
        rows.append(
            {
                "component": f"activations{' (checkpointing)' if ckpt else ''}",
                "planned": planned,
                "measured": saved_activation_bytes(model, ids, mask),
            }
        )
    model.gradient_checkpointing_disable()
    for mode, acc in (("device", "host"), ("offload", "host"), ("zenflow", "host"), ("zenflow", "device")):
        cfg = EngineConfig(mode=mode, accumulate_on=acc, bind_worker_cores=False)  # type: ignore[arg-type]
        plan = engine_bytes(cfg, shape.trainable, 4, cuda=False)
        got = engine_measured(model, cfg)
        label = f"engine {mode}" + (f" ({acc} accumulation)" if mode == "zenflow" else "")
        scratch = {"optimizer_state"}
        rows += [
            {"component": f"{label}: host", "planned": plan.host_total, "measured": got["reported_host"]},
            {
                "component": f"{label}: device state",
                "planned": plan.device["optimizer_state"],
                "measured": got["device_state"],
            },
            {
                "component": f"{label}: device buffers",
                "planned": sum(v for k, v in plan.device.items() if k not in scratch),
                "measured": got["device_buffers"],
            },
        ]
    for r in rows:
        r["model"] = name
        r["ratio"] = (
            r["planned"] / r["measured"] if r["measured"] else (1.0 if not r["planned"] else float("inf"))
        )
    return rows


# --- predicted speed ---------------------------------------------------------------------------------


def speed_rows(gpus: list[str], host_gib: int = 128, cores: int = 32) -> list[dict[str, Any]]:
    """The plan's zenflow/offload/device step times for the Llama shapes on ``gpus``."""
    from transformers import LlamaConfig

    from trainer.plan.gpus import GiB, Machine
    from trainer.resolve import plan_spec
    from trainer.spec import JobSpec

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in LLAMA_SHAPES.items():
            d = Path(tmp) / name
            LlamaConfig(max_position_embeddings=8192, **cfg).save_pretrained(d)
            hp = {"batch_size": 8, "max_seq_length": 2048}
            spec = JobSpec(model=str(d), training_file=Path(tmp) / "train.jsonl", hyperparameters=hp)
            dacc = JobSpec(
                model=str(d),
                training_file=Path(tmp) / "train.jsonl",
                hyperparameters=hp,
                engine={"accumulate_on": "device"},
            )
            for gpu in gpus:
                machine = Machine.for_gpu(gpu, host_memory_bytes=host_gib * GiB, cores=cores)
                plan = plan_spec(spec, machine)
                z, o, dv = plan.modes["zenflow"], plan.modes["offload"], plan.modes["device"]
                zd = plan_spec(dacc, machine).modes["zenflow"]
                rows.append(
                    {
                        "model": name,
                        "gpu": gpu,
                        "params": plan.params,
                        "auto_mode": plan.settings.mode,
                        "fits": plan.fits,
                        "zenflow_s": z.step_seconds,
                        "offload_s": o.step_seconds,
                        "device_s": dv.step_seconds if dv.fits else None,
                        "zenflow_fits": z.fits,
                        "zenflow_settings": z.settings.model_dump(),
                        "zenflow_bound": z.bound,
                        "zenflow_over_offload_speed": o.step_seconds / z.step_seconds,
                        "zenflow_dacc_s": zd.step_seconds,
                        "zenflow_dacc_fits": zd.fits,
                        "zenflow_dacc_over_offload_speed": o.step_seconds / zd.step_seconds,
                    }
                )
    return rows


# --- the plan's model states beside DeepSpeed's estimators ----------------------------------------------------


def deepspeed_estimates(
    total_params: int,
    largest_layer_params: int,
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    buffer_factor: float = 1.5,
) -> dict[str, tuple[int, int]]:
    """DeepSpeed's model-state estimates ``{setup: (gpu_bytes, cpu_bytes)}`` per GPU, as its docs give
    them: ZeRO-2 with and without the optimizer offloaded (``cpu_offload``), ZeRO-3 with the optimizer
    offloaded (params on the GPU, or offloaded too), both without ``zero_init``."""
    total_gpus = gpus_per_node * nodes
    largest = 4 * largest_layer_params
    per_node = 1 / nodes
    return {
        "zero2": (
            4 * total_params + int(16 * total_params / total_gpus),
            int(total_params * 4 * gpus_per_node * buffer_factor),
        ),
        "zero2_offload": (2 * total_params, int(total_params * max(4 * total_gpus, 16) * buffer_factor)),
        "zero3_offload_optimizer": (
            largest + int(2 * total_params / total_gpus),
            int(total_params * max(4 * gpus_per_node, 16 * per_node) * buffer_factor),
        ),
        "zero3_offload_all": (
            largest,
            int(total_params * max(4 * gpus_per_node, 18 * per_node) * buffer_factor),
        ),
    }


#: The plan's components that are model states (what DeepSpeed's estimators count).
_STATE_DEVICE = ("weights", "gradients", "optimizer_state")
_STATE_HOST = ("engine_state",)
#: Which DeepSpeed setup each engine mode corresponds to.
_DS_MATCH = {"device": "zero2", "offload": "zero2_offload", "zenflow": "zero2_offload"}


def deepspeed_rows(gpu: str = "h200") -> list[dict[str, Any]]:
    """Per Llama shape and engine mode: the plan's model-state bytes on ``gpu`` beside DeepSpeed's."""
    from transformers import LlamaConfig

    from trainer.plan.gpus import Machine
    from trainer.resolve import plan_spec
    from trainer.spec import JobSpec

    rows = []
    machine = Machine.for_gpu(gpu)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in LLAMA_SHAPES.items():
            d = Path(tmp) / name
            LlamaConfig(max_position_embeddings=8192, **cfg).save_pretrained(d)
            largest = (
                cfg["vocab_size"] * cfg["hidden_size"]
            )  # the embedding (or the head): the largest module
            for mode in ("device", "offload", "zenflow"):
                spec = JobSpec(
                    model=str(d),
                    training_file=Path(tmp) / "train.jsonl",
                    hyperparameters={"batch_size": 8, "max_seq_length": 2048},
                    engine={"mode": mode},
                )
                plan = plan_spec(spec, machine, num_examples=1000, advise=False)
                ds = deepspeed_estimates(plan.params, largest)
                setup = _DS_MATCH[mode]
                rows.append(
                    {
                        "model": name,
                        "params": plan.params,
                        "mode": mode,
                        # device mode's fp32 gradient copies at the step (the plan counts only their excess
                        # over the activations, which are freed by then): model states at the step
                        "plan_device_states": sum(plan.device.get(k, 0) for k in _STATE_DEVICE)
                        + (4 * plan.trainable_params if mode == "device" and plan.dtype == "bfloat16" else 0),
                        "plan_host_states": sum(plan.host.get(k, 0) for k in _STATE_HOST),
                        "plan_device_total": plan.device_bytes,
                        "deepspeed_setup": setup,
                        "deepspeed_gpu": ds[setup][0],
                        "deepspeed_cpu": ds[setup][1],
                        "deepspeed": {k: list(v) for k, v in ds.items()},
                    }
                )
    return rows


# --- padded vs packed, and a real run against its plan -------------------------------------------------------


def packing_rows(steps: int, device: str) -> dict[str, Any]:
    """Padded vs packed tokens/s of the sample data (tiny-llama): :func:`bench.packing.compare`."""
    from bench.packing import compare

    return compare("tiny-llama", SAMPLES / "capitals_train.jsonl", steps=steps, device=device)


def long_examples(path: Path, n: int, chars: int, seed: int = 0) -> Path:
    """``n`` chat examples whose answers are ~``chars`` characters of words (long enough to fill
    ``max_seq_length`` with the byte tokenizer, so a step holds batch x max_seq_length tokens)."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "north", "light"]
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(chars // 5))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Say something {i}."},
                            {"role": "assistant", "content": text},
                        ]
                    }
                )
                + "\n"
            )
    return path


def run_rows(
    model: str, device: str, modes: list[str], steps: int, batch: int, seq: int
) -> list[dict[str, Any]]:
    """A short training run per engine mode on this machine: its plan (from the run's own events)
    against the measured step time (median of the steps after the first two), peak device memory
    (CUDA: ``torch.cuda.max_memory_allocated``, against the plan's device bytes less the CUDA
    runtime, which the allocator does not see) and the engine's reported host bytes."""
    from trainer.events import LogEvent, StepEvent
    from trainer.plan.planner import Plan
    from trainer.run.loop import run_training
    from trainer.spec import JobSpec

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = long_examples(Path(tmp) / "long.jsonl", max(batch * (steps + 1), 16), seq)
        for mode in modes:
            events: list[Any] = []
            spec = JobSpec.model_validate(
                {
                    "model": model,
                    "training_file": str(data),
                    "output_dir": str(Path(tmp) / mode),
                    "device": device,
                    "engine": {"mode": mode},
                    "hyperparameters": {
                        "batch_size": batch,
                        "max_seq_length": seq,
                        "max_steps": steps,
                        "eval_every": None,
                        "checkpoint_every": steps,
                    },
                }
            )
            cuda = torch.cuda.is_available() and device != "cpu"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            run_training(spec, on_event=events.append, resume=False, progress=False)
            peak = torch.cuda.max_memory_allocated() if cuda else None
            plan = next(
                Plan.model_validate(e.data["plan"])
                for e in events
                if isinstance(e, LogEvent) and "plan" in e.data
            )
            step_events = [e for e in events if isinstance(e, StepEvent)]
            timed = step_events[2:] or step_events
            measured_s = statistics.median(e.step_seconds for e in timed)
            runtime = plan.device.get("runtime", 0)
            rows.append(
                {
                    "mode": mode,
                    "model": model,
                    "machine": plan.machine.gpu_name,
                    "fits": plan.fits,
                    "settings": plan.settings.model_dump(),
                    "planned_step_s": plan.step_seconds,
                    "measured_step_s": measured_s,
                    "planned_tokens_per_s": plan.tokens_per_second,
                    "measured_tokens_per_s": statistics.median(e.tokens_per_second for e in timed),
                    "planned_device_bytes": plan.device_bytes - runtime,
                    "measured_device_peak_bytes": peak,
                    "planned_engine_host_bytes": sum(
                        v for k, v in plan.host.items() if k.startswith("engine")
                    ),
                    "measured_engine_host_bytes": step_events[-1].engine.host_bytes if step_events else None,
                }
            )
    return rows


# --- report -------------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:10.3f}"


def print_report(doc: dict[str, Any]) -> None:
    if doc.get("memory"):
        print("planned vs measured (MiB), fp32 on the CPU")
        print(f"{'model':12s}{'component':52s}{'planned':>11s}{'measured':>11s}{'ratio':>8s}")
        for r in doc["memory"]:
            print(
                f"{r['model']:12s}{r['component']:52s}{_mib(r['planned'])} {_mib(r['measured'])}{r['ratio']:8.3f}"
            )
    if doc.get("speed"):
        print("\npredicted step seconds, batch 8 x 2048, 128 GiB host (less its reserve), 32 cores")
        print("(n/f: does not fit; zf-dacc: zenflow with accumulate_on device)")
        print(
            f"{'model':10s}{'gpu':6s}{'auto':>9s}{'zenflow':>9s}{'zf-dacc':>9s}{'offload':>9s}{'device':>9s}"
            f"{'zf/off':>9s}{'dacc/off':>10s}  zenflow bound"
        )
        for r in doc["speed"]:

            def cell(s: float | None, fits: bool = True) -> str:
                return f"{s:9.2f}" if s is not None and fits else f"{'n/f':>9s}"

            def ratio(x: float, fits: bool) -> str:
                return f"{x:.2f}x" if fits else "n/f"

            print(
                f"{r['model']:10s}{r['gpu']:6s}{r['auto_mode']:>9s}{cell(r['zenflow_s'], r['zenflow_fits'])}"
                f"{cell(r['zenflow_dacc_s'], r['zenflow_dacc_fits'])}{r['offload_s']:9.2f}{cell(r['device_s'])}"
                f"{ratio(r['zenflow_over_offload_speed'], r['zenflow_fits']):>9s}"
                f"{ratio(r['zenflow_dacc_over_offload_speed'], r['zenflow_dacc_fits']):>10s}  {r['zenflow_bound']}"
            )
    if doc.get("deepspeed"):
        print(
            "\nmodel states (GiB): the plan on one GPU beside DeepSpeed's estimators (1 GPU, buffer factor 1.5)"
        )
        print(
            "(plan device: weights, gradients, optimizer state, device mode's fp32 gradient copies; plan host: the"
        )
        print(
            " engine's fp32 master and moments; DeepSpeed: zero2 for device mode, zero2_offload for offload/zenflow)"
        )
        print(
            f"{'model':10s}{'mode':9s}{'plan dev':>10s}{'DS gpu':>9s}{'plan host':>11s}{'DS cpu':>9s}  {'DS setup':15s}{'zero3 gpu/cpu (offload all)':>30s}"
        )
        for r in doc["deepspeed"]:
            z3 = r["deepspeed"]["zero3_offload_all"]
            print(
                f"{r['model']:10s}{r['mode']:9s}{r['plan_device_states'] / 2**30:10.1f}{r['deepspeed_gpu'] / 2**30:9.1f}"
                f"{r['plan_host_states'] / 2**30:11.1f}{r['deepspeed_cpu'] / 2**30:9.1f}  {r['deepspeed_setup']:15s}"
                f"{z3[0] / 2**30:>21.1f} / {z3[1] / 2**30:.1f}"
            )
    if doc.get("packing"):
        pk = doc["packing"]
        print(
            f"\nsample data, tiny-llama: padded {pk['padded']['tokens_per_second']:,.0f} tokens/s, packed "
            f"{pk['packed']['tokens_per_second']:,.0f} tokens/s ({pk['packed']['attention']}): {pk['ratio']:.2f}x"
        )
    if doc.get("run"):
        print("\nplanned vs measured, a short run on this machine")
        print(
            f"{'mode':9s}{'step s plan':>12s}{'measured':>10s}{'device plan':>13s}{'peak':>11s}"
            f"{'engine host plan':>18s}{'reported':>11s}"
        )
        for r in doc["run"]:
            peak = (
                _mib(r["measured_device_peak_bytes"])
                if r["measured_device_peak_bytes"] is not None
                else "       n/a"
            )
            host = r["measured_engine_host_bytes"]
            print(
                f"{r['mode']:9s}{r['planned_step_s']:12.3f}{r['measured_step_s']:10.3f}"
                f"{_mib(r['planned_device_bytes'])} MiB{peak}"
                f"{_mib(r['planned_engine_host_bytes'])} MiB{_mib(host) if host is not None else '       n/a'}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    ap.add_argument(
        "--models", default="tiny-llama,small-llama", help="built-in models to measure ('' skips)"
    )
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--gpus", default="h100,h200", help="GPUs for the predicted speed table ('' skips)")
    ap.add_argument("--deepspeed-gpu", default="h200", help="GPU for the DeepSpeed comparison ('' skips)")
    ap.add_argument("--packing-steps", type=int, default=6)
    ap.add_argument("--no-packing", action="store_true", help="skip padded vs packed")
    ap.add_argument("--run", action="store_true", help="also a short training run per mode against its plan")
    ap.add_argument("--run-model", default="tiny-llama")
    ap.add_argument("--run-modes", default="device,zenflow,offload")
    ap.add_argument("--run-steps", type=int, default=6)
    ap.add_argument("--run-batch", type=int, default=4)
    ap.add_argument("--run-seq", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="for --run and packing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {"args": vars(args)}
    doc["memory"] = [
        r for m in filter(None, args.models.split(",")) for r in memory_rows(m, args.micro_batch, args.seq)
    ]
    doc["speed"] = speed_rows(list(filter(None, args.gpus.split(","))))
    doc["deepspeed"] = deepspeed_rows(args.deepspeed_gpu) if args.deepspeed_gpu else []
    doc["packing"] = None if args.no_packing else packing_rows(args.packing_steps, args.device)
    doc["run"] = (
        run_rows(
            args.run_model,
            args.device,
            args.run_modes.split(","),
            args.run_steps,
            args.run_batch,
            args.run_seq,
        )
        if args.run
        else []
    )
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
