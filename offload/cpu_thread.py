"""The engine's CPU thread: one daemon thread with its own cores that runs the CPU optimizer's work.

Tasks are plain callables. *Urgent* tasks (gradient accumulation: they free staging buffers the
training thread is waiting for) always run first; *normal* tasks (the window's CPU optimizer step)
run in submission order. A normal task may return a generator: the thread then advances it one
chunk at a time and runs any urgent task that arrived in between, so a long CPU Adam step never
holds back the next window's gradient copies. The generator's return value is the task's result.

Failure handling: the first exception raised by a task is kept with its traceback, every pending
task's future fails with it, the thread exits, and ``check()``/``wait()`` raise
:class:`CPUThreadError` in the calling (training) thread, chained ``from`` the original.
``close()`` lets queued work finish, then joins the thread; it is idempotent.

GIL accounting: the thread's CPU time (``time.thread_time``: time blocked waiting for the GIL
does not count) over every stretch of task execution, less its CPU time inside the calls tasks mark
as releasing the GIL (:func:`gil_released`: the C++ optimizer and accumulation, waits on transfers),
is ``gil_seconds``: how long the thread ran Python holding the GIL, i.e. could delay the training
thread's Python (an upper bound: torch ops a task calls count as held, though ATen releases the GIL
during them).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from typing import Any

import torch


class CPUThreadError(RuntimeError):
    """The background CPU optimizer failed; the original exception is the ``__cause__``."""


class CPUThreadClosedError(RuntimeError):
    """A task was submitted to (or left in) a CPU thread that has been closed."""


_Task = tuple[Callable[[], Any], "Future[Any]"]


class _Turn(enum.Enum):
    """What the thread does next when not a queued task."""

    GENERATOR = "advance the running generator by one chunk"
    STOP = "stopped with nothing left"


_tls = threading.local()
#: Native thread ids of the live CPU threads (core placement pins every other thread of the process).
live_native_ids: set[int] = set()


@contextlib.contextmanager
def gil_released() -> Iterator[None]:
    """Mark a call that releases the GIL (the CPU thread's GIL-hold figure leaves its time out)."""
    t0 = time.thread_time()
    try:
        yield
    finally:
        _tls.released = getattr(_tls, "released", 0.0) + (time.thread_time() - t0)


class CPUThread:
    def __init__(
        self,
        name: str = "zenflow-cpu-optimizer",
        *,
        torch_threads: int | None = None,
        cores: list[int] | None = None,
        cuda_device: torch.device | None = None,
    ) -> None:
        self._cv = threading.Condition()
        self._urgent: deque[_Task] = deque()
        self._normal: deque[_Task] = deque()
        self._stop = False
        self._error: BaseException | None = None
        self._busy = 0  # tasks submitted and not finished
        #: Wall seconds the thread ran tasks, and its CPU seconds outside gil_released() calls in them.
        self.busy_seconds = 0.0
        self.gil_seconds = 0.0
        self._torch_threads = torch_threads
        self._cores = cores
        self._cuda_device = cuda_device
        self.native_id = 0  # the thread's, once started
        #: Whether the thread runs on ``cores`` (None: no cores asked for).
        self.pinned: bool | None = None
        #: The normal task the thread is advancing chunk by chunk (the thread's own), and its future.
        self._gen: Generator[Any, Any, Any] | None = None
        self._gen_fut: Future[Any] | None = None
        ready = threading.Event()
        main_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()
        # The thread's torch.set_num_threads also changed the default for threads started later;
        # put that default back to the training thread's count (a no-op for this thread itself).
        if torch_threads is not None:
            torch.set_num_threads(main_threads)

    # --- training-thread side -------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], *, urgent: bool = False) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cv:
            self.check()
            if self._stop:
                raise CPUThreadClosedError("the CPU thread is closed")
            (self._urgent if urgent else self._normal).append((fn, fut))
            self._busy += 1
            self._cv.notify()
        return fut

    def check(self) -> None:
        """Raise the thread's failure, if any, in the calling thread."""
        err = self._error
        if err is not None:
            raise CPUThreadError(f"background CPU optimizer failed: {type(err).__name__}: {err}") from err

    def wait(self, fut: Future[Any]) -> Any:
        """Block until ``fut`` is done; a failure of the thread surfaces as CPUThreadError."""
        try:
            return fut.result()
        except Exception as exc:  # not KeyboardInterrupt: a Ctrl-C while waiting stays a Ctrl-C
            if self._error is not None:
                self.check()
            raise CPUThreadError(f"background task failed: {type(exc).__name__}: {exc}") from exc

    def drain(self) -> None:
        """Block until every submitted task has finished."""
        with self._cv:
            while self._busy and self._error is None and self._thread.is_alive():
                self._cv.wait(0.1)
        self.check()

    def close(self, timeout: float = 120.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the thread itself ----------------------------------------------------------------------
    def _setup(self) -> None:
        self.native_id = threading.get_native_id()
        live_native_ids.add(self.native_id)
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        if self._cores and hasattr(os, "sched_setaffinity"):
            self.pinned = False
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._cores)  # pid 0 = the calling thread on Linux
                self.pinned = True
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)

    def _run(self, ready: threading.Event) -> None:
        try:
            self._setup()
        except BaseException as exc:
            self._error = exc
        finally:
            ready.set()
        try:
            self._loop()
        finally:
            live_native_ids.discard(threading.get_native_id())

    def _loop(self) -> None:
        while self._error is None:
            task = self._take()
            if task is _Turn.STOP:
                break
            current = self._gen_fut if task is _Turn.GENERATOR else task[1]
            t0, c0, r0 = time.perf_counter(), time.thread_time(), getattr(_tls, "released", 0.0)
            try:
                self._execute(task)
            except BaseException as exc:
                self._fail(exc, current, self._gen_fut)
                return
            finally:
                self.busy_seconds += time.perf_counter() - t0
                cpu = time.thread_time() - c0
                self.gil_seconds += max(0.0, cpu - (getattr(_tls, "released", 0.0) - r0))

    def _take(self) -> _Task | _Turn:
        """What runs next, waiting for it: an urgent task, else a chunk of the running generator, else
        a normal task; STOP once closed with nothing left."""
        with self._cv:
            while not (self._urgent or self._normal or self._gen is not None or self._stop):
                self._cv.wait()
            if self._urgent:
                return self._urgent.popleft()
            if self._gen is not None:
                return _Turn.GENERATOR
            if self._normal:
                return self._normal.popleft()
            return _Turn.STOP  # stopped and nothing left

    def _execute(self, task: _Task | _Turn) -> None:
        """Run a task (a generator it returns becomes the running one), or one chunk of the running
        generator (finishing its task when it returns)."""
        if task is _Turn.GENERATOR:
            assert self._gen is not None
            try:
                next(self._gen)
            except StopIteration as stop:
                self._finish(self._gen_fut, stop.value)
                self._gen, self._gen_fut = None, None
            return
        assert not isinstance(task, _Turn)
        fn, fut = task
        out = fn()
        if inspect.isgenerator(out):
            self._gen, self._gen_fut = out, fut
        else:
            self._finish(fut, out)

    def _finish(self, fut: Future[Any] | None, value: Any) -> None:
        if fut is not None:
            fut.set_result(value)
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def _fail(self, exc: BaseException, *futs: Future[Any] | None) -> None:
        with self._cv:
            self._error = exc
            pending = [f for _, f in self._urgent] + [f for _, f in self._normal]
            self._urgent.clear()
            self._normal.clear()
            self._busy = 0
            self._cv.notify_all()
        for f in {id(f): f for f in (*futs, *pending) if f is not None}.values():
            if not f.done():
                f.set_exception(exc)
