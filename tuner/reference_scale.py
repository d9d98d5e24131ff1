"""Each shape's measurements on one scale: a reference kernel's (``measure/beside.py``).

On the shared host a kernel timed alone reads the spell it met: the machine's speed moved 2x
within a minute, and a search that times its candidates minutes apart ranked them partly by
when each was timed. So on each shape a reference kernel is timed beside every later candidate
(its turns alternate with theirs, in the worker), and a candidate's measurement there is its
ratio to the reference times the reference's median over every timing of the tune (its
``level``): a slow spell then moves the level's samples, not the ranking.

The reference of a shape is the first kernel measured there on every core (a serial one is not
slowed alike by a neighbour holding one core), not abandoned as hopeless. A candidate that runs
``SWITCH_RATIO`` times as fast takes over: at T = 512 a reference three times the best costs a
tune three of the best's calls a turn. The scale carries over (every ratio divided by the new
reference's, the level's samples multiplied by it). A measurement made without the reference
beside it (timed once as hopeless, reused from the records, or on a machine that does not
time so) enters at its latency over the level of the moment.
"""

from __future__ import annotations

import statistics

from dietserve.kernels.microkernel import MicroKernel

SWITCH_RATIO = 1.5  # a candidate this much faster than the reference becomes the shape's reference


class ReferenceScale:
    """Per shape key: the reference kernel, its timings, every kernel's ratio to it (the default
    kernel is None)."""

    def __init__(self) -> None:
        self._references: dict[tuple, MicroKernel] = {}
        self._times: dict[tuple, list[float]] = {}
        self._ratios: dict[tuple, dict[MicroKernel | None, float]] = {}

    def reference(self, key: tuple) -> MicroKernel | None:
        """The kernel to time beside candidates on the shape ``key``; None before there is one."""
        return self._references.get(key)

    def level(self, key: tuple) -> float:
        """The reference's median seconds on the shape ``key`` over the tune."""
        return statistics.median(self._times[key])

    def timed(self, key: tuple, kernel: MicroKernel | None, latency: float, beside: dict | None,
              measured: dict[MicroKernel | None, float], hopeless: bool = False) -> dict[MicroKernel | None, float]:
        """A timing of ``kernel`` on the shape ``key``: ``latency`` (seconds), and ``beside``, the
        reference's seconds and the ratio to them where the worker timed it beside the
        reference (``worker._measure``). ``measured``: the shape's measurements so far, which
        the first reference puts on its scale. ``hopeless``: timed once, over the abandon bar.
        Returns the measurements of the shape to keep (every one, where the level moved)."""
        reference = self._references.get(key)
        if reference is not None and beside is not None:
            self._times[key].append(beside["seconds"])
            self._ratios[key][kernel] = beside["ratio"]
            if kernel is not None and kernel.threads != 1 and beside["ratio"] * SWITCH_RATIO <= 1.0:
                self._switch(key, kernel)
        elif reference is not None:
            self._ratios[key][kernel] = latency / self.level(key)
        elif kernel is not None and kernel.threads != 1 and not hopeless:
            self._references[key] = kernel
            self._times[key] = [latency]
            self._ratios[key] = {k: t / latency for k, t in measured.items()}
            self._ratios[key][kernel] = 1.0
        else:
            return {kernel: latency}
        level = self.level(key)
        return {k: ratio * level for k, ratio in self._ratios[key].items()}

    def replaced(self, key: tuple, kernel: MicroKernel | None, latency: float) -> None:
        """``kernel``'s measurement on ``key`` set from elsewhere (a race): kept as it is when the
        level moves later."""
        if key in self._references:
            self._ratios[key][kernel] = latency / self.level(key)

    def _switch(self, key: tuple, kernel: MicroKernel) -> None:
        factor = self._ratios[key][kernel]
        self._references[key] = kernel
        self._times[key] = [t * factor for t in self._times[key]]
        self._ratios[key] = {k: r / factor for k, r in self._ratios[key].items()}
