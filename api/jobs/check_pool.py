"""Data checks off the event loop and off the database threads: a bounded pool of check processes.

Rendering and tokenizing a file holds the GIL (the tokenizer's offsets come back as Python lists: a
thread tokenizing 2.4 MB of text delayed the event loop by up to 0.8 s, a thread checking 600-message
lines by up to 80 ms, a process by under 8 ms; measured on 2 cores), so a check runs in a process of
its own (``ZENFLOW_DATA_CHECK_WORKERS`` of them, started on the first check, from a fork server).

- Bounded: a check waits (without a thread or a process) until a process is free and its team runs
  fewer than :attr:`CheckPool.per_team` checks, so one team cannot hold every process.
- Budgeted: a check has until its deadline (``ZENFLOW_DATA_CHECK_TIMEOUT_SECONDS`` from the request's
  start), waiting included; past it the request gets :class:`CheckTimeout` at once and the process
  stops at its next line.
- Cancelled with its request: the client gone (polled every :data:`POLL_SECONDS`) or the request
  cancelled (the server's shutdown) set the check's flag, which the process reads before each line
  (api.jobs.check_worker). SIGTERM and SIGINT set every flag before the server's own handler runs,
  so a stopping server's checks end at their next line and its requests answer 503 instead of
  holding the shutdown; :meth:`CheckPool.close` (at the app's shutdown) does the same and stops the
  processes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from types import FrameType
from typing import Any

from api.jobs.check_worker import CheckRequest, init_process, run_check

log = logging.getLogger(__name__)

#: How often a waiting request looks at its client, its deadline and the pool.
POLL_SECONDS = 0.1


class CheckTimeout(Exception):
    """The check's deadline passed (waiting for a process included)."""


