"""What one generation asks for (:class:`SamplingParams`) and the text side of stop sequences
(:class:`StopText`); no torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    #: New tokens per choice; None = as many as the model's context and the server allow.
    max_tokens: int | None = None
    #: 0 = greedy; otherwise softmax temperature.
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    #: Seeds this request's own random generator (other requests never touch it).
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class StopText:
    """The visible text of one choice as its tokens arrive, cut before the first stop sequence.

    :meth:`update` takes the whole decoded text so far and returns the part that is safe to show:
    text that could still turn into a stop sequence (a suffix that is a prefix of one) and a trailing
    replacement character (a UTF-8 sequence cut between tokens) are held back until the next token
    decides. Once a stop sequence appears, :attr:`stopped` is set and the text ends before it.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped = False
        self.text = ""  # what has been released so far

    def update(self, decoded: str, *, final: bool = False) -> str:
        """Release what ``decoded`` (the choice's full text so far) allows; the new part is returned."""
        if self.stopped:
            return ""
        cut = min((i for i in (decoded.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            safe = decoded[:cut]
        elif final:
            safe = decoded
        else:
            safe = decoded[: len(decoded) - self._held_back(decoded)]
        if not safe.startswith(self.text):  # a token changed earlier text (rare decoders): keep what was sent
            return ""
        delta = safe[len(self.text) :]
        self.text = safe
        return delta

    def _held_back(self, decoded: str) -> int:
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(decoded)), 0, -1):
                if decoded.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        if decoded.endswith("\ufffd"):
            hold = max(hold, len(decoded) - len(decoded.rstrip("\ufffd")))
        return hold
