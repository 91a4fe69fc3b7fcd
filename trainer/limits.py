"""The service's limits of one job, checked when it is created (the API; ``zenflow train`` checks the
model's part): :class:`JobLimits`, the configurable maxima, and :func:`limit_errors`, the values over
them and those that would only fail once the job runs (the learning rate, LoRA target modules, a
sequence too short for one example, max_seq_length over the model's position limit:
:func:`model_limit_errors`). Each refusal is a :class:`LimitError` naming the field. The bounds of one
example of the data (messages, characters, tokens: :meth:`JobLimits.examples`) are checked with the
data (trainer.data.dataset.validate_file), each over one a line's error."""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from contract.hyperparameters import HyperparametersRequest
from contract.values import MAX_COUNT
from trainer.data.dataset import ExampleLimits
from trainer.spec import JobSpec

#: Messages of one chat example: a longer conversation is refused (its line named), so that no single
#: line holds a check for long (ZENFLOW_MAX_EXAMPLE_MESSAGES).
MAX_EXAMPLE_MESSAGES = 2048
#: Characters of one line of a data file (ZENFLOW_MAX_EXAMPLE_CHARS).
MAX_EXAMPLE_CHARS = 2_000_000
#: Tokens of one rendered example before truncation (ZENFLOW_MAX_EXAMPLE_TOKENS): 8 x the longest
#: max_seq_length this server takes by default; longer examples are cut to max_seq_length anyway.
MAX_EXAMPLE_TOKENS = 262_144


