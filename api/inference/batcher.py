"""The decode threads of the built-in backend: one model at a time per thread, every request waiting
for that model decoded together (``api.inference.generation.Batch``).

A prepared request (:class:`Work`: its model loaded, its prompts encoded and checked) waits in its
model's queue. A free thread takes a model with waiting requests that no other thread decodes, starts
a batch with as many of their choices as ``batch_rows`` allows and steps it; before every step, requests
that arrived for the same model meanwhile join it (their choices prefilled and appended), as long as
room is left and no other model is waiting for a thread. Rows are handed out fairly: a team with fewer
rows in the batch goes first, then arrival order. A request with more choices than fit waits for room
for the rest. Before every step each request in the batch is checked for its client having gone or its
deadline having passed: its rows leave the batch, the others go on. When the batch runs dry the thread
looks for the next model.

A request reports to its :class:`~api.inference.generation_pool.Ticket`: one batch of events per step
(one wake-up of the event loop, not one per token), its finish, and the metrics of the tokens computed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from api.inference import prometheus
from api.inference.generation import Batch, Choice, FinishReason, Row, Sampler
from api.inference.model_cache import LoadedModel
from api.inference.tickets import Completed, Delta, Event, Failed, Finished, Ticket, TimedOut

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Work:
    """One admitted request, prepared, as the decode threads see it."""

    ticket: Ticket
    team: str
    loaded: LoadedModel
    sampler: Sampler
    stops: tuple[str, ...]
    choices: list[Choice]
    prompt_tokens: int
    endpoint: str
    #: The echo prefix of each choice's text (``/v1/completions`` with ``echo``).
    prefixes: dict[int, str] = field(default_factory=dict)
    #: Called once, when the request is done one way or another (its admission slot is let go).
    on_done: Callable[[Work], None] = lambda w: None
    started: int = 0  # choices handed to a batch
    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    completion_tokens: int = 0
    done: bool = False
    _events: list[Event] = field(default_factory=list)
    _rows: list[Row] = field(default_factory=list)

    # --- the rows' side (generation.Owner) ---

    def delta(self, index: int, text: str) -> None:
        self._events.append(Delta(index, text))

    def finished(self, row: Row, reason: FinishReason) -> None:
        self._events.append(Finished(row.index, reason))
        self.texts[row.index] = self.prefixes.get(row.index, "") + row.stop.text
        self.reasons[row.index] = reason
        self.completion_tokens += row.generated
        if len(self.reasons) == len(self.choices):
            prometheus.tokens(self.endpoint, self.prompt_tokens, self.completion_tokens)
            self._events.append(
                Completed(self.texts, self.reasons, self.prompt_tokens, self.completion_tokens)
            )
            self._end()

    # --- the decode thread's side ---

    @property
    def waiting_choices(self) -> int:
        return len(self.choices) - self.started

    def take(self, count: int) -> list[Choice]:
        out = self.choices[self.started : self.started + count]
        if self.started == 0 and out:
            prometheus.get().queue_wait.observe(time.monotonic() - self.ticket.admitted_at)
        self.started += len(out)
        return out

    def track(self, rows: list[Row]) -> None:
        self._rows += rows

    def flush(self) -> None:
        """Send this step's events to the request's handler, in one wake-up of its loop."""
        if self._events:
            events, self._events = self._events, []
            self.ticket.emit_many(events)

    def halt(self) -> None:
        """Stopped from outside: count what was computed; a request past its deadline hears so."""
        if self.done:
            return
        prometheus.tokens(self.endpoint, self.prompt_tokens, sum(r.generated for r in self._rows))
        self._events.clear()
        if self.ticket.timed_out and not self.ticket.cancelled:
            self._events.append(Failed(TimedOut()))
        self.flush()
        self._end()

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self._events.clear()
        self._events.append(Failed(error))
        self.flush()
        self._end()

    def _end(self) -> None:
        if not self.done:
            self.done = True
            self.on_done(self)


class Batcher:
    """``threads`` decode threads over per-model queues of :class:`Work` (see the module docstring)."""

    def __init__(self, *, threads: int, batch_rows: int) -> None:
        self.threads = threads
        self.batch_rows = batch_rows
        self._cond = threading.Condition()
        # By id of the loaded model (each queued work holds it, so the id stays its own).
        self._queues: dict[int, deque[Work]] = {}
        self._busy: set[int] = set()
        self._idle = 0
        self._started = False
        self._stopped = False

    def put(self, work: Work) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("the inference backend is stopping")
            self._queues.setdefault(id(work.loaded), deque()).append(work)
            if not self._started:
                self._started = True
                for i in range(self.threads):
                    threading.Thread(target=self._loop, name=f"zenflow-inference-{i}", daemon=True).start()
            self._cond.notify()

    def discard(self, work: Work) -> bool:
        """Take ``work`` out of its queue if no choice of it started; True when it was there."""
        with self._cond:
            queue = self._queues.get(id(work.loaded))
            if queue is None or work not in queue or work.started:
                return False
            queue.remove(work)
            if not queue:
                del self._queues[id(work.loaded)]
            return True

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # --- the decode threads ---

    def _next_model(self) -> LoadedModel | None:
        with self._cond:
            while True:
                if self._stopped:
                    return None
                free = [key for key in self._queues if key not in self._busy]
                if free:
                    self._busy.add(free[0])
                    return self._queues[free[0]][0].loaded
                self._idle += 1
                self._cond.wait()
                self._idle -= 1

    def _loop(self) -> None:
        while (model := self._next_model()) is not None:
            try:
                self._decode(model)
            finally:
                with self._cond:
                    self._busy.discard(id(model))
                    self._cond.notify()

    def _take(self, model: LoadedModel, batch: Batch) -> list[tuple[Work, list[Choice]]]:
        """Choices that join ``batch`` now: by team, fewest rows in the batch first, then arrival."""
        key = id(model)
        with self._cond:
            queue = self._queues.get(key)
            if not queue or not batch.joinable:
                return []
            others_wait = any(k not in self._busy for k in self._queues if k != key)
            if not batch.empty and others_wait and self._idle == 0:
                return []  # let the batch drain so that a thread is free for the other model
            room = self.batch_rows - len(batch.rows)
            per_team: dict[str, int] = {}
            for r in batch.rows:
                team = r.owner.team
                per_team[team] = per_team.get(team, 0) + 1
            taken: list[tuple[Work, list[Choice]]] = []
            while room > 0 and queue:
                work = min(queue, key=lambda w: per_team.get(w.team, 0))  # earliest of the least served
                choices = work.take(room)
                taken.append((work, choices))
                room -= len(choices)
                per_team[work.team] = per_team.get(work.team, 0) + len(choices)
                if not work.waiting_choices:
                    queue.remove(work)
            if not queue:
                del self._queues[key]
            return taken

    def _unqueue(self, work: Work) -> None:
        with self._cond:
            queue = self._queues.get(id(work.loaded))
            if queue is not None and work in queue:
                queue.remove(work)
                if not queue:
                    del self._queues[id(work.loaded)]

    def _decode(self, model: LoadedModel) -> None:
        import torch

        batch = Batch(model)
        works: dict[int, Work] = {}  # the requests with rows in the batch
        batch_rows = prometheus.get().batch_rows
        while True:
            joining = self._take(model, batch)
            try:
                with torch.inference_mode():
                    if not self._round(model, batch, works, joining, batch_rows):
                        return
            except Exception as e:  # the batch is lost (out of memory, a model error): fail its requests
                log.exception("inference: decoding failed")
                for work in works.values():
                    self._unqueue(work)
                    work.fail(e)
                works.clear()
                batch = Batch(model)

    def _round(
        self,
        model: LoadedModel,
        batch: Batch,
        works: dict[int, Work],
        joining: list[tuple[Work, list[Choice]]],
        batch_rows: Histogram,
    ) -> bool:
        """One round of the batch: the joining choices added, stopped requests halted, one decoding
        step; False when the batch is empty and no request waits for the model (the thread leaves it)."""
        self._join(batch, works, joining)
        self._halt_stopped(batch, works)
        if batch.empty:
            with self._cond:
                return id(model) in self._queues
        batch_rows.observe(len(batch.rows))
        batch.step()
        for work in works.values():
            work.flush()
        return True

    @staticmethod
    def _join(batch: Batch, works: dict[int, Work], joining: list[tuple[Work, list[Choice]]]) -> None:
        for work, _ in joining:
            works[id(work)] = work
        live = [(w, cs, w.stops) for w, cs in joining if not w.ticket.should_stop()]
        if live:
            for (work, _, _), rows in zip(live, batch.add(live), strict=True):
                work.track(rows)
                work.flush()

    def _halt_stopped(self, batch: Batch, works: dict[int, Work]) -> None:
        """Requests whose client left or that finished: out of the batch (and the queue), forgotten."""
        for key, work in list(works.items()):
            if not work.done and work.ticket.should_stop():
                batch.halt(work)
                self._unqueue(work)
                work.halt()
            if work.done:
                del works[key]
