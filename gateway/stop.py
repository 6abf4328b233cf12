"""Stop strings: cut the output before the first stop string, never send part of one.

Text arrives in pieces; a stop string can straddle pieces. The checker keeps
the whole output, searches only where a new match can start (the last
``len(longest stop) - 1`` old characters onward), and holds back that many
unsent characters, since they may turn out to be the start of a stop string.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop_strings: list[str]):
        self._stops = [s for s in stop_strings if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._num_sent = 0
        self.stopped = False

    def feed(self, new_text: str) -> str:
        """Add output text; return what may be sent now. Sets ``stopped`` on a match."""
        if self.stopped or not new_text:
            return ""
        search_from = max(len(self._text) - self._hold, 0)
        self._text += new_text
        match = self._first_match(search_from)
        if match is not None:
            self.stopped = True
            self._text = self._text[:match]
            return self._take(match)
        return self._take(len(self._text) - self._hold)

    def flush(self) -> str:
        """The request ended without a match: release the held-back text."""
        return "" if self.stopped else self._take(len(self._text))

    @property
    def text(self) -> str:
        """All output text so far (cut at the stop string once one matched)."""
        return self._text

    def _first_match(self, start: int) -> int | None:
        positions = [p for p in (self._text.find(s, start) for s in self._stops) if p >= 0]
        return min(positions) if positions else None

    def _take(self, end: int) -> str:
        if end <= self._num_sent:
            return ""
        out, self._num_sent = self._text[self._num_sent : end], end
        return out
