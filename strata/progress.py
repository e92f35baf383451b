"""Progress on stderr: a bar redrawn in place where stderr is a terminal, plain lines otherwise.

    meter = Meter("arena", total=nbytes, unit="bytes")   # "arena  1.20 / 4.00 GiB  2.10 GiB/s"
    meter.update(done); ...; meter.close()               # the bar is erased; plain: one line

    stages = LoadStages()                                # Engine.load(progress=stages)
    stages("dense weights", 0.4)                         # the stage in place, or its own line

A bar appears only after `delay` seconds (short work shows nothing) and redraws at most ten
times a second. Without a terminal a Meter prints its summary line at close, when it ran at least
`delay` seconds; LoadStages prints one line per stage.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TextIO

_REDRAW_S = 0.1
_ERASE = "\r\x1b[K"  # to the start of the line, then clear it


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _amount(n: float, unit: str) -> str:
    return f"{n / (1 << 30):.2f}" if unit == "bytes" else f"{int(n)}"


def _rate(n: float, seconds: float, unit: str) -> str:
    per_s = n / seconds if seconds > 0 else 0.0
    return f"{per_s / (1 << 30):.2f} GiB/s" if unit == "bytes" else f"{per_s:.1f} tok/s"


class Meter:
    """Work of a known size: bytes (shown in GiB, GiB/s) or tokens (tok/s)."""

    def __init__(self, label: str, total: float, unit: str = "bytes",
                 stream: TextIO | None = None, delay: float = 0.5):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)
        self.delay = delay
        self.t0 = time.perf_counter()
        self.done = 0.0
        self.shown = False
        self._last = 0.0

    def line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        unit = " GiB" if self.unit == "bytes" else " tokens"
        return (f"{self.label}  {_amount(self.done, self.unit)} / "
                f"{_amount(self.total, self.unit)}{unit}  [{bar}] {frac:4.0%}  "
                f"{_rate(self.done, time.perf_counter() - self.t0, self.unit)}")

    def update(self, done: float) -> None:
        self.done = done
        if not self.tty:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay or (now - self._last < _REDRAW_S and done < self.total):
            return
        self._last = now
        cols = shutil.get_terminal_size((100, 24)).columns
        self.stream.write(_ERASE + self.line()[:cols - 1])
        self.stream.flush()
        self.shown = True

    def layers(self, start: float, tokens: int, n_layers: int) -> LayerMarks:
        """The marks of one forward pass over `tokens` tokens after `start` done: the bar moves
        layer by layer (Transformer.forward calls marks.after(i) after layer i and the head)."""
        return LayerMarks(self, start, tokens, n_layers)

    def erase(self) -> None:
        """Erase the bar (work stopped before its end: no summary line)."""
        if self.shown:
            self.stream.write(_ERASE)
            self.stream.flush()
            self.shown = False

    def close(self) -> None:
        """Erase the bar; without a terminal, one line for work that took `delay` or more."""
        seconds = time.perf_counter() - self.t0
        if self.shown:
            self.erase()
        elif not self.tty and seconds >= self.delay:
            unit = " GiB" if self.unit == "bytes" else " tokens"
            print(f"strata: {self.label}: {_amount(self.done, self.unit)}{unit} in "
                  f"{seconds:.1f} s ({_rate(self.done, seconds, self.unit)})", file=self.stream)


class LayerMarks:
    """A forward pass's layers as a Meter's progress: after layer i of n (n: the head), the
    pass's tokens count as (i + 1) / (n + 1) done."""

    def __init__(self, meter: Meter, start: float, tokens: int, n_layers: int):
        self.meter, self.start, self.tokens, self.n = meter, start, tokens, n_layers

    def after(self, layer: int) -> None:
        self.meter.update(self.start + self.tokens * (layer + 1) / (self.n + 1))


class LoadStages:
    """Engine.load's progress hook (stage, fraction of the load): on a terminal the current
    stage in place, erased when the load ends; otherwise one plain line per stage."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)
        self.t0 = time.perf_counter()
        self.stage = ""

    def __call__(self, stage: str, fraction: float) -> None:
        if stage == self.stage:
            return
        self.stage = stage
        took = time.perf_counter() - self.t0
        if self.tty:
            cols = shutil.get_terminal_size((100, 24)).columns
            text = f"loading: {stage} ({fraction:.0%}, {took:.1f} s)"
            self.stream.write(_ERASE + text[:cols - 1])
        else:
            self.stream.write(f"strata: loading: {stage} ({took:.1f} s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.stage:
            self.stream.write(_ERASE)
            self.stream.flush()


class LiveRate:
    """Live tok/s while `strata generate` streams text to stdout: on a terminal that both
    streams share, a short status trails the cursor (drawn after each piece of text, erased
    before the next one); where only stderr is a terminal, a status line in place there."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None,
                 delay: float = 0.5):
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.enabled = is_terminal(self.err)
        self.shared = self.enabled and is_terminal(self.out) and _same_terminal(self.out,
                                                                                self.err)
        self.delay = delay
        self.t0 = time.perf_counter()
        self.col = 0  # where the text's last line ends (characters)
        self.drawn = False
        self._last = 0.0

    def text(self, piece: str, tokens: int) -> None:
        """Write a piece of the answer to stdout, then the status for `tokens` so far."""
        if self.drawn:
            self.err.write("\x1b[K" if self.shared else _ERASE)
            self.err.flush()
            self.drawn = False
        self.out.write(piece)
        self.out.flush()
        if "\n" in piece:
            self.col = len(piece.rsplit("\n", 1)[1])
        else:
            self.col += len(piece)
        now = time.perf_counter()
        if not self.enabled or now - self.t0 < self.delay or now - self._last < _REDRAW_S:
            return
        self._last = now
        status = f"[{tokens} tokens, {tokens / (now - self.t0):.1f} tok/s]"
        cols = shutil.get_terminal_size((100, 24)).columns
        if self.shared:
            if self.col % cols + len(status) + 2 >= cols:
                return  # no room on this line: the status would wrap
            self.err.write(f"\x1b7  \x1b[2m{status}\x1b[0m\x1b8")  # save, draw, restore cursor
        else:
            self.err.write(_ERASE + "generating " + status)
        self.err.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.err.write("\x1b[K" if self.shared else _ERASE)
            self.err.flush()
            self.drawn = False


def _same_terminal(a: TextIO, b: TextIO) -> bool:
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (OSError, ValueError, AttributeError):
        return False
