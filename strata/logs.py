"""The log handler every entry point (the CLI, the server, its engine worker) installs."""

from __future__ import annotations

import logging
import sys


class StderrHandler(logging.StreamHandler):
    """Log lines to sys.stderr as it is when a line is written, not as it was when the handler
    was made (a caller that swaps stderr, as pytest's capture does, must not leave the handler
    writing to a closed stream)."""

    def __init__(self, fmt: str):
        super().__init__()
        self.setFormatter(logging.Formatter(fmt))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; sys.stderr wins
        pass
