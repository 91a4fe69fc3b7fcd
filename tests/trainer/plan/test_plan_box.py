"""The plan of a named box (issue 27): the GPU's typical host, not this machine's, with what was assumed
said; ambiguous GPU names refused; ``auto`` by the plan's own prediction; host and device reserves;
zenflow's column work charged; and fixes that are planned before they are offered."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from transformers import LlamaConfig

from trainer.plan.gpus import KNOWN_GPUS, GiB, Machine, gpu_named, usable_cores
from trainer.plan.planner import MODE_MIN_GAIN
from trainer.plan.shapes import model_shape
from trainer.plan.speed import DEVICE_ADAM_BYTES_PER_PARAM, compute_seconds
from trainer.resolve import plan_spec
from trainer.spec import JobSpec

from .test_plan import LLAMA3_8B

#: Llama-3.2-3B's public config (tied embeddings).
LLAMA32_3B = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
HP = {"batch_size": 8, "max_seq_length": 2048}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, cfg in (("8b", LLAMA3_8B), ("3b", LLAMA32_3B)):
        LlamaConfig(**cfg).save_pretrained(root / name)  # config.json only
        out[name] = root / name
    return out


def _spec(model: Path, **kw: object) -> JobSpec:
    return JobSpec(model=str(model), training_file="train.jsonl", **kw)  # type: ignore[arg-type]


def test_a_named_gpu_plans_with_its_typical_host_and_says_so() -> None:
    h200 = Machine.for_gpu("h200")
    host = KNOWN_GPUS["h200"].host
    assert (h200.cores, h200.host_memory_bytes) == (host.cores, host.memory_bytes) == (14, 256 * GiB)
    assert h200.cpu_adam_gbps == 35.0  # 14 cores x 2.5 GB/s, under 60% of the share's 76.8 GB/s
    assert h200.sources.cores is not None and h200.sources.cores.startswith("assumed (typical h200 host")
    given = Machine.for_gpu("h200", cores=32, host_memory_bytes=128 * GiB)
    assert given.sources.cores == "given" and given.sources.host_memory == "given"
    # the L4's host is small and its memory bandwidth caps the CPU AdamW
    l4 = Machine.for_gpu("l4")
    assert l4.cores == 4 and l4.cpu_adam_gbps == 10.0


def test_an_ambiguous_gpu_is_refused_with_its_variants(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ambiguous GPU 'a100': say which, one of a100-40gb, a100-80gb"):
        gpu_named("a100")
    with pytest.raises(ValueError, match="ambiguous"):
        Machine.for_gpu("A100")
    assert gpu_named("a100-40gb").memory_bytes < gpu_named("a100-80gb").memory_bytes
    assert gpu_named("NVIDIA A100-SXM4-80GB").key == "a100-80gb"  # device names still resolve


def test_cli_plans_the_named_box_not_this_machine(models: dict[str, Path], tmp_path: Path) -> None:
    from api.cli.main import main

    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"model: {models['3b']}\ntraining_file: train.jsonl\nhyperparameters: {{batch_size: 8, max_seq_length: 2048}}\n"
    )
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", str(spec), "--gpu", "h200"]) == 0
    text = out.getvalue()
    assert "14 cores" in text and "cores        assumed (typical h200 host" in text
    assert usable_cores() != 14 or "assumed" in text
    assert "reserve: OS, driver, page cache" in text and "reserve: allocator fragmentation" in text
    assert "engine.mode auto -> device: the fastest that fits" in text
    # a worker's measured capacity: its share of the host, marked measured
    cap = tmp_path / "cap.json"
    cap.write_text(
        json.dumps(
            {
                "device_type": "cuda",
                "gpu_name": "NVIDIA H200",
                "gpu_memory_bytes": 150_000_000_000,
                "gpus_on_host": 8,
                "host_memory_bytes": 2048 * GiB,
                "cores": 112,
                "cpu_adam_gbps": 320.0,
                "pcie_gbps": 48.0,
            }
        )
    )
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", str(spec), "--capacity", str(cap), "--json"]) == 0
    machine = json.loads(out.getvalue())["machine"]
    assert (machine["cores"], machine["host_memory_bytes"], machine["cpu_adam_gbps"]) == (14, 256 * GiB, 40.0)
    assert machine["sources"]["cores"] == "measured (--capacity)" and machine["pcie_gbps"] == 48.0
    assert main(["plan", str(spec), "--gpu", "a100"]) == 2


def test_auto_picks_the_fastest_mode_that_fits(models: dict[str, Path]) -> None:
    h200 = Machine.for_gpu("h200")
    small = plan_spec(_spec(models["3b"], hyperparameters=HP), h200, num_examples=1000)
    assert small.settings.mode == "device" and small.fits
    assert small.modes["device"].step_seconds < min(
        small.modes["zenflow"].step_seconds, small.modes["offload"].step_seconds
    )
    # an 8B full fine-tune: device mode needs 20 B/param with its fp32 gradient copies at the step
    # (DeepSpeed's estimator says 149.6 GiB for 8.03B params), over the 126.4 GiB usable
    big = plan_spec(_spec(models["8b"], hyperparameters=HP), h200, num_examples=1000)
    dev = big.modes["device"]
    assert not dev.fits and dev.device_bytes >= 8_030_261_248 * 20 - 2 * GiB
    assert big.settings.mode == "zenflow" and big.fits
    assert big.reasons[0].startswith("engine.mode auto -> zenflow: the fastest that fits; device mode needs")


def test_zenflow_pays_for_its_column_work(models: dict[str, Path]) -> None:
    """At 32 cores the CPU work is hidden; with the same micro-batch zenflow's GPU time includes the
    selected columns' AdamW, the gathers, scatters and merges, so it is not predicted faster than device
    mode, and auto keeps device mode while its optimizer state fits."""
    h200 = Machine.for_gpu("h200", cores=32)
    hp = {**HP, "micro_batch_size": 4, "gradient_checkpointing": False}
    shape = model_shape(str(models["3b"]), None)
    for acc in ("host", "device"):
        plan = plan_spec(
            _spec(models["3b"], hyperparameters=hp, engine={"accumulate_on": acc}), h200, num_examples=1000
        )
        dev, zen = plan.modes["device"], plan.modes["zenflow"]
        assert dev.fits and zen.fits and plan.settings.mode == "device"
        assert dev.step_seconds <= zen.step_seconds * 1.01, acc
        compute = compute_seconds(
            shape,
            h200,
            tokens=8 * 2048,
            micro_tokens=4 * 2048,
            seq=2048,
            checkpointing=False,
        )
        columns = 0.25 * shape.trainable_params * DEVICE_ADAM_BYTES_PER_PARAM / (h200.gpu_memory_gbps * 1e9)
        assert zen.gpu_seconds > compute + columns  # the column AdamW and more are charged
    # auto's choice when the micro-batches differ: zenflow must be MODE_MIN_GAIN faster to be taken
    free = plan_spec(
        _spec(models["3b"], hyperparameters=HP, engine={"accumulate_on": "device"}), h200, num_examples=1000
    )
    if free.settings.mode != "device":
        assert (
            free.modes[free.settings.mode].step_seconds
            < (1 - MODE_MIN_GAIN) * free.modes["device"].step_seconds
        )


def test_an_l4_full_fine_tune_is_told_to_use_lora_which_was_planned(models: dict[str, Path]) -> None:
    l4 = Machine.for_gpu("l4")
    plan = plan_spec(_spec(models["8b"], hyperparameters=HP), l4, num_examples=1000)
    assert not plan.fits
    first = plan.problems[0]
    # more GPUs (sharded weights) lose the user the least, then LoRA; shorter sequences are not needed
    assert first.loc == ("resources", "gpus") and "max_seq_length" not in first.message
    assert "use LoRA (hyperparameters.lora: {r: 16}) (planned: fits in device mode" in first.message
    lora = plan_spec(_spec(models["8b"], hyperparameters={**HP, "lora": {"r": 16}}), l4, num_examples=1000)
    assert lora.fits and f"device {lora.device_bytes / GiB:.1f} GiB" in first.message
    # accumulate_on device does not fit the L4's 32 GiB host: not offered
    assert all("accumulate_on device" not in p.message for p in plan.problems)


def test_no_single_setting_fits_says_why(models: dict[str, Path]) -> None:
    tiny = Machine.for_gpu("l4", gpu_memory_bytes=4 * GiB, host_memory_bytes=8 * GiB)
    plan = plan_spec(_spec(models["8b"], hyperparameters=HP), tiny, num_examples=1000)
    assert not plan.fits and "no single setting fits this box:" in plan.problems[0].message
    assert "use LoRA (hyperparameters.lora: {r: 16}): still needs device" in plan.problems[0].message
    # LoRA does not fit either, so the field named is the model, not hyperparameters.lora
    assert plan.problems[0].loc == ("model",)


def test_reserves_are_kept_and_stated(models: dict[str, Path]) -> None:
    # 128 GiB: with a checkpoint's peak counted (the embedding in fp32, 2 GiB for 8B: the rest is
    # streamed), accumulate_on device needs 113.4 GiB of the 121.6 usable, host accumulation 128.4
    m = Machine.for_gpu("h200", host_memory_bytes=128 * GiB)
    plan = plan_spec(_spec(models["8b"], hyperparameters=HP), m, num_examples=1000)
    assert (
        plan.host_reserve_bytes == int(0.05 * 128 * GiB)
        and plan.host_capacity_bytes == 128 * GiB - plan.host_reserve_bytes
    )
    assert plan.device_reserve_bytes == m.gpu_memory_bytes - plan.device_capacity_bytes > 0
    # host accumulation's 128.4 GiB does not "fit" a 128 GiB host
    assert plan.modes["zenflow"].host_bytes > plan.host_capacity_bytes and not plan.modes["zenflow"].fits
    assert (
        plan.settings.mode == "offload"
        and "(zenflow needs 128.4 GiB of host memory, 121.6 GiB is usable)" in plan.reasons[0]
    )
    # and the accumulator that lets zenflow fit is named, with its predicted speed
    assert any(
        r.startswith("engine.accumulate_on device would fit and run") and "in zenflow mode (vs offload)" in r
        for r in plan.reasons
    )


def test_a_host_shortfall_names_the_accumulator_only_when_it_is_the_fix(models: dict[str, Path]) -> None:
    """A full fine-tune's host memory is its optimizer state, not the accumulators: on an L4 with 8 GiB of
    host, where no single change fits, no problem says engine.accumulate_on (the device accumulator
    still needs 122 GiB of host), every problem points at the model; where accumulating on the device
    does bring the host within its memory (an H200 with 128 GiB, zenflow asked for), it is named."""
    tiny_host = Machine.for_gpu("l4", host_memory_bytes=8 * GiB)
    plan = plan_spec(_spec(models["8b"], hyperparameters=HP), tiny_host, num_examples=1000)
    assert not plan.fits and len(plan.problems) == 2
    assert [p.loc for p in plan.problems] == [("model",), ("model",)]
    host = plan.problems[1]
    assert (
        "of host memory" in host.message and "no single setting fits: see the first problem" in host.message
    )
    assert "set engine.accumulate_on device: still needs" in plan.problems[0].message  # planned, not enough

    m = Machine.for_gpu("h200", host_memory_bytes=128 * GiB)
    asked = _spec(models["8b"], hyperparameters=HP, engine={"mode": "zenflow", "accumulate_on": "host"})
    raw = plan_spec(asked, m, num_examples=1000, advise=False)  # the problem's own field, before the fixes
    assert [p.loc for p in raw.problems] == [("engine", "accumulate_on")]
    fixed = plan_spec(asked, m, num_examples=1000)
    assert "set engine.accumulate_on device (planned: fits in zenflow mode" in fixed.problems[0].message


def test_when_nothing_fits_the_plan_does_not_show_a_mode_as_chosen(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """LoRA 8B on an L4 with 16 GiB of host fits in no mode: the figures are the closest mode's, said as
    such, never "engine.mode auto -> zenflow" or a bare "mode zenflow" as if it were the job's."""
    from trainer.plan.cli import format_plan

    l4 = Machine.for_gpu("l4", host_memory_bytes=16 * GiB)
    lora = plan_spec(_spec(models["8b"], hyperparameters={**HP, "lora": {"r": 16}}), l4, num_examples=1000)
    assert not lora.fits and not any(m.fits for m in lora.modes.values())
    text = format_plan(lora)
    settings = next(line for line in text.splitlines() if line.startswith("settings"))
    assert settings.startswith(f"settings     none fits; the closest: mode {lora.settings.mode},")
    assert not any(r.startswith("engine.mode auto ->") for r in lora.reasons)
    assert any(r.startswith("engine.mode auto: no mode fits") and "not a choice" in r for r in lora.reasons)
    fits = plan_spec(_spec(models["8b"], hyperparameters={**HP, "lora": {"r": 16}}), Machine.for_gpu("l4"))
    assert fits.fits and "settings     mode " in format_plan(fits)


