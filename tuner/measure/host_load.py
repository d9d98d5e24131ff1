"""How much of this process's CPUs other work took while a race ran (``racing.py``) or a
candidate was timed (``worker._measure``).

A race interleaves its finalists so that a slow spell of a shared host falls on each of them
alike. A neighbour that holds one core does not: it slows a kernel on every core (each call
waits for its slowest thread) and leaves a serial kernel, which the scheduler runs on the free
core, as fast as ever. One version-36 tune, raced while a test suite ran beside it, ranked a
serial tile of the context product 1.76x faster than a 16-wide tile on both cores that the
search had timed 2.02x faster than it, and planned T = 64-512 on the serial tile. So a race
reads what the rest of the machine did meanwhile: the busy time of its CPUs (``/proc/stat``:
all but idle and I/O wait; steal counts, a hypervisor's neighbour is one too) less this
process's own CPU time. A reading above ``CONTENDED_SHARE`` is timed again (``race.py``,
``tune.Tuner``).
"""

from __future__ import annotations

import os
import time

# Above this share of the CPUs taken by other work, a timing is done again. Quiet races on the
# 2-core host read 0-13% (a 10 ms clock tick is 4.5% of a 0.11 s race on 2 cores), races beside a
# process spinning on one core 45-52%.
CONTENDED_SHARE = 0.2

_STAT = "/proc/stat"
_IDLE_FIELDS = (3, 4)  # of "cpuN user nice system idle iowait irq softirq steal guest guest_nice"
_BUSY_FIELDS = 8  # user .. steal (guest time is already inside user)


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux: no /proc/stat either)
        return set()


def busy_seconds(cpus: set[int], stat_text: str) -> float:
    """The busy seconds of ``cpus`` in the text of ``/proc/stat``."""
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if int(name[3:]) in cpus:
            values = [int(v) for v in fields[:_BUSY_FIELDS]]
            busy += sum(v for i, v in enumerate(values) if i not in _IDLE_FIELDS)
    return busy / ticks


def _read_stat() -> str | None:
    try:
        with open(_STAT) as stat:
            return stat.read()
    except OSError:
        return None


def _own_seconds() -> float:
    own = os.times()  # (every thread of this process: the kernel's thread pool included)
    return own.user + own.system


class OtherLoad:
    """Started at construction; ``share()``: the fraction of this process's CPUs' time since then
    that other work used (0: none, 1: all of it), or None where the machine does not say
    (no ``/proc/stat``)."""

    def __init__(self) -> None:
        self.cpus = _cpus()
        text = _read_stat() if self.cpus else None
        self.start = None if text is None else (busy_seconds(self.cpus, text), _own_seconds(), time.monotonic())

    def share(self) -> float | None:
        text = _read_stat()
        if self.start is None or text is None:
            return None
        busy, own, wall = busy_seconds(self.cpus, text), _own_seconds(), time.monotonic()
        elapsed = (wall - self.start[2]) * len(self.cpus)
        if elapsed <= 0:
            return None
        others = (busy - self.start[0]) - (own - self.start[1])
        return min(1.0, max(0.0, others / elapsed))
