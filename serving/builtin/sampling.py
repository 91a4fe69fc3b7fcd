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

    :meth:`append` takes the next piece of decoded text (:meth:`update` the whole text so far) and
    returns the part that is safe to show: text that could still turn into a stop sequence (a suffix
    that is a prefix of one) and a trailing replacement character (a UTF-8 sequence cut between tokens)
    are held back until the next piece decides. Once a stop sequence appears, :attr:`stopped` is set and
    the text ends before it. Each piece costs its own length plus the longest stop sequence: the search
    starts where a stop sequence could still begin, never at the start of the text.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped = False
        self.text = ""  # what has been released so far
        self._decoded = ""  # everything received
        self._searched = 0  # no stop sequence starts before this offset
        self._longest = max((len(s) for s in stops), default=0)

    def update(self, decoded: str, *, final: bool = False) -> str:
        """Release what ``decoded`` (the choice's full text so far) allows; the new part is returned."""
        if decoded.startswith(self._decoded):
            return self.append(decoded[len(self._decoded) :], final=final)
        # An earlier piece of text changed (rare decoders): search it all again, keep what was sent.
        self._decoded, self._searched = "", 0
        return self.append(decoded, final=final, _rewritten=True)

    def append(self, piece: str, *, final: bool = False, _rewritten: bool = False) -> str:
        """Release what the text so far plus ``piece`` allows; the new part is returned."""
        if self.stopped:
            return ""
        decoded = self._decoded = self._decoded + piece
        start = max(0, self._searched - self._longest + 1)
        cut = min((i for i in (decoded.find(s, start) for s in self.stops) if i >= 0), default=-1)
        self._searched = len(decoded)
        if cut >= 0:
            self.stopped = True
            safe_end = cut
        elif final:
            safe_end = len(decoded)
        else:
            safe_end = len(decoded) - self._held_back(decoded)
        released = len(self.text)
        if safe_end <= released:
            return ""
        if _rewritten and decoded[:released] != self.text:  # what was sent changed: keep it, send no more
            return ""
        delta = decoded[released:safe_end]
        self.text += delta
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
