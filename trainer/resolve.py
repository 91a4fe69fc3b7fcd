"""Deciding a job: its request (a :class:`~trainer.spec.JobSpec`) becomes a :class:`contract.job.Resolution`,
every value concrete and each with its source. This is the one module where ``auto`` and unset settings
become values; everything downstream (the plan's query, the run, the engine, the job object) reads the
resolution.

The rules, by source:

- ``data`` (the training examples, counted after the data options drop some): ``n_epochs`` 3, raised so
  that epochs x examples >= 100 (at most 25 epochs), lowered so that it stays <= 25,000 (at least 1);
  ``batch_size`` 1% of the examples, at least 4, at most :data:`AUTO_BATCH_MAX`, never more than there
  are; ``warmup`` 5% of the steps; ``eval_every`` about 10 evaluations per run with a validation file
  (none without); ``checkpoint_every`` about 5 checkpoints per run (and one at the end);
- ``model``: the learning rate (the base model's default for full fine-tuning or LoRA, times the
  multiplier), ``max_seq_length`` (its position limit, at most 2048), and a built-in model's measured
  zenflow knobs where the request gives none (left out where they would conflict with what it gives);
- ``plan`` (:func:`trainer.plan.planner.plan_job` for the machine): the engine mode, the accumulator,
  sharded weights, zenflow's landing buffers, the micro-batch size and activation checkpointing. Without a
  plan (a model whose config the plan cannot read) these take their ``default``: zenflow, the host
  accumulator, replicated weights, landing buffers kept, one micro-batch per step, no checkpointing;
- ``default``: the contract's field defaults; packing off unless asked (never for DPO); DPO's beta
  :data:`trainer.method.dpo.AUTO_DPO_BETA`; one rank never shards; bfloat16 on a GPU, float32 on a CPU;
- ``resume``: a run that resumes keeps its checkpoint's engine mode and accumulator (:class:`Pins`).

A job is resolved once, at create, for the machine its plan fits (:func:`resolve`). A run decides again
only when :func:`reason_to_decide_again` finds one (another machine, other data counts, a checkpoint that
pins another mode): :func:`for_run` then records a new resolution beside the first.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

from pydantic import ValidationError

from contract.engine import Accumulator, EngineKnobs, EngineMode, ResolvedEngine
from contract.hyperparameters import HyperparametersRequest, ResolvedHyperparameters, RuntimeChoices
from contract.job import PlanOutcome, Resolution, ResolvedJob, Source
from contract.method import (
    DpoMethod,
    ReinforcementMethod,
    ResolvedDpo,
    ResolvedMethod,
    ResolvedReinforcement,
    ResolvedSupervised,
)
from contract.values import MAX_COUNT, Dtype
from trainer.plan.gpus import Machine
from trainer.plan.query import PlanQuery
from trainer.plan.records import Plan
from trainer.plan.rollout import RolloutQuery
from trainer.spec import JobSpec

#: The largest batch size ``auto`` resolves to.
AUTO_BATCH_MAX = 32
#: The longest ``max_seq_length`` ``auto`` resolves to (the model's position limit when shorter).
AUTO_MAX_SEQ_LENGTH = 2048
#: Examples the plan assumes when the training file is not counted yet (``batch_size: auto`` then
#: resolves to its largest).
ASSUMED_NUM_EXAMPLES = 3200


class Counts(NamedTuple):
    """The training data as counted: examples that train (after drops) and their tokens (None: not counted)."""

    num_examples: int
    num_tokens: int | None = None


class Pins(NamedTuple):
    """What a resumed run keeps from its checkpoint: the engine mode and, for zenflow, the accumulator
    (the window's gradients are in it)."""

    mode: EngineMode
    accumulate_on: Accumulator | None = None


class _Sourced:
    """Values being decided and where each came from."""

    def __init__(self) -> None:
        self.sources: dict[str, Source] = {}

    def pick(self, path: str, given: Any, fallback: Any, source: Source, *, asked: bool = True) -> Any:
        """``given`` unless it is ``auto``, then ``fallback`` from ``source``; a value given is the
        request's when it asked for it (``asked``), else the contract's default."""
        if given == "auto":
            self.sources[path] = source
            return fallback
        self.sources[path] = "request" if asked else "default"
        return given


# --- hyperparameters ------------------------------------------------------------------------------


def max_seq_length(model: str, hp: HyperparametersRequest) -> int:
    """The tokens of one example (the data's cut) of a job on ``model``, which no example count changes."""
    from trainer.model.catalog import model_max_length

    given = hp.max_seq_length
    return given if isinstance(given, int) else min(model_max_length(model), AUTO_MAX_SEQ_LENGTH)


def completion_budget(spec: JobSpec) -> int:
    """The tokens a reinforcement job's completion may have (0 for the other methods): a prompt and the
    completion sampled after it are one row of at most max_seq_length."""
    if not isinstance(spec.method, ReinforcementMethod):
        return 0
    return _completion_tokens(spec.method, max_seq_length(spec.model, spec.hyperparameters))


def example_budget(spec: JobSpec) -> int:
    """The tokens an example may have: max_seq_length, less a reinforcement job's completion."""
    return max_seq_length(spec.model, spec.hyperparameters) - completion_budget(spec)


def _epochs(given: int | str, num_examples: int) -> int:
    if isinstance(given, int):
        return given
    n_epochs = 3
    if n_epochs * num_examples < 100:
        return min(25, math.ceil(100 / num_examples))
    if n_epochs * num_examples > 25_000:
        return max(1, 25_000 // num_examples)
    return n_epochs


def _warmup(given: int | float | str, total: int) -> int:
    if given == "auto":
        return min(round(0.05 * total), total)
    if isinstance(given, float):
        return min(round(given * total), total)
    return min(int(given), total)


def resolve_hyperparameters(
    spec: JobSpec,
    num_examples: int,
    runtime: RuntimeChoices | None = None,
    *,
    runtime_source: Source = "plan",
) -> tuple[ResolvedHyperparameters, dict[str, Source]]:
    """The hyperparameters for ``num_examples`` training examples, with ``runtime`` (the plan's choices)
    for the runtime fields the request leaves to it; raises ValueError when there would be more steps
    than a job can run."""
    from trainer.model.catalog import default_learning_rate

    if num_examples < 1:
        raise ValueError("num_examples must be >= 1")
    hp, s = spec.hyperparameters, _Sourced()
    given = hp.model_fields_set
    n_epochs = s.pick("n_epochs", hp.n_epochs, _epochs(hp.n_epochs, num_examples), "data")
    auto_batch = min(num_examples, max(4, min(AUTO_BATCH_MAX, num_examples // 100)))
    batch = s.pick("batch_size", hp.batch_size, auto_batch, "data")
    batch = min(int(batch), num_examples)
    base_lr = default_learning_rate(spec.model, lora=spec.lora is not None)
    lr = s.pick("learning_rate", hp.learning_rate, base_lr, "model")
    mult = s.pick("learning_rate_multiplier", hp.learning_rate_multiplier, 1.0, "default")
    steps_per_epoch = math.ceil(num_examples / batch)
    total = (
        n_epochs * steps_per_epoch if hp.max_steps is None else min(n_epochs * steps_per_epoch, hp.max_steps)
    )
    if total > MAX_COUNT:
        raise ValueError(f"{total} training steps: more than a job can run ({MAX_COUNT})")
    s.sources["warmup_steps"] = "data" if hp.warmup == "auto" else "request"
    auto_eval = max(1, math.ceil(total / 10)) if spec.validation_file is not None else None
    eval_every = s.pick("eval_every", hp.eval_every, auto_eval, "data")
    ckpt = s.pick("checkpoint_every", hp.checkpoint_every, max(1, math.ceil(total / 5)), "data")
    for name in ("lr_scheduler", "min_lr_ratio", "seed", "truncation", "system_message", "lora", "max_steps"):
        s.sources[name] = "request" if name in given else "default"
    s.sources["max_seq_length"] = "request" if isinstance(hp.max_seq_length, int) else "model"
    s.sources.update(dict.fromkeys(("num_examples", "steps_per_epoch", "total_steps"), "data"))
    s.sources["base_learning_rate"] = "model" if hp.learning_rate == "auto" else "request"
    chosen = _runtime(spec, batch, runtime, s, runtime_source)
    resolved = ResolvedHyperparameters(
        n_epochs=n_epochs,
        batch_size=batch,
        learning_rate=float(lr) * float(mult),
        base_learning_rate=float(lr),
        learning_rate_multiplier=float(mult),
        warmup_steps=_warmup(hp.warmup, total),
        lr_scheduler=hp.lr_scheduler,
        min_lr_ratio=hp.min_lr_ratio,
        max_seq_length=max_seq_length(spec.model, hp),
        eval_every=eval_every,
        checkpoint_every=int(ckpt),
        seed=hp.seed,
        num_examples=num_examples,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        truncation=hp.truncation,
        system_message=hp.system_message,
        lora=hp.lora,
        **chosen.model_dump(),
    )
    return resolved, {f"hyperparameters.{k}": v for k, v in s.sources.items()}


def _runtime(
    spec: JobSpec, batch: int, planned: RuntimeChoices | None, s: _Sourced, source: Source
) -> RuntimeChoices:
    """The runtime choices: the request's, else the plan's (``planned``), else one micro-batch per step
    without checkpointing; packing off unless asked, never for DPO (each completion is one row)."""
    hp = spec.hyperparameters
    fallback = planned or RuntimeChoices(micro_batch_size=batch, gradient_checkpointing=False, packing=False)
    how: Source = source if planned is not None else "default"
    micro = s.pick("micro_batch_size", hp.micro_batch_size, fallback.micro_batch_size, how)
    ckpt = s.pick("gradient_checkpointing", hp.gradient_checkpointing, fallback.gradient_checkpointing, how)
    packing = s.pick("packing", hp.packing, False, "default") and spec.method.type == "supervised"
    return RuntimeChoices(
        micro_batch_size=min(int(micro), batch), gradient_checkpointing=ckpt, packing=packing
    )


# --- the engine and the method --------------------------------------------------------------------


def engine_knobs(spec: JobSpec) -> tuple[EngineKnobs, dict[str, Source]]:
    """The engine's knobs: the request's, then the model's own defaults (each left out where it would
    conflict with what the request gives), then the contract's defaults."""
    from trainer.model.catalog import model_engine_defaults

    knob_names = set(EngineKnobs.model_fields)
    given = {k: getattr(spec.engine, k) for k in spec.engine.model_fields_set & knob_names}
    merged, from_model = dict(given), []
    for key, value in model_engine_defaults(spec.model).items():
        if key in given or key not in knob_names:
            continue
        try:
            EngineKnobs.model_validate({**merged, key: value})
        except ValidationError:
            continue  # conflicts with what the job gave: the job is never refused for a value it did not give
        merged[key] = value
        from_model.append(key)
    knobs = EngineKnobs.model_validate(merged)
    sources: dict[str, Source] = {
        f"engine.{k}": "request" if k in given else "model" if k in from_model else "default"
        for k in knob_names
    }
    return knobs, sources


def resolve_method(spec: JobSpec) -> tuple[ResolvedMethod, dict[str, Source]]:
    """The method with its own settings concrete (DPO's beta: ``auto`` is the method's default)."""
    m = spec.method
    if isinstance(m, DpoMethod):
        from trainer.method.dpo import AUTO_DPO_BETA

        beta = AUTO_DPO_BETA if m.beta == "auto" else float(m.beta)
        return ResolvedDpo(beta=beta), {"method.beta": "default" if m.beta == "auto" else "request"}
    if isinstance(m, ReinforcementMethod):
        return _reinforcement(m, max_seq_length(spec.model, spec.hyperparameters), lora=spec.lora is not None)
    return ResolvedSupervised(), {}


#: What a reinforcement job's ``auto`` settings resolve to (trainer.method.reinforcement's rules).
AUTO_RL = {
    "compute_multiplier": 1.0,
    "eval_samples": 4,
    "max_completion_tokens": 256,
    "temperature": 1.0,
    "kl_beta": 0.0,
}
#: Completions per prompt at compute_multiplier 1 (a GRPO group: its advantages are normalised within it).
SAMPLES_PER_UNIT_COMPUTE = 8


def _completion_tokens(m: ReinforcementMethod, seq_len: int) -> int:
    """``max_completion_tokens``: the request's or auto's, at most half of max_seq_length."""
    given = m.max_completion_tokens
    tokens = AUTO_RL["max_completion_tokens"] if given == "auto" else given
    return min(int(tokens), max(1, seq_len // 2))


def _reinforcement(
    m: ReinforcementMethod, seq_len: int, *, lora: bool
) -> tuple[ResolvedReinforcement, dict[str, Source]]:
    """A reinforcement job's settings: ``auto`` from :data:`AUTO_RL`; a completion gets at most half of
    max_seq_length (the prompt the rest); a KL penalty needs LoRA (its reference is the adapter disabled)."""
    s = _Sourced()
    vals = {k: s.pick(f"method.{k}", getattr(m, k), auto, "default") for k, auto in AUTO_RL.items()}
    if float(vals["kl_beta"]) > 0 and not lora:
        raise ValueError(
            "method.kl_beta: a KL penalty needs LoRA (the reference is the base with the adapter "
            "disabled); a full fine-tune would need a second copy of the weights: set kl_beta to 0 or "
            "add hyperparameters.lora"
        )
    vals["max_completion_tokens"] = _completion_tokens(m, seq_len)
    n = min(64, max(2, round(SAMPLES_PER_UNIT_COMPUTE * float(vals["compute_multiplier"]))))
    s.sources["method.samples_per_prompt"] = s.sources["method.compute_multiplier"]
    resolved = ResolvedReinforcement(
        grader=m.grader, reasoning_effort=m.reasoning_effort, samples_per_prompt=n, **vals
    )
    return resolved, s.sources


def _free(value: Any) -> Any:
    """A request's value as the plan's query takes it: None for ``auto`` (the plan's to choose)."""
    return None if value == "auto" else value


def plan_query(spec: JobSpec, counts: Counts | None = None, pins: Pins | None = None) -> PlanQuery:
    """The plan's view of ``spec``: its values (hyperparameters resolved for ``counts``; assumed counts
    when None) and the choices it leaves to the plan (None), a resumed run's ``pins`` fixed."""
    n = counts.num_examples if counts is not None else ASSUMED_NUM_EXAMPLES
    hp = spec.hyperparameters
    try:
        batch = resolve_hyperparameters(spec, n)[0].batch_size
    except ValueError:  # too many steps: the limits report it; plan one step's memory anyway
        batch = min(n, AUTO_BATCH_MAX) if hp.batch_size == "auto" else int(hp.batch_size)
    mode, acc = _free(spec.engine.mode), _free(spec.engine.accumulate_on)
    if pins is not None:
        mode, acc = pins.mode, pins.accumulate_on or acc
    return PlanQuery(
        model=spec.model,
        lora=spec.lora,
        method=spec.method.type,
        batch_size=batch,
        max_seq_length=max_seq_length(spec.model, hp),
        num_examples=n,
        num_tokens=counts.num_tokens if counts is not None else None,
        resources=spec.resources,
        knobs=engine_knobs(spec)[0],
        dtype=_free(spec.dtype),
        packing=hp.packing is True,
        mode=mode,
        micro_batch_size=_free(hp.micro_batch_size),
        gradient_checkpointing=_free(hp.gradient_checkpointing),
        accumulate_on=acc,
        shard_params=_free(spec.engine.shard_params),
        rollout=_rollout_query(spec),
    )


def _rollout_query(spec: JobSpec) -> RolloutQuery | None:
    """A reinforcement job's sampling per prompt as its resolution will have it (None: another method)."""
    if not isinstance(spec.method, ReinforcementMethod):
        return None
    try:
        m, _ = resolve_method(spec)
    except ValueError:  # a KL penalty without LoRA: refused when resolved; the plan counts no rollout
        return None
    assert isinstance(m, ResolvedReinforcement)
    return RolloutQuery(m.samples_per_prompt, m.max_completion_tokens)


def plan_spec(
    spec: JobSpec,
    machine: Machine,
    *,
    num_examples: int | None = None,
    num_tokens: int | None = None,
    advise: bool = True,
) -> Plan:
    """The plan of ``spec`` on ``machine`` for the training data's counts (None: not counted; see
    :func:`plan_query`)."""
    from trainer.plan.planner import plan_job

    counts = Counts(num_examples, num_tokens) if num_examples else None
    return plan_job(plan_query(spec, counts), machine, advise=advise)


def _engine(spec: JobSpec, plan: Plan | None, pins: Pins | None, s: _Sourced) -> ResolvedEngine:
    """The engine's settings: the knobs, then each choice from the request, the checkpoint, the plan."""
    knobs, sources = engine_knobs(spec)
    s.sources.update(sources)
    e, world = spec.engine, spec.resources.world_size
    chosen = plan.settings if plan is not None else None
    how: Source = "plan" if chosen is not None else "default"
    mode = s.pick("engine.mode", e.mode, chosen.mode if chosen else "zenflow", how)
    acc = s.pick(
        "engine.accumulate_on",
        e.accumulate_on,
        chosen.accumulate_on if chosen else "host",
        how,
        asked="accumulate_on" in e.model_fields_set,
    )
    if pins is not None:
        mode, s.sources["engine.mode"] = pins.mode, "resume"
        if pins.accumulate_on is not None:
            acc, s.sources["engine.accumulate_on"] = pins.accumulate_on, "resume"
    shard = s.pick("engine.shard_params", e.shard_params, bool(chosen and chosen.shard_params), how)
    if world == 1:
        shard, s.sources["engine.shard_params"] = False, "default"
    landing = chosen.landing_buffers if chosen is not None else True
    s.sources["engine.landing_buffers"] = how
    return ResolvedEngine(
        **knobs.model_dump(), mode=mode, accumulate_on=acc, shard_params=shard, landing_buffers=landing
    )


def _dtype(spec: JobSpec, machine: Machine | None) -> tuple[Dtype, Source]:
    if spec.dtype != "auto":
        return spec.dtype, "request"
    return ("bfloat16" if machine is not None and machine.device_type == "cuda" else "float32"), "default"


def _outcome(plan: Plan) -> PlanOutcome:
    return PlanOutcome(
        fits=plan.fits,
        summary=plan.summary(),
        step_seconds=plan.step_seconds,
        device_bytes=plan.device_bytes,
        host_bytes=plan.host_bytes,
    )


def resolve(
    spec: JobSpec,
    machine: Machine | None,
    counts: Counts,
    *,
    at: Literal["create", "run"],
    reason: str,
    pins: Pins | None = None,
    plan: Plan | None = None,
) -> tuple[Resolution, Plan | None]:
    """The job's resolution for ``machine`` and the training data's ``counts`` (``pins``: a resumed run's),
    and the plan it took its choices from (None: no machine, or a config the plan cannot read: the
    choices take their defaults). ``plan``: one already made for this machine and these counts."""
    if plan is None and machine is not None:
        plan = _plan_or_none(spec, machine, counts, pins)
    s = _Sourced()
    engine = _engine(spec, plan, pins, s)
    runtime = plan.settings if plan is not None else None
    planned = (
        RuntimeChoices(
            micro_batch_size=runtime.micro_batch_size,
            gradient_checkpointing=runtime.gradient_checkpointing,
            packing=runtime.packing,
        )
        if runtime is not None
        else None
    )
    hp, hp_sources = resolve_hyperparameters(spec, counts.num_examples, planned)
    method, method_sources = resolve_method(spec)
    dtype, dtype_source = _dtype(spec, machine)
    resources_sources: dict[str, Source] = {
        f"resources.{k}": "request" if k in spec.resources.model_fields_set else "default"
        for k in ("gpus", "nodes")
    }
    job = ResolvedJob(
        method=method,
        hyperparameters=hp,
        engine=engine,
        resources=spec.resources,
        dtype=dtype,
        sources={**hp_sources, **s.sources, **method_sources, **resources_sources, "dtype": dtype_source},
    )
    resolution = Resolution(
        at=at,
        reason=reason,
        machine=machine.model_dump(mode="json") if machine is not None else None,
        num_examples=counts.num_examples,
        num_tokens=counts.num_tokens,
        plan=_outcome(plan) if plan is not None else None,
        job=job,
    )
    return resolution, plan


def _plan_or_none(spec: JobSpec, machine: Machine, counts: Counts, pins: Pins | None) -> Plan | None:
    from trainer.plan.planner import plan_job

    try:
        return plan_job(plan_query(spec, counts, pins), machine, advise=False)
    except (ValueError, OSError):  # a config the plan cannot read: the choices take their defaults
        return None


# --- deciding again -------------------------------------------------------------------------------


def _machine_text(record: dict[str, Any] | None) -> str:
    if not record:
        return "no machine"
    gib = record.get("host_memory_bytes", 0) / 2**30
    return f"{record.get('gpu_name')}, {gib:.1f} GiB host, {record.get('cores')} cores"


def reason_to_decide_again(
    given: Resolution, machine: Machine | None, counts: Counts | None, pins: Pins | None
) -> str | None:
    """Why ``given`` no longer holds for this run (None: it does): another machine than the one it was
    planned for, other data counts, a checkpoint that ran in another mode or with another accumulator."""
    if machine is not None and given.machine != machine.model_dump(mode="json"):
        return f"planned for {_machine_text(given.machine)}; this worker is {_machine_text(machine.model_dump())}"
    if counts is not None and counts.num_examples != given.num_examples:
        return f"the training data counts {counts.num_examples} examples here, {given.num_examples} when resolved"
    engine = given.job.engine
    if pins is not None and pins.mode != engine.mode:
        return f"the checkpoint to resume ran in {pins.mode} mode, not {engine.mode}"
    if (
        pins is not None
        and pins.accumulate_on not in (None, engine.accumulate_on)
        and engine.mode == "zenflow"
    ):
        return f"the checkpoint to resume accumulates on the {pins.accumulate_on}, not the {engine.accumulate_on}"
    return None


def for_run(
    spec: JobSpec,
    given: Resolution | None,
    machine: Machine | None,
    counts: Counts,
    pins: Pins | None = None,
) -> tuple[Resolution, Plan | None, bool]:
    """The resolution a run uses: ``given`` while it holds (:func:`reason_to_decide_again`), else a new
    one for this run; and whether it is new (the caller records it beside the first)."""
    if given is not None:
        why = reason_to_decide_again(given, machine, counts, pins)
        if why is None:
            return given, None, False
    else:
        why = "the run started without a resolution (a job run from its spec)"
    resolution, plan = resolve(spec, machine, counts, at="run", reason=why, pins=pins)
    return resolution, plan, True