class JobLimits(BaseModel):
    """Configurable maxima of one job (the service sets them from its settings; see :func:`limit_errors`)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    max_n_epochs: int = Field(10_000, ge=1, le=MAX_COUNT)
    max_batch_size: int = Field(4096, ge=1, le=MAX_COUNT)
    #: Shortest max_seq_length: below it no chat template holds one prompt and its answer.
    min_seq_length: int = Field(32, ge=2, le=MAX_COUNT)
    max_seq_length: int = Field(32_768, ge=2, le=MAX_COUNT)
    #: Training steps of one job, after its data is counted (n_epochs x steps per epoch, or max_steps).
    max_total_steps: int = Field(1_000_000, ge=1, le=MAX_COUNT)
    #: Token positions one job may process: total steps x batch size x max_seq_length.
    max_total_tokens: int = Field(100_000_000_000, ge=1)
    max_learning_rate: float = Field(1.0, gt=0)
    max_lora_rank: int = Field(256, ge=1, le=65_536)
    max_example_messages: int = Field(MAX_EXAMPLE_MESSAGES, ge=1, le=MAX_COUNT)
    max_example_chars: int = Field(MAX_EXAMPLE_CHARS, ge=1, le=MAX_COUNT)
    max_example_tokens: int = Field(MAX_EXAMPLE_TOKENS, ge=1, le=MAX_COUNT)

    def examples(self) -> ExampleLimits:
        """The bounds of one example of the job's data (checked with the data, a line's error each)."""
        return ExampleLimits(self.max_example_messages, self.max_example_chars, self.max_example_tokens)


class LimitError(NamedTuple):
    """One refused value: where it is in the spec (``("hyperparameters", "n_epochs")``) and why."""

    loc: tuple[str, ...]
    message: str


def _steps_loc(hp: HyperparametersRequest) -> tuple[str, ...]:
    """The field to blame for too many steps: max_steps when given, else n_epochs."""
    return ("hyperparameters", "max_steps" if hp.max_steps is not None else "n_epochs")


def model_limit_errors(spec: JobSpec) -> list[LimitError]:
    """``max_seq_length`` (given, or as ``auto`` resolves) over the model's position limit
    (trainer.model.catalog.model_max_length): a longer sequence crashes mid-run (learned position embeddings,
    GPT-2) or trains past what the model was made for (RoPE, Llama)."""
    from trainer.model.catalog import model_max_length
    from trainer.resolve import max_seq_length

    model_max = model_max_length(spec.model)
    given = spec.hyperparameters.max_seq_length
    length = max_seq_length(spec.model, spec.hyperparameters)
    if length <= model_max:
        return []
    what = "must be" if isinstance(given, int) else f"resolves to {length}; it must be"
    return [
        LimitError(
            ("hyperparameters", "max_seq_length"),
            f"{what} at most {model_max}, the model's maximum sequence length (its position limit)",
        )
    ]


def limit_errors(spec: JobSpec, limits: JobLimits, *, num_examples: int | None = None) -> list[LimitError]:
    """What in ``spec`` is over ``limits`` or would only fail once the job runs; empty when it may run.

    With ``num_examples`` (the training file's count) the totals are checked too: training steps,
    token positions and the resolved learning rate (the model's base rate times the multiplier).
    LoRA ``target_modules`` are matched against the model's modules (built on torch's meta device:
    no weights are read; see trainer.model.lora.lora_target_problems).
    """
    errors = (
        _value_errors(spec.hyperparameters, limits)
        + _length_errors(spec, limits)
        + _lora_errors(spec, limits)
    )
    if errors or num_examples is None:
        return errors
    return _total_errors(spec, limits, num_examples)


def _value_errors(hp: HyperparametersRequest, limits: JobLimits) -> list[LimitError]:
    """The values given over the server's maxima."""
    errors: list[LimitError] = []

    def check(field: str, value: object, maximum: float, what: str = "must be") -> None:
        if isinstance(value, int | float) and value > maximum:
            shown = f"{maximum:,}" if isinstance(maximum, int) else f"{maximum:g}"
            errors.append(LimitError(("hyperparameters", field), f"{what} at most {shown} on this server"))

    check("n_epochs", hp.n_epochs, limits.max_n_epochs)
    check("batch_size", hp.batch_size, limits.max_batch_size)
    for field in ("max_steps", "eval_every", "checkpoint_every"):
        check(field, getattr(hp, field), limits.max_total_steps)
    if isinstance(hp.warmup, int):
        check("warmup", hp.warmup, limits.max_total_steps, "warm-up steps must be")
    check("learning_rate", hp.learning_rate, limits.max_learning_rate)
    return errors


def _length_errors(spec: JobSpec, limits: JobLimits) -> list[LimitError]:
    """``max_seq_length`` under the server's minimum, over its maximum, or over the model's limit."""
    from trainer.model.catalog import model_max_length

    length = spec.hyperparameters.max_seq_length
    loc = ("hyperparameters", "max_seq_length")
    if isinstance(length, int) and length < limits.min_seq_length:
        return [
            LimitError(
                loc,
                f"must be at least {limits.min_seq_length}: a shorter sequence cannot hold one example's "
                "prompt and answer with the chat template",
            )
        ]
    if (
        isinstance(length, int)
        and limits.max_seq_length < length
        and limits.max_seq_length <= model_max_length(spec.model)
    ):
        return [
            LimitError(loc, f"must be at most {limits.max_seq_length:,} on this server")
        ]  # the lower limit
    return model_limit_errors(spec)


def _lora_errors(spec: JobSpec, limits: JobLimits) -> list[LimitError]:
    """A LoRA rank over the server's maximum; target modules the model does not have."""
    if spec.lora is None:
        return []
    errors = []
    if spec.lora.r > limits.max_lora_rank:
        errors.append(
            LimitError(
                ("hyperparameters", "lora", "r"), f"must be at most {limits.max_lora_rank} on this server"
            )
        )
    if isinstance(spec.lora.target_modules, list):
        from trainer.model.lora import lora_target_problems

        try:
            problems = lora_target_problems(spec.model, spec.lora.target_modules)
        except ValueError as exc:
            problems = [str(exc)]
        if problems:
            errors.append(LimitError(("hyperparameters", "lora", "target_modules"), "; ".join(problems)))
    return errors


def _total_errors(spec: JobSpec, limits: JobLimits, num_examples: int) -> list[LimitError]:
    """The resolved totals over the server's maxima: learning rate, sequence length, steps, tokens."""
    from trainer.resolve import resolve_hyperparameters

    hp = spec.hyperparameters
    try:
        r, sources = resolve_hyperparameters(spec, num_examples)
    except ValueError as exc:
        return [LimitError(_steps_loc(hp), str(exc))]
    errors = []
    if r.learning_rate > limits.max_learning_rate:
        given_mult = sources["hyperparameters.learning_rate_multiplier"] == "request"
        field = "learning_rate_multiplier" if given_mult else "learning_rate"
        errors.append(
            LimitError(
                ("hyperparameters", field),
                f"the learning rate ({r.base_learning_rate:g} x multiplier {r.learning_rate_multiplier:g} = "
                f"{r.learning_rate:g}) must be at most {limits.max_learning_rate:g}",
            )
        )
    if r.max_seq_length > limits.max_seq_length:
        errors.append(
            LimitError(
                ("hyperparameters", "max_seq_length"),
                f"resolves to {r.max_seq_length}, over this server's {limits.max_seq_length}: give a smaller value",
            )
        )
    if r.total_steps > limits.max_total_steps:
        errors.append(
            LimitError(
                _steps_loc(hp),
                f"{r.total_steps:,} training steps ({r.n_epochs} epochs x {r.steps_per_epoch} steps of batch size "
                f"{r.batch_size} over {num_examples} examples) is over this server's limit of "
                f"{limits.max_total_steps:,}: lower n_epochs or set max_steps",
            )
        )
    tokens = r.total_steps * r.batch_size * r.max_seq_length
    if not errors and tokens > limits.max_total_tokens:
        given = [f for f in ("max_seq_length", "batch_size", "max_steps") if isinstance(getattr(hp, f), int)]
        errors.append(
            LimitError(
                ("hyperparameters", given[0] if given else "n_epochs"),
                f"up to {tokens:,} token positions ({r.total_steps} steps x batch size {r.batch_size} x "
                f"max_seq_length {r.max_seq_length}) is over this server's limit of {limits.max_total_tokens:,}",
            )
        )
    return errors
