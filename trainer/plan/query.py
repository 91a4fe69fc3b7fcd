"""What the plan is asked: :class:`PlanQuery`, a job as the plan sees it (its values, and the choices it
leaves to the plan as None). :mod:`trainer.resolve` builds it from a job's request; the plan's fixes
(:mod:`trainer.plan.advice`) are queries with one thing changed."""

from __future__ import annotations

from typing import NamedTuple

from contract.engine import Accumulator, EngineKnobs, EngineMode
from contract.lora import LoraSpec
from contract.method import MethodName
from contract.resources import Resources
from contract.values import Dtype
from trainer.plan.rollout import RolloutQuery


class PlanQuery(NamedTuple):
    """A job as the plan sees it. Each choice that is None is the plan's to make: it picks the candidate
    that runs fastest among those that fit (ties: the least memory)."""

    model: str
    lora: LoraSpec | None
    method: MethodName
    #: Examples of one optimizer step (all ranks) and the tokens of one.
    batch_size: int
    max_seq_length: int
    #: Training examples and their tokens (None: not counted; the plan assumes half-full sequences).
    num_examples: int
    num_tokens: int | None
    resources: Resources
    #: The engine's zenflow and AdamW knobs.
    knobs: EngineKnobs
    #: The parameters' dtype; None: bfloat16 on a GPU, float32 on a CPU.
    dtype: Dtype | None = None
    packing: bool = False
    mode: EngineMode | None = None
    micro_batch_size: int | None = None
    gradient_checkpointing: bool | None = None
    accumulate_on: Accumulator | None = None
    shard_params: bool | None = None
    #: zenflow's device copy of the split weights; None: kept unless only dropping it makes the job fit.
    landing_buffers: bool | None = None
    #: A reinforcement job's sampling per prompt (trainer.plan.rollout); None for the other methods.
    rollout: RolloutQuery | None = None

    def dtype_on(self, device_type: str) -> Dtype:
        """The parameters' dtype on a machine of ``device_type``."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if device_type == "cuda" else "float32"
