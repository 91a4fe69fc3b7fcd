"""A job's hyperparameters: as requested (:class:`HyperparametersRequest`, OpenAI's names where they exist,
each a value or ``auto``) and as resolved (:class:`ResolvedHyperparameters`, recorded in the job and in
every checkpoint so that a resumed run uses the same numbers).

The runtime hyperparameters (``micro_batch_size``, ``gradient_checkpointing``, ``packing``) change how a
step is computed, not what it computes (memory, speed and float rounding only): they are left out of
:meth:`ResolvedHyperparameters.training_signature`, so a checkpoint resumes under other runtime choices.
Every number is finite and bounded on construction (no count above ``MAX_COUNT``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from contract.lora import LoraSpec
from contract.values import MAX_COUNT, Auto

Scheduler = Literal["cosine", "linear", "constant"]
#: Examples over max_seq_length: "truncate" to it (as OpenAI does; one left without a learned token is
#: dropped), "drop" them, or "error" (the job fails naming the lines).
Truncation = Literal["truncate", "drop", "error"]
#: System (and developer) messages: "keep" them for the chat template, or "fold" them into the start of
#: the next user message (for templates without a system role, e.g. Gemma-2's).
SystemMessage = Literal["keep", "fold"]

#: The ResolvedHyperparameters fields that are runtime choices (not part of the training signature).
RUNTIME_FIELDS = frozenset({"micro_batch_size", "gradient_checkpointing", "packing"})


def _located(title: str, loc: str, message: str, value: object) -> ValidationError:
    return ValidationError.from_exception_data(
        title, [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=(loc,), input=value)]
    )


class HyperparametersRequest(BaseModel):
    """The requested hyperparameters (OpenAI's names where they exist), each a value or ``"auto"``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)

    n_epochs: int | Auto = "auto"
    """Passes over the training data; auto: 3, more for a small file (at least 100 examples seen), fewer for a large one."""
    batch_size: int | Auto = "auto"
    """Examples per optimizer step; auto: 1% of the examples, at least 4 and at most 32."""
    learning_rate: float | Auto = "auto"
    """The peak learning rate; auto: the base model's default (times learning_rate_multiplier)."""
    learning_rate_multiplier: float | Auto = "auto"
    """Scales the base model's default learning rate; auto: 1."""
    warmup: int | float | Auto = "auto"
    """Warm-up: an int is a number of steps, a float in [0, 1) a fraction of the total steps; auto: 5%."""
    lr_scheduler: Scheduler = "cosine"
    """The decay after warm-up."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The decayed learning rate ends at this fraction of the peak."""
    max_seq_length: int | Auto = "auto"
    """Tokens of one example (longer ones per ``truncation``); auto: the model's maximum, at most 2048."""
    max_steps: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Stop after this many steps in all (null: n_epochs full epochs)."""
    eval_every: int | Auto | None = "auto"
    """Validation loss every N steps (and at the end); null or 0 disables it; auto: about 10 per run with a validation file."""
    checkpoint_every: int | Auto = "auto"
    """A resumable checkpoint every N steps (and always at the end); auto: about 5 per run."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """The run's random seed (the order of the examples, a built-in model's initial weights, dropout)."""
    truncation: Truncation = "truncate"
    """Examples over max_seq_length: truncate, drop, or error (the job fails naming the lines)."""
    system_message: SystemMessage = "keep"
    """System (and developer) messages: keep them, or fold them into the next user message."""
    lora: LoraSpec | None = None
    """LoRA through peft (null: full fine-tuning)."""
    micro_batch_size: int | Auto = "auto"
    """Sequences per forward/backward (gradients accumulate up to batch_size); auto: the plan's choice."""
    gradient_checkpointing: bool | Auto = "auto"
    """Recompute activations in backward (less memory, about a third more compute); auto: the plan's choice."""
    packing: bool | Auto = "auto"
    """Pack examples into padding-free rows of max_seq_length (no attention across examples); auto: off."""

    @field_validator(
        "n_epochs",
        "batch_size",
        "max_seq_length",
        "max_steps",
        "eval_every",
        "checkpoint_every",
        "seed",
        "micro_batch_size",
        mode="before",
    )
    @classmethod
    def _no_bool(cls, v: object) -> object:
        # bool is an int subclass: True would silently become 1.
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("n_epochs", "batch_size", "max_seq_length", "checkpoint_every", "micro_batch_size")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_COUNT:
            raise ValueError(f"must be an integer in [1, {MAX_COUNT}] or 'auto'")
        return v

    @field_validator("learning_rate", "learning_rate_multiplier")
    @classmethod
    def _positive_float(cls, v: float | str) -> float | str:
        if not isinstance(v, str) and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v

    @field_validator("warmup")
    @classmethod
    def _warmup(cls, v: int | float | str) -> int | float | str:
        if isinstance(v, bool):
            raise ValueError("must be a number of steps, a ratio in [0, 1), or 'auto'")
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            raise ValueError(f"steps must be in [0, {MAX_COUNT}]")
        if isinstance(v, float) and not 0 <= v < 1:
            raise ValueError("a ratio must be in [0, 1); give an integer for a number of steps")
        return v

    @field_validator("eval_every")
    @classmethod
    def _eval_every(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            raise ValueError(f"must be in [1, {MAX_COUNT}], 0/null (disabled) or 'auto'")
        return None if v == 0 else v

    @model_validator(mode="after")
    def _micro_not_over_batch(self) -> HyperparametersRequest:
        micro, batch = self.micro_batch_size, self.batch_size
        if isinstance(micro, int) and isinstance(batch, int) and micro > batch:
            raise _located(
                type(self).__name__,
                "micro_batch_size",
                f"must be at most batch_size ({batch}): batch_size is the examples of one optimizer step, "
                "micro_batch_size what one forward/backward holds",
                micro,
            )
        return self


class RuntimeChoices(BaseModel):
    """How a step is computed: micro-batch size, activation checkpointing, packing (concrete)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(ge=1, le=MAX_COUNT)
    gradient_checkpointing: bool
    packing: bool


class ResolvedHyperparameters(BaseModel):
    """The concrete values a run uses; recorded in the job and the checkpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_epochs: int
    batch_size: int
    learning_rate: float
    base_learning_rate: float
    learning_rate_multiplier: float
    warmup_steps: int
    lr_scheduler: Scheduler
    min_lr_ratio: float
    max_seq_length: int
    eval_every: int | None
    checkpoint_every: int
    seed: int
    num_examples: int
    steps_per_epoch: int
    total_steps: int
    truncation: Truncation = "truncate"
    system_message: SystemMessage = "keep"
    #: The LoRA adapter trained (None: full fine-tuning); part of the training signature.
    lora: LoraSpec | None = None
    micro_batch_size: int
    gradient_checkpointing: bool = False
    packing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _recorded_earlier(cls, raw: Any) -> Any:
        """A checkpoint's record from before micro-batches (micro = batch) or before DPO was a method
        of its own (its ``dpo`` key is the method's: trainer.run.checkpoint reads it there)."""
        if not isinstance(raw, dict):
            return raw
        raw = {k: v for k, v in raw.items() if k != "dpo"}
        if "micro_batch_size" not in raw and "batch_size" in raw:
            raw["micro_batch_size"] = raw["batch_size"]
        return raw

    def lr_at(self, step: int) -> float:
        """Learning rate for the update with 0-based index ``step``: linear warm-up, then decay."""
        peak = self.learning_rate
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        if self.lr_scheduler == "constant":
            return peak
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        factor = (
            1.0 - progress if self.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        )
        return peak * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)

    def runtime(self) -> RuntimeChoices:
        return RuntimeChoices(
            micro_batch_size=self.micro_batch_size,
            gradient_checkpointing=self.gradient_checkpointing,
            packing=self.packing,
        )

    def training_signature(self) -> dict[str, Any]:
        """The fields a checkpoint must agree with to be resumed exactly (the method's too:
        trainer.run.checkpoint adds it)."""
        return self.model_dump(exclude={"eval_every", "checkpoint_every", *RUNTIME_FIELDS})
