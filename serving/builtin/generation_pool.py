"""The generation pool: fair admission, the preparing threads and the batched decode threads, and the
bridge back to the event loop.

Generation runs in threads of the process that runs the engine (the serving process; the API's when
embedded), never on the event loop. Threads, because torch releases the GIL inside its kernels, so the
loop keeps serving while a model decodes, and the models loaded stay shared by every request without
copying weights or streaming tokens across a process boundary; deployments that need more throughput
put vLLM behind the same engine (``serving.vllm``).

A request is admitted while its team holds less than its share of the ``threads + queue_size`` slots
(``serving.builtin.team_shares``); beyond that :class:`QueueFull` (429 with ``Retry-After``). Each admitted
request is a :class:`Ticket`. A preparing thread loads its model and encodes its prompts (``prepare``,
``serving.builtin.prepare``), then its choices go to the decode threads (``serving.builtin.batcher``), which
decode every request for the same model together. The threads send the request's events to the loop
through the ticket; the request's side cancels it (client gone) or lets its deadline pass, which the
decode thread checks before every step. Its slot is released when it is done, or at once when it had
not started yet.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from serving import prometheus
from serving.builtin.batcher import Batcher
from serving.builtin.team_shares import Refusal, TeamShares
from serving.builtin.tickets import (
    Cancelled,
    Completed,
    Delta,
    Event,
    Failed,
    Finished,
    Started,
    Ticket,
    TimedOut,
)

if TYPE_CHECKING:
    from serving.builtin.batcher import Work

__all__ = [
    "Cancelled",
    "Completed",
    "Delta",
    "Event",
    "Failed",
    "Finished",
    "GenerationPool",
    "QueueFull",
    "Started",
    "Ticket",
    "TimedOut",
]


class QueueFull(Exception):
    """The team's share of the slots (or every slot) is taken: the caller answers 429 with ``Retry-After``."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__("inference slots full")
        self.refusal = refusal


class GenerationPool:
    """Fair admission to ``threads + queue_size`` slots, ``threads`` preparing and ``threads`` decode
    threads (``batch_rows`` choices decoded together per model, models taking turns by ``slice_seconds``;
    the defaults are ``api.core.config.ApiSettings``')."""

    def __init__(
        self,
        *,
        threads: int,
        queue_size: int,
        timeout_seconds: float,
        batch_rows: int,
        slice_seconds: float,
    ) -> None:
        self.capacity = threads + queue_size
        self.timeout_seconds = timeout_seconds
        self.threads = threads
        self.batch_rows = batch_rows
        self.slice_seconds = slice_seconds
        self.shares = TeamShares(self.capacity)
        self._executor = self._new_executor()
        self._batcher = self._new_batcher()
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()

    @property
    def slots_in_use(self) -> int:
        """Admitted requests not yet let go: running plus waiting."""
        return self.shares.total

    def submit(self, team: str, prepare: Callable[[Ticket], Work | None]) -> Ticket:
        """Admit a request of ``team``: ``prepare(ticket)`` runs in a preparing thread and returns the
        work to decode (None: nothing to decode, it answered itself); raises :class:`QueueFull`."""
        loop = asyncio.get_running_loop()
        refusal = self.shares.admit(team)
        if refusal is not None:
            raise QueueFull(refusal)
        prometheus.get().slots.inc()
        ticket = Ticket(loop, self.timeout_seconds, team)
        with self._lock:
            self._tickets.add(ticket)
            batcher = self._batcher
        future = self._executor.submit(self._prepare, prepare, ticket, batcher)
        ticket.future = future
        future.add_done_callback(lambda f: self._release(ticket) if f.cancelled() else None)
        return ticket

    def shutdown(self) -> None:
        """Stop every generation at its next step and drop the waiting ones (the app stops; should it
        start again, new requests get fresh threads)."""
        with self._lock:
            tickets = list(self._tickets)
            old, self._executor = self._executor, self._new_executor()
            old_batcher, self._batcher = self._batcher, self._new_batcher()
        for t in tickets:
            t.cancel_threadsafe()
        old.shutdown(wait=False, cancel_futures=True)
        old_batcher.stop()

    def _new_batcher(self) -> Batcher:
        return Batcher(threads=self.threads, batch_rows=self.batch_rows, slice_seconds=self.slice_seconds)

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="zenflow-inference-prepare")

    def _prepare(self, prepare: Callable[[Ticket], Work | None], ticket: Ticket, batcher: Batcher) -> None:
        try:
            if ticket.cancelled:
                self._release(ticket)
                return
            if ticket.timed_out:
                ticket.emit(Failed(TimedOut()))
                self._release(ticket)
                return
            work = prepare(ticket)
        except BaseException as e:
            ticket.emit(Failed(e))
            self._release(ticket)
            return
        if work is None:
            self._release(ticket)
            return
        work.on_done = lambda w: self._release(w.ticket)
        try:
            batcher.put(work)
        except RuntimeError as e:  # the pool is shutting down
            work.fail(e)
            return

        def unqueue() -> None:
            if batcher.discard(work):
                self._release(ticket)

        ticket.on_cancel = unqueue
        if ticket.cancelled:  # cancelled between the check above and now
            unqueue()

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket not in self._tickets:
                return
            self._tickets.discard(ticket)
        self.shares.release(ticket.team)
        prometheus.get().slots.dec()
