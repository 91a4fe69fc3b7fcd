"""How a job computes each optimizer step, as opposed to what it computes: micro-batch size, activation
(gradient) checkpointing and sequence packing, each an integer/boolean or ``"auto"``.

None of them changes the update a step makes, only its memory and speed (and float rounding):

- ``micro_batch_size``: sequences one forward/backward holds; gradients accumulate over the
  micro-batches of an optimizer step (``batch_size`` examples, OpenAI's meaning) and the loss is
  normalized by the learned tokens of the whole step (:mod:`trainer.run.step`). Without packing a sequence
  is one example; with packing it is one row of up to ``max_seq_length`` tokens holding whole
  examples (:mod:`trainer.data.packing`). An explicit value above an explicit ``batch_size`` is refused;
  one above a batch size that is ``auto`` or lowered to the number of examples is clamped to it.
- ``gradient_checkpointing``: transformers' ``gradient_checkpointing_enable`` with non-reentrant
  checkpoints (activations recomputed in backward).
- ``packing``: padding-free rows, no attention across examples (:mod:`trainer.data.packing`).

:func:`resolve_runtime` is the one place their ``auto`` values are decided: an explicit request wins,
else the memory/speed plan's choice when there is one (``planned``), else the defaults below; the
resolved values are recorded in ``ResolvedHyperparameters`` (checkpoints, the job object). Defaults
without a plan: ``micro_batch_size = batch_size`` (one forward/backward per step, as before),
``gradient_checkpointing = False``, ``packing = False``.

They are left out of ``ResolvedHyperparameters.training_signature()``: a checkpoint resumes under
other runtime choices (e.g. on a worker whose plan picks a smaller micro-batch) with the same updates up
to float rounding; resuming with the same choices is bit-exact. A checkpoint recorded before these
fields existed reads as ``micro_batch_size = batch_size`` with neither checkpointing nor packing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

Auto = Literal["auto"]
MAX_MICRO_BATCH = 2**31 - 1
#: The ResolvedHyperparameters fields that are runtime choices (not part of the training signature).
RUNTIME_FIELDS = frozenset({"micro_batch_size", "gradient_checkpointing", "packing"})


class RuntimeChoices(BaseModel):
    """Concrete runtime choices; also what a plan proposes for the ``auto`` ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(ge=1, le=MAX_MICRO_BATCH)
    gradient_checkpointing: bool
    packing: bool


class RuntimeRequest(BaseModel):
    """The requested runtime hyperparameters (a base of ``trainer.spec.Hyperparameters``)."""

    #: Sequences per forward/backward (gradient accumulation up to batch_size); see the module docstring.
    micro_batch_size: int | Auto = "auto"
    #: Recompute activations in backward (less memory, ~1/3 more compute).
    gradient_checkpointing: bool | Auto = "auto"
    #: Pack examples into padding-free rows of max_seq_length (no attention across examples).
    packing: bool | Auto = "auto"

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch_size(cls, v: object) -> object:
        if isinstance(v, bool) or (isinstance(v, int) and not 1 <= v <= MAX_MICRO_BATCH):
            raise ValueError(f"must be an integer in [1, {MAX_MICRO_BATCH}] or 'auto'")
        return v

    @model_validator(mode="after")
    def _micro_not_over_batch(self) -> RuntimeRequest:
        # Compares with the subclass's batch_size (base fields validate first, so a field validator
        # cannot see it); the error is located at micro_batch_size all the same.
        batch = getattr(self, "batch_size", "auto")
        if (
            isinstance(self.micro_batch_size, int)
            and isinstance(batch, int)
            and self.micro_batch_size > batch
        ):
            message = (
                f"must be at most batch_size ({batch}): batch_size is the examples of one optimizer step, "
                "micro_batch_size what one forward/backward holds"
            )
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message),
                        loc=("micro_batch_size",),
                        input=self.micro_batch_size,
                    )
                ],
            )
        return self


class ResolvedRuntime(BaseModel):
    """The resolved runtime fields (a base of ``trainer.spec.ResolvedHyperparameters``)."""

    micro_batch_size: int
    gradient_checkpointing: bool = False
    packing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _recorded_before_micro_batches(cls, raw: Any) -> Any:
        """A record from before micro-batches ran one forward/backward per step: micro = batch."""
        if isinstance(raw, dict) and "micro_batch_size" not in raw and "batch_size" in raw:
            return {**raw, "micro_batch_size": raw["batch_size"]}
        return raw

    def runtime(self) -> RuntimeChoices:
        return RuntimeChoices(
            micro_batch_size=self.micro_batch_size,
            gradient_checkpointing=self.gradient_checkpointing,
            packing=self.packing,
        )


def resolve_runtime(
    request: RuntimeRequest, batch_size: int, planned: RuntimeChoices | None = None
) -> RuntimeChoices:
    """The runtime choices for a resolved ``batch_size``: explicit values, else ``planned``, else defaults."""

    def pick(name: str, default: Any) -> Any:
        value = getattr(request, name)
        if value != "auto":
            return value
        return getattr(planned, name) if planned is not None else default

    return RuntimeChoices(
        micro_batch_size=min(pick("micro_batch_size", batch_size), batch_size),
        gradient_checkpointing=pick("gradient_checkpointing", False),
        packing=pick("packing", False),
    )
