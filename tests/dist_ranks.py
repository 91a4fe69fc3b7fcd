"""Run a function on N gloo ranks on the CPU (tests): processes forked from a fork server that imported
torch and the engine once (each test process starts one: a rank then starts in milliseconds where a
spawned one spent seconds importing), an ``env://`` rendezvous on a free port, a deadline so a hung
collective fails the test instead of blocking the suite. A rank runs with the test process's environment
of the moment it was started (the server's own is the one it was started with).

Every rank computes under :func:`pinned_numerics`; a test that compares a rank's result bit for bit with
one computed in the test process computes that one under it too. What decides the bits of a CPU result
besides the inputs: the intra-op thread count (a matmul or a reduction splits its sums by thread, so
another count can round differently: issue 21, where the ranks had 1 thread and the test process the
default), the fp32 matmul precision and whether oneDNN is used (they choose the kernel), and the ISA the
kernels dispatch to (the same machine, and ``ATEN_CPU_CAPABILITY`` / ``DNNL_MAX_CPU_ISA`` / ``MKL_*``
passed to the ranks from the test process's environment)."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

from trainer.run.launch import free_port

#: Intra-op threads of each rank (and of a reference computed under :func:`pinned_numerics`).
RANK_THREADS = 1

#: What the fork server imports once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "offload.engine", "trainer.run.loop", "transformers"]

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


@contextmanager
def pinned_numerics(threads: int = RANK_THREADS) -> Iterator[None]:
    """The process-wide torch settings that choose CPU kernels and their summation order, as every rank
    has them: ``threads`` intra-op threads, fp32 matmuls at full precision, oneDNN on. Restored after."""
    import torch

    saved = torch.get_num_threads(), torch.get_float32_matmul_precision(), torch.backends.mkldnn.enabled
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision("highest")
    torch.backends.mkldnn.enabled = True
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        torch.backends.mkldnn.enabled = saved[2]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    env: dict[str, str],
) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(
        env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    with pinned_numerics():
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            results.put((rank, fn(rank, world, *args)))
        finally:
            if dist.is_initialized():  # fn may have left the group itself
                dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` ranks (module-level ``fn``: it is pickled by name), each
    in the default gloo process group; what each returned (picklable), by rank. Raises when a rank fails
    (its traceback) or the deadline passes (every rank is then killed)."""
    from offload.cpu_adam import load_extension

    load_extension()  # loaded (or, with ZENFLOW_CPU_ADAM_JIT=1, built) once here, before any rank starts
    results = _ctx.Queue()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), args, results, dict(os.environ)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout

    def drain() -> None:  # a rank exits only once the parent has read what it put
        while True:
            try:
                rank, value = results.get_nowait()
            except queue.Empty:
                return
            got[rank] = value

    try:
        while not ctx.join(timeout=1.0):
            drain()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    drain()
    missing = sorted(set(range(world)) - set(got))
    assert not missing, f"ranks {missing} returned nothing"
    return [got[r] for r in range(world)]
