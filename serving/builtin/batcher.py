"""The decode threads of the built-in backend: one model at a time per thread, every request waiting
for that model decoded together (``serving.builtin.generation.Batch``).

A prepared request (:class:`Work`: its model loaded, its prompts encoded and checked) waits in its
model's queue. A free thread takes a model with waiting requests (or a parked batch) that no other
thread decodes, starts a batch with as many of their choices as ``batch_rows`` allows (or resumes the
parked one) and steps it; before every step, requests that arrived for the same model meanwhile join it
(their choices prefilled and appended) as long as room is left. Rows are handed out fairly: a team
with fewer rows in the batch goes first, then arrival order. A request with more choices than fit
waits for room for the rest. Before every step each request in the batch is checked for its client
having gone or its deadline having passed: its rows leave the batch, the others go on.

Time is shared across models by slices: once a thread has decoded a model for ``slice_seconds`` and
another model waits with no thread free for it, the batch is parked as it is (rows, KV cache: nothing
is copied) and the thread takes the next model; the parked batch resumes, on whichever thread, when
its turn comes again. The next model is chosen by team first: the model of the team served longest
ago (a model counts as serving every team with a request in its queue or its batch), then the model
waiting longest. So a request to another model waits at most about a slice per model ahead of it, not
for a flood's whole generation; a batch that runs dry leaves its model at once.

A request reports to its :class:`~serving.builtin.generation_pool.Ticket`: one batch of events per step
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

from serving import prometheus
from serving.builtin.generation import Batch, Choice, FinishReason, Row, Sampler
from serving.builtin.model_cache import LoadedModel
from serving.builtin.tickets import Completed, Delta, Event, Failed, Finished, Ticket, TimedOut

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


@dataclass(eq=False)
class _Parked:
    """A model's batch set aside, as it was, for another model's turn."""

    batch: Batch
    works: dict[int, Work]
    since: float


class Batcher:
    """``threads`` decode threads over per-model queues of :class:`Work` (see the module docstring)."""

    def __init__(self, *, threads: int, batch_rows: int, slice_seconds: float) -> None:
        self.threads = threads
        self.batch_rows = batch_rows
        self.slice_seconds = slice_seconds
        self._cond = threading.Condition()
        # By id of the loaded model (each queued work and parked batch holds it, so the id stays its own).
        self._queues: dict[int, deque[Work]] = {}
        self._parked: dict[int, _Parked] = {}
        self._busy: set[int] = set()
        self._served: dict[str, float] = {}  # by team: when a thread last took a model of its
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
        """No more work; the threads leave at their next turn and the parked batches' requests end."""
        with self._cond:
            self._stopped = True
            parked, self._parked = list(self._parked.values()), {}
            self._cond.notify_all()
        for p in parked:
            for work in p.works.values():
                work.halt()

    # --- whose turn (the caller holds the lock) ---

    def _waiting(self, but: int | None = None) -> list[int]:
        """The models with work (queued requests or a parked batch) that no thread decodes."""
        keys = set(self._queues) | set(self._parked)
        return [k for k in keys if k not in self._busy and k != but]

    def _teams(self, key: int) -> set[str]:
        teams = {w.team for w in self._queues.get(key, ())}
        parked = self._parked.get(key)
        if parked is not None:
            teams.update(r.owner.team for r in parked.batch.rows)
        return teams

    def _turn(self, key: int) -> tuple[float, float]:
        """A model's place in line: its teams' least recent service first, then how long it has waited."""
        served = min((self._served.get(t, 0.0) for t in self._teams(key)), default=0.0)
        since = [self._parked[key].since] if key in self._parked else []
        if self._queues.get(key):
            since.append(self._queues[key][0].ticket.admitted_at)
        return served, min(since, default=0.0)

    # --- the decode threads ---

    def _next_model(self) -> tuple[LoadedModel, _Parked | None] | None:
        """The model whose turn it is (and its parked batch), marked busy; None when stopping."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                waiting = self._waiting()
                if waiting:
                    key = min(waiting, key=self._turn)
                    now = time.monotonic()
                    for team in self._teams(key):
                        self._served[team] = now
                    self._busy.add(key)
                    parked = self._parked.pop(key, None)
                    return (parked.batch.loaded if parked else self._queues[key][0].loaded), parked
                self._idle += 1
                self._cond.wait()
                self._idle -= 1

    def _loop(self) -> None:
        while (turn := self._next_model()) is not None:
            model, parked = turn
            try:
                self._decode(model, parked)
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

    def _decode(self, model: LoadedModel, parked: _Parked | None) -> None:
        """Decode ``model`` (from its parked batch, if any) until it has nothing left or its slice is
        over while another model waits."""
        import torch

        batch, works = (parked.batch, parked.works) if parked is not None else (Batch(model), {})
        batch_rows = prometheus.get().batch_rows
        slice_ends = time.monotonic() + self.slice_seconds
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
            if time.monotonic() >= slice_ends and self._yield_turn(model, batch, works):
                return

    def _yield_turn(self, model: LoadedModel, batch: Batch, works: dict[int, Work]) -> bool:
        """Park the batch when another model waits and no thread is free for it (True: the thread
        leaves the model); else the thread goes on."""
        key = id(model)
        with self._cond:
            if self._idle > 0 or not self._waiting(but=key):
                return False
            if not batch.empty:
                self._parked[key] = _Parked(batch, works, time.monotonic())
            return True

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
