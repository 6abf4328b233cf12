"""Stop strings: cut the output before the first stop string (or after it, with vLLM's
``include_stop_str_in_output``), never send part of one before it is decided.

Text arrives in pieces; a stop string can straddle pieces. The checker keeps
the whole output, searches only where a new match can start (the last
``len(longest stop) - 1`` old characters onward), and holds back that many
unsent characters, since they may turn out to be the start of a stop string.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop_strings: list[str], include_stop: bool = False):
        """``include_stop``: the text ends after the matched stop string instead of before it."""
        self._stops = [s for s in stop_strings if s]
        self._include = include_stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._num_sent = 0
        self._unmatched = 0  # text up to here was fed with match=False: no stop string may end in it
        self.stopped = False

    def feed(self, new_text: str, match: bool = True) -> str:
        """Add output text; return what may be sent now. Sets ``stopped`` on a match. With
        ``match`` False (min_tokens not reached) the text cannot stop the output; a stop string
        that ends in text fed later still can, even if it starts here (as vLLM checks)."""
        if self.stopped or not new_text:
            return ""
        search_from = max(len(self._text) - self._hold, 0)
        self._text += new_text
        if not match:
            self._unmatched = len(self._text)
        found = self._first_match(search_from) if match else None
        if found is not None:
            start, stop = found
            end = start + len(stop) if self._include else start
            self.stopped = True
            self._text = self._text[:end]
            return self._take(end)
        return self._take(len(self._text) - self._hold)

    def flush(self) -> str:
        """The request ended without a match: release the held-back text."""
        return "" if self.stopped else self._take(len(self._text))

    @property
    def text(self) -> str:
        """All output text so far (cut at the stop string once one matched)."""
        return self._text

    def _first_match(self, start: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest match ending past the unmatched text; at one
        position, the first listed."""
        found = [(p, i) for i, p in enumerate(self._find(s, start) for s in self._stops) if p >= 0]
        if not found:
            return None
        position, index = min(found)
        return position, self._stops[index]

    def _find(self, stop: str, start: int) -> int:
        position = self._text.find(stop, start)
        while 0 <= position and position + len(stop) <= self._unmatched:
            position = self._text.find(stop, position + 1)
        return position

    def _take(self, end: int) -> str:
        if end <= self._num_sent:
            return ""
        out, self._num_sent = self._text[self._num_sent : end], end
        return out