def test_the_plan_prints_no_library_warning_above_it(
    models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """transformers' FutureWarning for a config.json's ``rope_scaling`` (every Llama 3 and Qwen folder has
    one) is raised while the plan reads the config: it is not printed; the spec's own deprecation (a
    top-level ``lora``) still is, after the plan."""
    import warnings

    from api.cli.main import main  # `zenflow plan`
    from trainer.plan import shapes

    real = shapes._config_of

    def config_with_rope_scaling(model: str) -> object:
        config = real(model)
        config.rope_scaling = config.rope_parameters  # transformers warns FutureWarning here
        return config

    monkeypatch.setattr(shapes, "_config_of", config_with_rope_scaling)
    (tmp_path / "train.jsonl").write_text("{}\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"model: {models['3b']}\ntraining_file: train.jsonl\nlora: {{r: 8}}\n"
        "hyperparameters: {batch_size: 8, max_seq_length: 512}\n"
    )
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        assert main(["plan", str(spec), "--gpu", "h100", "--num-examples", "100"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("model ") and not escaped, [str(w.message) for w in escaped]
    assert "rope_scaling" not in err and "FutureWarning" not in err
    assert err.strip().splitlines() == [
        f"zenflow plan: warning: {spec}: top-level 'lora' is deprecated; put it under 'hyperparameters:' as "
        "'lora:' (the same place as in the API)"
    ]
