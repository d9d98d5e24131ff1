"""Taking turns on the CPUs with another process: the server's batches and a tuning job's timed
runs, so that each timing is taken on cores no batch is using (timed beside the server's
batches, a serial kernel read as fast as a parallel one, and every reading was noise).

Two lock files, taken with ``flock``: a turnstile, then the turn itself. Whoever waits for the
turn holds the turnstile, so the other side cannot take the turn again before it, whatever the
scheduler's order: the two sides alternate when both want the CPUs. A side alone takes its turns
without waiting. The files live on this machine (``flock`` is per host): a path given to both
processes, created by the first to open it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class CpuTurns:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._files: tuple[int, int] | None = None  # (turnstile, turn) descriptors, opened on first use

    def _descriptors(self) -> tuple[int, int]:
        if self._files is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            turnstile = os.open(self.path.with_name(self.path.name + ".turnstile"), flags, 0o600)
            self._files = (turnstile, os.open(self.path, flags, 0o600))
        return self._files

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Holds the CPUs for the block (blocking: call it off an event loop)."""
        turnstile, turn = self._descriptors()
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)

    def remove(self) -> None:
        """Closes and deletes the lock files (the server that made them, as it stops)."""
        self.close()
        for path in (self.path, self.path.with_name(self.path.name + ".turnstile")):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._files is not None:
            for descriptor in self._files:
                os.close(descriptor)
            self._files = None


@contextlib.contextmanager
def cpu_turn(path: Path | str | None) -> Iterator[None]:
    """A turn on ``path``'s CPUs for the block; no turn-taking where ``path`` is None."""
    if path is None:
        yield
        return
    turns = CpuTurns(path)
    try:
        with turns.turn():
            yield
    finally:
        turns.close()
