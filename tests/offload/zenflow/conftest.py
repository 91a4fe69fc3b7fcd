"""Every test of the zenflow modules computes on one intra-op thread from a fixed seed, so each bitwise
comparison's inputs and kernels are pinned (tests/dist_ranks.py says what else picks a CPU kernel's bits)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def pinned() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
