"""Run a function on N gloo ranks on the CPU (tests): spawned processes, an ``env://`` rendezvous on a free
port, a deadline so a hung collective fails the test instead of blocking the suite."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from trainer.run.launch import free_port


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` ranks (module-level ``fn``: it is pickled by name);
    raises when a rank fails or the deadline passes (every rank is then killed)."""
    from offload.cpu_adam import load_extension

    load_extension()  # built once here: ranks killed at the deadline mid-build would leave its lock behind
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s")
