"""The generation pool: bounded admission, generation threads, and the bridge back to the event loop.

Generation runs in a small thread pool inside the API process, never on the event loop. Threads rather
than a separate process because torch releases the GIL inside its kernels, so the loop keeps serving
while a model decodes, and the models loaded stay shared by every request without copying weights or
streaming tokens across a process boundary; deployments that need more throughput put vLLM behind
the same endpoint (``api.inference.vllm``).

A request is admitted only while fewer than ``threads + queue_size`` are admitted (running or
waiting for a thread); beyond that :class:`QueueFull` (429 with ``Retry-After``). Each admitted
request is a :class:`Ticket`: the thread sends its events to the loop through the ticket, and the
request's side cancels it (client gone) or lets its deadline pass; the generation checks both on every
token (``api.inference.generation``) and its slot is released when the thread lets go of it, or at
once when it had not started yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from api.inference import metrics


class QueueFull(Exception):
    """Every slot is taken: the caller answers 429 with ``Retry-After``."""


class TimedOut(Exception):
    """The request ran past its deadline (waiting included)."""


class Cancelled(Exception):
    """The request was cancelled (its client went away, or the app is stopping)."""


@dataclass(frozen=True)
class Started:
    """The prompt(s) are encoded and generation begins."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    reason: str


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Completed:
    """The last event of a successful request."""

    texts: dict[int, str]
    finish_reasons: dict[int, str]
    prompt_tokens: int
    completion_tokens: int


Event = Started | Delta | Finished | Failed | Completed


class Ticket:
    """One admitted request, shared by its generation thread and the request handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_seconds: float) -> None:
        self.admitted_at = time.monotonic()
        self.deadline = self.admitted_at + timeout_seconds
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.future: Future[None] | None = None

    # --- the generation thread's side ---

    def should_stop(self) -> bool:
        return self._cancelled.is_set() or time.monotonic() > self.deadline

    @property
    def timed_out(self) -> bool:
        return time.monotonic() > self.deadline

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def delta(self, index: int, text: str) -> None:
        self.emit(Delta(index, text))

    def finished(self, index: int, reason: str) -> None:
        self.emit(Finished(index, reason))

    # --- the request's side ---

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the generation (at its next token) or drop it before it starts; whoever still waits
        for an event gets :class:`Cancelled`. Call it on the event loop."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self.future is not None:
            self.future.cancel()
        self._events.put_nowait(Failed(Cancelled()))

    def cancel_threadsafe(self) -> None:
        """:meth:`cancel` from another thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self.cancel)

    async def next_event(self) -> Event:
        """The next event; :class:`TimedOut` (and the ticket cancelled) past the deadline."""
        remaining = self.deadline - time.monotonic()
        try:
            # A little grace: the thread notices the deadline at its next token and reports it itself.
            return await asyncio.wait_for(self._events.get(), timeout=max(remaining, 0.0) + 1.0)
        except TimeoutError:
            self.cancel()
            raise TimedOut() from None


class GenerationPool:
    """``threads`` generation threads behind an admission limit of ``threads + queue_size``."""

    def __init__(self, *, threads: int, queue_size: int, timeout_seconds: float) -> None:
        self.capacity = threads + queue_size
        self.timeout_seconds = timeout_seconds
        self.threads = threads
        self._executor = self._new_executor()
        self._lock = threading.Lock()
        self._admitted = 0
        self._tickets: set[Ticket] = set()

    @property
    def slots_in_use(self) -> int:
        """Admitted requests not yet let go: running plus waiting."""
        with self._lock:
            return self._admitted

    def submit(self, job: Callable[[Ticket], None]) -> Ticket:
        """Admit ``job`` (run as ``job(ticket)`` in a generation thread); raises :class:`QueueFull`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._admitted >= self.capacity:
                raise QueueFull()
            self._admitted += 1
        metrics.get().slots.inc()
        ticket = Ticket(loop, self.timeout_seconds)
        with self._lock:
            self._tickets.add(ticket)
        future = self._executor.submit(self._run, job, ticket)
        ticket.future = future
        future.add_done_callback(lambda f: self._release(ticket) if f.cancelled() else None)
        return ticket

    def shutdown(self) -> None:
        """Stop every generation at its next token and drop the waiting ones (the app stops; should
        it start again, new requests get fresh threads)."""
        with self._lock:
            tickets = list(self._tickets)
            old, self._executor = self._executor, self._new_executor()
        for t in tickets:
            t.cancel_threadsafe()
        old.shutdown(wait=False, cancel_futures=True)

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="zenflow-inference")

    def _run(self, job: Callable[[Ticket], None], ticket: Ticket) -> None:
        try:
            metrics.get().queue_wait.observe(time.monotonic() - ticket.admitted_at)
            if ticket.cancelled:
                return
            if ticket.timed_out:
                ticket.emit(Failed(TimedOut()))
                return
            job(ticket)
        except BaseException as e:
            ticket.emit(Failed(e))
        finally:
            self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket not in self._tickets:
                return
            self._tickets.discard(ticket)
            self._admitted -= 1
        metrics.get().slots.dec()
