"""What a job needs from its workers: :class:`Resources`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The most ranks (GPUs) of one node a job may ask for.
MAX_GPUS_PER_NODE = 64
#: Most worker hosts (nodes) one job may span: a gang of that many workers (store.gang).
MAX_NODES_PER_JOB = 16


class Resources(BaseModel):
    """``gpus``: the data-parallel ranks on each node, one per GPU (CPU ranks on gloo where the worker
    allows them); ``nodes``: the worker hosts the job spans, each running ``gpus`` ranks (a gang,
    store.gang). Each optimizer step's ``batch_size`` examples are split across all
    :attr:`world_size` ranks."""

    # strict: "2" or 2.0 is no count of GPUs
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    gpus: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)
    """Ranks (GPUs) on each node."""
    nodes: int = Field(1, ge=1, le=MAX_NODES_PER_JOB)
    """Worker hosts the job spans."""

    @property
    def world_size(self) -> int:
        """Every rank of the job: ``nodes`` x ``gpus``."""
        return self.nodes * self.gpus
