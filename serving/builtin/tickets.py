"""A request's ticket: what its generation threads and its handler share, and the events between them.

The threads emit events (:class:`Started`, :class:`Delta`, :class:`Finished`, then :class:`Completed`,
or :class:`Failed`) into the ticket; the handler reads them on the event loop (:meth:`Ticket.next_event`),
cancels the ticket when its client goes away, and the threads stop it at their next step when it is
cancelled or past its deadline (:meth:`Ticket.should_stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass


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

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_seconds: float, team: str = "") -> None:
        self.team = team
        self.admitted_at = time.monotonic()
        self.deadline = self.admitted_at + timeout_seconds
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.future: Future[None] | None = None
        #: Set by the pool while the request waits for a decode thread: takes it out of the queue.
        self.on_cancel: Callable[[], None] | None = None

    # --- the generation thread's side ---

    def should_stop(self) -> bool:
        return self._cancelled.is_set() or time.monotonic() > self.deadline

    @property
    def timed_out(self) -> bool:
        return time.monotonic() > self.deadline

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def emit_many(self, events: list[Event]) -> None:
        """Several events in one wake-up of the loop."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._put_all, events)

    def _put_all(self, events: list[Event]) -> None:
        for e in events:
            self._events.put_nowait(e)

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
        if self.on_cancel is not None:
            self.on_cancel()
        self._events.put_nowait(Failed(Cancelled()))

    def cancel_threadsafe(self) -> None:
        """:meth:`cancel` from another thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self.cancel)

    async def next_event(self) -> Event:
        """The next event; :class:`TimedOut` (and the ticket cancelled) past the deadline."""
        if not self._events.empty():  # the common case mid-stream: no timer, no task
            return self._events.get_nowait()
        remaining = self.deadline - time.monotonic()
        try:
            # A little grace: the thread notices the deadline at its next token and reports it itself.
            return await asyncio.wait_for(self._events.get(), timeout=max(remaining, 0.0) + 1.0)
        except TimeoutError:
            self.cancel()
            raise TimedOut() from None