class CheckCancelled(Exception):
    """The client went away, or the server is stopping."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why  # "disconnected" | "shutdown"


class CheckPool:
    """The app's check processes (see the module docstring)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        #: Checks one team may run at once (the others of that team wait).
        self.per_team = max(1, workers - 1)
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._flags: Any = None
        self._free: list[int] = []
        self._teams: Counter[str] = Counter()
        self.closing = False
        self._users = 0  # lifespans between open() and close()
        #: Checks handed to a process, and how they ended (tests and the probe read them).
        self.submitted = 0
        self.outcomes: Counter[str] = Counter()

    @property
    def running(self) -> int:
        """Checks in a process now (including ones told to stop that have not yet)."""
        with self._lock:
            return self.workers - len(self._free) if self._executor is not None else 0

    def _start(self) -> None:
        """Start the processes' pool (under the lock)."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["api.jobs.check_worker", "trainer.model.catalog"])
        self._flags = ctx.Array("b", self.workers, lock=False)
        self._free = list(range(self.workers))
        self._executor = ProcessPoolExecutor(
            self.workers, mp_context=ctx, initializer=init_process, initargs=(self._flags,)
        )

    def _take(self, team: str) -> tuple[int, ProcessPoolExecutor, Any] | None:
        """A free process's slot, with the pool and the flags it belongs to; None while none is free
        (or the team runs its share)."""
        with self._lock:
            if self.closing:
                raise CheckCancelled("shutdown")
            if self._executor is None:
                self._start()
            assert self._executor is not None
            if not self._free or self._teams[team] >= self.per_team:
                return None
            slot = self._free.pop()
            self._teams[team] += 1
            self._flags[slot] = 0
            return slot, self._executor, self._flags

    def _release(self, slot: int, team: str, executor: ProcessPoolExecutor) -> None:
        with self._lock:
            self._teams[team] -= 1
            if self._teams[team] <= 0:
                del self._teams[team]
            if self._executor is executor:  # else a broken pool's slot: the new pool has its own
                self._free.append(slot)

    def _broken(self, executor: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is executor:
                self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)

    def hook_signals(self) -> None:
        """Chain SIGTERM and SIGINT to :meth:`stop_all` first, when the main thread runs the server and
        a handler of the server's is installed (call it at the app's start: uvicorn's handlers are in
        place then, and it puts back the ones it found when it exits)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous) or previous is signal.default_int_handler:
                continue

            def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
                self.stop_all()
                previous(signum, frame)

            signal.signal(sig, handler)

    def open(self) -> None:
        """Accept checks (the app's start). Each :meth:`open` is paired with a :meth:`close`; the pool
        closes at the last one, so an app served twice at once (a test's client and a server thread)
        or started again after a stop keeps its checks."""
        with self._lock:
            self._users += 1
            self.closing = False

    def stop_all(self) -> None:
        """Refuse new checks and tell every running one to stop (signal-safe: no lock taken)."""
        self.closing = True
        flags = self._flags
        if flags is not None:
            for i in range(len(flags)):
                flags[i] = 1

    def close(self) -> None:
        """Stop every check and the processes (the app's shutdown; at the last of its :meth:`open`)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
        self.stop_all()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    async def run(
        self,
        request: CheckRequest,
        *,
        team: str,
        deadline: float,
        disconnected: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        """The check's outcome (api.jobs.check_worker); raises CheckTimeout at ``deadline`` (the loop's
        clock) and CheckCancelled when the client goes or the server stops."""
        loop = asyncio.get_running_loop()

        async def still_wanted() -> None:
            if await disconnected():
                raise CheckCancelled("disconnected")
            if loop.time() >= deadline:
                raise CheckTimeout

        slot, executor, flags = await self._lease(team, still_wanted, deadline)
        future = self._submit(
            slot, team, executor, replace(request, budget_seconds=max(0.0, deadline - loop.time()))
        )
        await self._wait(future, still_wanted, flags, slot)
        return self._outcome(future, executor)

    async def _lease(
        self, team: str, still_wanted: Callable[[], Awaitable[None]], deadline: float
    ) -> tuple[int, ProcessPoolExecutor, Any]:
        """A slot of the team's share, waited for while the check is still wanted."""
        loop = asyncio.get_running_loop()
        while True:
            await still_wanted()
            if (lease := self._take(team)) is not None:
                return lease
            await asyncio.sleep(min(POLL_SECONDS, max(0.0, deadline - loop.time())))

    def _submit(
        self, slot: int, team: str, executor: ProcessPoolExecutor, request: CheckRequest
    ) -> Future[dict[str, Any]]:
        """The check sent to the slot's process; the slot freed when it is done (or could not be sent)."""
        try:
            future: Future[dict[str, Any]] = executor.submit(run_check, slot, request)
        except BaseException:  # the pool broke, or shut down, in between
            self._release(slot, team, executor)
            self._broken(executor)
            raise
        self.submitted += 1
        future.add_done_callback(lambda _f: self._release(slot, team, executor))
        return future

    async def _wait(
        self,
        future: Future[dict[str, Any]],
        still_wanted: Callable[[], Awaitable[None]],
        flags: Any,
        slot: int,
    ) -> None:
        """Until the check is done; a check no longer wanted is told to stop (its slot's flag)."""
        waiter = asyncio.wrap_future(future)
        done = False
        try:
            while not future.done():
                await asyncio.wait([waiter], timeout=POLL_SECONDS)
                if not future.done():
                    await still_wanted()
            done = True
        finally:
            if not done:  # the client left, the deadline passed, or the request was cancelled
                flags[slot] = 1
                waiter.cancel()  # and the process's future, when it has not started
                self.outcomes["abandoned"] += 1

    def _outcome(self, future: Future[dict[str, Any]], executor: ProcessPoolExecutor) -> dict[str, Any]:
        """The finished check's outcome, counted; a stopped one as the timeout or cancel it was."""
        try:
            outcome = future.result()
        except BrokenProcessPool:
            self._broken(executor)
            raise
        self.outcomes[str(outcome["outcome"])] += 1
        if outcome["outcome"] == "stopped":
            if outcome.get("reason") == "cancelled" or self.closing:
                raise CheckCancelled("shutdown" if self.closing else "disconnected")
            raise CheckTimeout
        return outcome
