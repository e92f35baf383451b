"""Stop strings: the text is cut just before the first one, and nothing past it is ever sent.

Text that could be the start of a stop string is held back until the next piece decides it, so a
stop string split across tokens is still found. Invariant: everything released so far contains no
stop string and ends with no proper prefix of one.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that can be released now; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = "", True
            return buf[:cut]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text was not a stop string after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
