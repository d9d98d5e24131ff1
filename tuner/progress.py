"""A progress bar for tuning: redrawn in place on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24,
                 every_s: float = 10.0):
        self.total, self.label, self.width, self.every_s = max(1, total), label, width, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self._last_line = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int, detail: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not self._tty and not force and now - self._last_line < self.every_s:
            return
        self._last_line = now
        filled = min(self.width, self.width * done // self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} trials {now - self.started:6.1f}s {detail}"
        if self._tty:
            self.stream.write("\r" + line[:160].ljust(160))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, done: int, detail: str = "") -> None:
        self.update(done, detail, force=True)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
