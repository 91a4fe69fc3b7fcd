"""A worker's row in the worker registry (:mod:`store.worker_registry`), kept fresh by a background thread.

:class:`WorkerPresence` measures the worker's capacity (:func:`worker.capacity.measure.
measure_in_subprocess`: the worker process itself never imports torch), registers it with the queues
the worker consumes and the size of the jobs it runs (``Settings.gpus_per_job``), refreshes the heartbeat every ``heartbeat_interval_seconds`` (registering again
should the row have gone) and removes the row on a clean stop. Until the measurement is in, the
worker is not registered and admission plans its queue's jobs against the other live workers, or the
configured default capacity when there are none. A database outage only delays the heartbeats: the
worker stops being live for admission and counts again once they get through.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from store import worker_registry
from store.db import session_scope
from store.settings import Settings, get_settings
from worker.capacity.measure import CapacityError, WorkerCapacity, measure_in_subprocess
from worker.errors import public_message

log = logging.getLogger("zenflow.worker")


class WorkerPresence(threading.Thread):
    """Register worker ``name`` with its measured capacity and keep its heartbeat fresh."""

    def __init__(
        self,
        name: str,
        queues: Sequence[str],
        *,
        settings: Settings | None = None,
        measure: Callable[[], WorkerCapacity] = measure_in_subprocess,
        interval: float | None = None,
    ) -> None:
        super().__init__(name="zenflow-worker-presence", daemon=True)
        self.worker_name, self.queues = name, list(queues)
        self.settings = settings or get_settings()
        self.measure = measure
        self.interval = interval if interval is not None else self.settings.heartbeat_interval_seconds
        self.capacity: WorkerCapacity | None = None
        #: Set once the worker's row is written (tests and start-up logs wait on it).
        self.registered = threading.Event()
        self._stop_event = threading.Event()

    @property
    def _url(self) -> str:
        return self.settings.resolved_database_url

    def _register(self) -> None:
        assert self.capacity is not None
        with session_scope(self._url) as s:
            worker_registry.register(
                s,
                self.worker_name,
                self.queues,
                self.capacity.model_dump(mode="json"),
                gpus_per_job=self.settings.gpus_per_job,
            )
        self.registered.set()

    def _beat(self) -> None:
        with session_scope(self._url) as s:
            alive = worker_registry.heartbeat(s, self.worker_name)
        if not alive:
            self._register()

    def run(self) -> None:
        try:
            self.capacity = self.measure()
        except CapacityError as e:
            log.error("worker %s: %s; not registered for admission", self.worker_name, e)
            return
        log.info("worker %s capacity: %s", self.worker_name, self.capacity.describe())
        while not self._stop_event.is_set():
            try:
                self._beat() if self.registered.is_set() else self._register()
            except Exception as e:  # the database is away: the next round tries again
                log.warning("worker %s: heartbeat failed: %s", self.worker_name, public_message(e))
            self._stop_event.wait(self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the heartbeats and remove the worker's row (it no longer counts for admission)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        if not self.registered.is_set():
            return
        try:
            with session_scope(self._url) as s:
                worker_registry.unregister(s, self.worker_name)
        except Exception as e:
            log.warning("worker %s: could not unregister: %s", self.worker_name, public_message(e))


def start_presence(
    name: str,
    queues: Sequence[str],
    *,
    settings: Settings | None = None,
    measure: Callable[[], WorkerCapacity] = measure_in_subprocess,
) -> WorkerPresence:
    """Start a :class:`WorkerPresence` thread for worker ``name`` consuming ``queues``."""
    presence = WorkerPresence(name, queues, settings=settings, measure=measure)
    presence.start()
    return presence
