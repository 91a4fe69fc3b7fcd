"""The memory and speed plan (trainer.plan.planner): parameter counts, activation bytes against what autograd
really saves, engine bytes against what the engine reports, the Llama-3-8B plan on an H200, refusals
that name the field, engine mode auto in a run, and ``zenflow plan --json``."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from bench.memory import engine_measured, padded_batch, saved_activation_bytes
from contract.lora import LoraSpec
from offload.config import EngineConfig
from trainer.plan.engine import engine_bytes
from trainer.plan.gpus import GiB, Machine, find_gpu, parse_bytes
from trainer.plan.planner import Plan
from trainer.plan.shapes import activation_bytes, model_shape
from trainer.resolve import Counts, plan_spec, resolve
from trainer.spec import JobSpec

SAMPLES = Path(__file__).resolve().parents[3] / "trainer" / "samples"
#: The public Llama-3-8B config.
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
#: ~100M parameters, Llama-shaped with grouped KV heads.
LLAMA_100M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=16000,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def _model_dir(tmp_path: Path, name: str, cfg: dict[str, object]) -> Path:
    d = tmp_path / name
    LlamaConfig(**cfg).save_pretrained(d)  # config.json only: the plan never reads weights
    return d


def _spec(model: str | Path, **kw: object) -> JobSpec:
    return JobSpec(model=str(model), training_file="train.jsonl", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama100m(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    d = _model_dir(tmp_path_factory.mktemp("m100"), "llama-100m", LLAMA_100M)
    torch.manual_seed(0)
    return d, AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(d)).train()


@pytest.mark.parametrize("name", ["tiny-llama", "small-llama"])
def test_params_exact(name: str) -> None:
    from trainer.model.catalog import load_model
    from trainer.model.lora import apply_lora

    model = load_model(name, dtype=torch.float32, seed=0)
    shape = model_shape(name)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.trainable_params == shape.params
    assert sorted(w.shape for w in shape.trainable) == sorted(tuple(p.shape) for p in model.parameters())
    lora = LoraSpec(r=4)
    peft = apply_lora(model, _spec(name, lora=lora.model_dump()), 0)
    with_lora = model_shape(name, lora)
    assert with_lora.params == sum(p.numel() for p in peft.parameters())
    assert with_lora.trainable_params == sum(p.numel() for p in peft.parameters() if p.requires_grad) > 0


def test_params_of_a_local_config(llama100m: tuple[Path, torch.nn.Module]) -> None:
    d, model = llama100m
    shape = model_shape(str(d))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert 90e6 < shape.params < 120e6 and shape.kv_heads == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("padded", [True, False])
def test_activations_match_saved_tensors_tiny(dtype: torch.dtype, checkpointing: bool, padded: bool) -> None:
    from trainer.model.catalog import load_model

    model = load_model("tiny-llama", dtype=dtype, seed=0).train()
    shape = model_shape("tiny-llama")
    _check_activations(model, shape, 3, 96, dtype, checkpointing, padded)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_saved_tensors_100m(
    llama100m: tuple[Path, torch.nn.Module], checkpointing: bool
) -> None:
    d, model = llama100m
    _check_activations(model, model_shape(str(d)), 1, 48, torch.float32, checkpointing, True)


def _check_activations(
    model: torch.nn.Module,
    shape,
    b: int,
    s: int,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    checkpointing: bool,
    padded: bool,
) -> None:
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    try:
        ids, mask = padded_batch(shape.vocab, b, s)
        measured = saved_activation_bytes(model, ids, mask if padded else None)
    finally:
        model.gradient_checkpointing_disable()  # type: ignore[operator]
    e = torch.empty((), dtype=dtype).element_size()
    planned = activation_bytes(shape, b, s, e, checkpointing=checkpointing, masked=padded).saved_bytes
    assert planned == pytest.approx(measured, rel=0.10), (planned, measured)
    other = activation_bytes(shape, b, s, e, checkpointing=not checkpointing, masked=padded).saved_bytes
    assert other != pytest.approx(measured, rel=0.10)  # the two cases really differ


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_saved_tensors_with_lora(checkpointing: bool) -> None:
    from trainer.model.catalog import load_model
    from trainer.model.lora import apply_lora

    spec = _spec("tiny-llama", hyperparameters={"lora": {"r": 8}})
    model = apply_lora(load_model("tiny-llama", dtype=torch.float32, seed=0), spec, 0).train()
    _check_activations(model, model_shape("tiny-llama", spec.lora), 2, 64, torch.float32, checkpointing, True)


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_a_resumed_run_keeps_its_checkpoints_engine_layout(tmp_path: Path, accumulate_on: str) -> None:
    """A run stopped in a zenflow window, resumed with ``engine.mode: auto`` (the plan would take device
    mode here): the new run's resolution keeps the checkpoint's mode and accumulator (source ``resume``)."""
    from trainer.events import Event, Resolved
    from trainer.run.checkpoint import checkpoint_pins
    from trainer.run.loop import run_training

    hp = {"max_steps": 6, "batch_size": 4, "max_seq_length": 64, "checkpoint_every": 100}
    first = JobSpec(
        model="tiny-llama",
        training_file=SAMPLES / "capitals_train.jsonl",
        output_dir=tmp_path,
        hyperparameters=hp,
        engine={"mode": "zenflow", "accumulate_on": accumulate_on, "update_interval": 4},
        engine_tuning={"bind_worker_cores": False},
    )
    steps: list[Event] = []
    run_training(first, on_event=steps.append, should_cancel=lambda: len(steps) > 12, progress=False)
    pins = checkpoint_pins(tmp_path)
    assert pins is not None and (pins.mode, pins.accumulate_on) == ("zenflow", accumulate_on)
    auto = first.model_copy(
        update={"engine": first.engine.model_copy(update={"mode": "auto", "accumulate_on": "auto"})}
    )
    events: list[Event] = []
    run_training(auto, on_event=events.append, progress=False)
    (resolved,) = [e for e in events if isinstance(e, Resolved)]
    job = resolved.resolution["job"]
    assert (job["engine"]["mode"], job["engine"]["accumulate_on"]) == ("zenflow", accumulate_on)
    assert job["sources"]["engine.mode"] == job["sources"]["engine.accumulate_on"] == "resume"


@pytest.mark.parametrize(
    ("mode", "accumulate_on"),
    [("device", "host"), ("offload", "host"), ("zenflow", "host"), ("zenflow", "device")],
)
def test_engine_bytes_match_what_the_engine_reports(mode: str, accumulate_on: str) -> None:
    from trainer.model.catalog import load_model

    model = load_model("tiny-llama", dtype=torch.float32, seed=0)
    cfg = EngineConfig(mode=mode, accumulate_on=accumulate_on, bind_worker_cores=False)  # type: ignore[arg-type]
    planned = engine_bytes(cfg, model_shape("tiny-llama").trainable, 4, cuda=False)
    got = engine_measured(model, cfg)
    assert got["reported_host"] == got["host"]
    assert planned.host_total == pytest.approx(got["host"], rel=0.10)
    assert planned.device["optimizer_state"] == pytest.approx(got["device_state"], rel=0.10)
    buffers = planned.device_total - planned.device["optimizer_state"]
    assert buffers == pytest.approx(got["device_buffers"], rel=0.10)
    assert (planned.host_total > 0) == (mode != "device")


def test_llama3_8b_on_an_h200_fits_in_zenflow_mode(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    spec = _spec(d, hyperparameters={"batch_size": 8, "max_seq_length": 2048})
    plan = plan_spec(spec, Machine.for_gpu("h200"), num_examples=1000)  # a DGX H200's share: 256 GiB
    assert plan.params == 8_030_261_248 and plan.trainable_params == plan.params
    assert plan.fits and plan.problems == []
    assert plan.settings.mode == "zenflow" and plan.modes["zenflow"].fits
    assert plan.device_bytes <= plan.device_capacity_bytes and plan.host_bytes <= plan.host_capacity_bytes
    assert plan.host_capacity_bytes + plan.host_reserve_bytes == 256 * GiB and plan.host_reserve_bytes > 0
    # device mode does not fit: its fp32 gradient copies at the step (4 B/param) come on top of 16 B/param
    # (DeepSpeed's estimator: 20 B/param, 149.6 GiB)
    assert not plan.modes["device"].fits and plan.modes["device"].device_bytes > 149 * GiB
    # 128 GiB of host: host accumulation's 126.4 GiB does not fit beside the host reserve
    tight = plan_spec(spec, Machine.for_gpu("h200", host_memory_bytes=128 * GiB), num_examples=1000)
    assert tight.host_reserve_bytes == int(0.05 * 128 * GiB)
    assert tight.modes["zenflow"].host_bytes > tight.host_capacity_bytes and tight.settings.mode == "offload"
    norms = 65 * 4096  # 1-D weights stay on the device; every 2-D weight is split
    assert plan.device["weights"] == 2 * plan.params and plan.host["engine_state"] == 12 * (
        plan.params - norms
    )
    # the chosen settings are stated, with why
    assert plan.settings.micro_batch_size >= 1 and isinstance(plan.settings.gradient_checkpointing, bool)
    assert any(r.startswith("engine.mode auto -> zenflow") for r in plan.reasons)
    assert any(f"micro_batch_size {plan.settings.micro_batch_size}" in r for r in plan.reasons)
    modes = plan.modes
    assert modes["offload"].step_seconds > modes["zenflow"].step_seconds > 0
    # on an H100 a micro-batch of 2 x 2048 needs activation checkpointing; 4 x 2048 does not fit at all
    h100 = Machine.for_gpu("h100")  # a DGX H100's share of its host: 256 GiB, 14 cores
    two = plan_spec(
        _spec(d, hyperparameters={"batch_size": 8, "max_seq_length": 2048, "micro_batch_size": 2}), h100
    )
    assert two.fits and two.settings.gradient_checkpointing and two.settings.micro_batch_size == 2
    hp4 = {"batch_size": 8, "max_seq_length": 2048, "micro_batch_size": 4}
    four = plan_spec(_spec(d, hyperparameters=hp4, engine={"mode": "zenflow"}), h100)
    # 4 x 2048 fits only without zenflow's landing buffers: the plan drops them, and says so
    assert four.fits and not four.settings.landing_buffers and "landing_buffers" not in four.device
    assert any("landing buffers dropped" in r for r in four.reasons)
    eight = plan_spec(
        _spec(d, hyperparameters={**hp4, "micro_batch_size": 8}, engine={"mode": "zenflow"}), h100
    )
    # the fixes in the order of what the user loses least: GPUs (weights sharded) before a micro-batch of 1
    assert not eight.fits and [p.loc for p in eight.problems] == [("resources", "gpus")]
    message = eight.problems[0].message
    assert (
        "set resources.gpus 2 (planned: fits" in message
        and "set micro_batch_size 1 (planned: fits" in message
    )
    assert message.index("resources.gpus 2") < message.index("micro_batch_size 1")
    # with engine.mode auto it runs in zenflow mode without the landing buffers: faster than offload
    auto = plan_spec(_spec(d, hyperparameters=hp4), h100)
    assert auto.settings.mode == "zenflow" and not auto.settings.landing_buffers
    assert auto.modes["zenflow"].step_seconds < auto.modes["offload"].step_seconds


def test_a_too_small_host_names_the_field_and_the_numbers(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    machine = Machine.for_gpu("h100", host_memory_bytes=64 * GiB)
    plan = plan_spec(_spec(d, engine={"mode": "zenflow"}), machine)
    assert not plan.fits
    (problem,) = plan.problems
    # every fix offered was planned and fits: accumulate_on device (96 GiB) does not, 4 ranks' shards do
    assert problem.loc == ("resources", "gpus")
    assert "GiB of host memory" in problem.message and "the machine has 64.0 GiB" in problem.message
    assert f"{plan.host_bytes / GiB:.1f} GiB" in problem.message
    assert "reserve for the OS, driver and page cache" in problem.message
    assert (
        "set resources.gpus 4 (planned: fits" in problem.message
        and "accumulate_on device" not in problem.message
    )
    # a device too small for device mode: more GPUs (sharded weights) and LoRA are planned and fit
    plan = plan_spec(_spec(d, engine={"mode": "device"}), machine)
    assert not plan.fits and plan.problems[0].loc == ("resources", "gpus")
    assert "of device memory" in plan.problems[0].message and "use LoRA" in plan.problems[0].message
    # a locked-memory limit below the pinned state is noted, not refused (cudaHostAlloc ignores it)
    locked = Machine.for_gpu("h200", host_memory_bytes=256 * GiB, locked_memory_bytes=8 * GiB)
    plan = plan_spec(_spec(d), locked)
    assert plan.fits and not plan.problems
    assert any("locked-memory limit" in r for r in plan.reasons)


def test_engine_mode_auto_picks_device_for_lora_and_small_models(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    machine = Machine.for_gpu("h100", host_memory_bytes=128 * GiB)
    lora = plan_spec(_spec(d, lora={"r": 16}), machine)
    assert lora.settings.mode == "device" and lora.fits and lora.trainable_params < lora.params // 100
    assert lora.reasons[0].startswith("engine.mode auto -> device")
    explicit = plan_spec(_spec(d, lora={"r": 16}, engine={"mode": "zenflow"}), machine)
    assert explicit.settings.mode == "zenflow"
    assert explicit.modes == lora.modes  # every mode is planned alike, whichever the job names
    small = plan_spec(_spec("tiny-llama"), machine)
    assert small.settings.mode == "device"
    assert JobSpec(model="tiny-llama", training_file="t.jsonl").engine.mode == "auto"
    given = JobSpec(
        model="tiny-llama", training_file="t.jsonl", engine={"mode": "auto", "accumulate_on": "auto"}
    )
    resolved = resolve(given, machine, Counts(100), at="create", reason="t")[0].job
    assert resolved.engine.topk_ratio == 0.25  # an explicit auto keeps the model's engine defaults
    assert resolved.engine.mode == "device" and resolved.sources["engine.mode"] == "plan"


def test_engine_mode_auto_falls_back_to_offload_when_only_offload_fits(tmp_path: Path) -> None:
    """An 8B full fine-tune on an L40S (48 GB): zenflow's device-side columns and landing buffers do not
    fit beside the model, offload mode does; auto picks offload, and zenflow asked for by name is
    refused with engine.mode named as the field to change."""
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    l40s = Machine.for_gpu("l40s", host_memory_bytes=128 * GiB)
    plan = plan_spec(_spec(d, hyperparameters={"max_seq_length": 4096}), l40s)
    assert plan.fits and plan.settings.mode == "offload"
    assert not plan.modes["zenflow"].fits and any("auto -> offload" in r for r in plan.reasons)
    named = plan_spec(_spec(d, hyperparameters={"max_seq_length": 4096}, engine={"mode": "zenflow"}), l40s)
    assert not named.fits and named.problems[0].loc == ("resources", "gpus")  # sharded on 2 GPUs
    assert "set engine.mode offload (planned: fits" in named.problems[0].message


def test_run_records_its_plan_and_runs_the_chosen_mode(tmp_path: Path) -> None:
    from trainer.events import Event, LogEvent, RunStarted
    from trainer.run.loop import run_training

    events: list[Event] = []
    spec = JobSpec(
        model="tiny-llama",
        training_file=SAMPLES / "capitals_train.jsonl",
        output_dir=tmp_path,
        hyperparameters={"max_steps": 2, "batch_size": 4, "max_seq_length": 128},
    )
    run_training(spec, on_event=events.append, resume=False, progress=False)
    (planned,) = [e for e in events if isinstance(e, LogEvent) and "plan" in e.data]
    plan = Plan.model_validate(planned.data["plan"])
    started = next(e for e in events if isinstance(e, RunStarted))
    assert planned.message.startswith("Plan: fits") and plan.fits
    assert started.mode == plan.settings.mode == "device"  # engine.mode auto on a CPU, a tiny model
    assert started.hyperparameters["micro_batch_size"] == plan.settings.micro_batch_size


def test_a_config_the_plan_cannot_build(tmp_path: Path) -> None:
    from trainer.resolve import Counts, resolve

    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 5,
                "num_hidden_layers": 1,
                "intermediate_size": 8,
                "vocab_size": 10,
            }
        )
    )
    with pytest.raises(ValueError, match="cannot build the model from its config"):
        plan_spec(_spec(d), Machine.for_gpu("h100", host_memory_bytes=64 * GiB))
    # the job is still resolved (a run of `zenflow train` warns): the plan's choices take their defaults
    resolution, plan = resolve(
        _spec(d), Machine.for_cpu(host_memory_bytes=16 * GiB, cores=2), Counts(10), at="run", reason="t"
    )
    assert plan is None and resolution.plan is None
    assert resolution.job.engine.mode == "zenflow" and resolution.job.sources["engine.mode"] == "default"


def test_cli_json(tmp_path: Path) -> None:
    from api.cli.main import main

    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {d}\ntraining_file: train.jsonl\nhyperparameters: {{max_seq_length: 2048}}\n")
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", str(spec), "--gpu", "h200", "--json"])
    doc = json.loads(out.getvalue())
    assert rc == 0 and doc["fits"] is True and doc["params"] == 8_030_261_248
    # the named box's typical host, not this machine's, and said to be assumed
    assert doc["machine"]["cores"] == 14 and doc["machine"]["host_memory_bytes"] == 256 * GiB
    assert doc["machine"]["sources"]["cores"].startswith("assumed (typical h200 host")
    assert doc["host_bytes"] > 0 and doc["device_bytes"] > 0 and doc["settings"]["mode"] == "zenflow"
    assert {"micro_batch_size", "gradient_checkpointing", "packing", "accumulate_on"} <= set(doc["settings"])
    assert all(doc["modes"][m]["step_seconds"] > 0 for m in ("device", "offload", "zenflow"))
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", str(spec), "--gpu", "h100", "--host-memory", "32GiB"])
    assert rc == 3 and "fits         NO" in out.getvalue() and "(planned: fits" in out.getvalue()
    assert main(["plan", str(spec), "--gpu", "x100"]) == 2


def test_machines_and_sizes() -> None:
    gpu = find_gpu("NVIDIA H100 80GB HBM3")
    assert gpu is not None and gpu.key == "h100" and gpu.pcie_gbps == 50
    a100 = find_gpu("NVIDIA A100-SXM4-40GB")
    assert a100 is not None and a100.key == "a100-40gb"
    assert find_gpu("NVIDIA L4") is not None and find_gpu("NVIDIA L4").key == "l4"  # type: ignore[union-attr]
    assert find_gpu("NVIDIA L40S").key == "l40s" and find_gpu("Quadro 9000") is None  # type: ignore[union-attr]
    assert find_gpu("NVIDIA L40") is None  # not an L4: names match as whole words
    assert (
        parse_bytes("128GiB") == 128 * GiB
        and parse_bytes("120 GB") == 120 * 10**9
        and parse_bytes("1024") == 1024
    )
    with pytest.raises(ValueError):
        parse_bytes("lots")
    with pytest.raises(ValueError):
        Machine.for_gpu("x100", host_memory_bytes=GiB)


def test_bench_memory_smoke() -> None:
    from bench.memory import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            main(
                [
                    "--models",
                    "tiny-llama",
                    "--seq",
                    "32",
                    "--gpus",
                    "h200",
                    "--no-packing",
                    "--run",
                    "--run-modes",
                    "zenflow",
                    "--run-steps",
                    "2",
                    "--run-batch",
                    "2",
                    "--run-seq",
                    "64",
                    "--json",
                ]
            )
            == 0
        )
    doc = json.loads(out.getvalue())
    assert {r["component"] for r in doc["memory"]} >= {
        "parameters",
        "activations",
        "activations (checkpointing)",
    }
    assert all(0.9 <= r["ratio"] <= 1.1 for r in doc["memory"]), doc["memory"]
    assert [r["model"] for r in doc["speed"]] == ["llama-1b", "llama-3b", "llama-8b"]
    assert all(r["zenflow_over_offload_speed"] > 0 for r in doc["speed"])
    (run,) = doc["run"]
    assert run["mode"] == "zenflow" and run["measured_step_s"] > 0 and run["planned_step_s"] > 0
    assert run["planned_engine_host_bytes"] == pytest.approx(run["measured_engine_host_bytes"], rel=0.10)
