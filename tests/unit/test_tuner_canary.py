"""The canary that tells a slow spell of the machine from a slow kernel: it computes on every
core, a real busy neighbour on one core reads as a spell, and a timing taken in a spell is
taken again, keeping the fastest attempt."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm

from dietserve.kernels.host import available_cpus, configure_cpu_threads, host_cpu
from tuner.measure.canary import ACCUMULATORS, SPELL_RATIO, STEPS, Canary, gated
from tuner.measure.runner import LocalRunner, MeasureOptions

CORES = len(available_cpus())


def host_canary() -> Canary:
    configure_cpu_threads()
    target = tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": CORES})
    return Canary(target, CORES, lanes=8)


def test_the_canary_runs_its_multiply_adds_on_every_core() -> None:
    canary = host_canary()
    canary.time()
    expected = np.float32(1.0)
    for _ in range(STEPS):  # the recurrence in float32, one step at a time (numpy's rounding)
        expected = np.float32(expected * np.float32(0.999) + np.float32(0.001))
    out = canary.arguments[1].numpy()
    assert out.shape == (CORES, ACCUMULATORS * 8)
    # LLVM may fuse the multiply and the add (one rounding, not two): within a few ulps per step
    np.testing.assert_allclose(out, np.full(out.shape, expected), rtol=1e-4)
    assert 0 < canary.best < 0.01


@pytest.mark.skipif(CORES < 2, reason="a neighbour on one core needs two cores to tell it apart")
def test_a_busy_neighbour_on_one_core_reads_as_a_spell() -> None:
    canary = host_canary()
    quiet = min(canary.time() for _ in range(20))
    assert not canary.slow(quiet)
    core = available_cpus()[-1]
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        time.sleep(0.3)
        readings = [canary.time() for _ in range(20)]
    finally:
        burner.kill()
        burner.wait()
    # the canary's task on that core gets about half of it: the whole call waits for it
    assert np.median(readings) >= SPELL_RATIO * canary.best
    assert sum(canary.slow(reading) for reading in readings) >= 15
    time.sleep(0.3)
    assert not canary.slow(min(canary.time() for _ in range(20)))


class ScriptedCanary:
    """Readings in a given order (spell or not), for ``gated``'s bookkeeping alone."""

    def __init__(self, slow_readings: list[bool]):
        self.readings = list(slow_readings)

    def time(self) -> float:
        return 2.0 if self.readings.pop(0) else 1.0

    def slow(self, reading: float) -> bool:
        return reading >= SPELL_RATIO


def test_a_timing_in_a_spell_is_taken_again_and_the_fastest_kept() -> None:
    timings = iter([5.0, 3.0, 4.0])
    # first attempt: slow after; second: slow before; third: quiet
    value, spells = gated(lambda: next(timings), ScriptedCanary([False, True, True, False, False, False]),
                          retries=3, pause_s=0)
    assert (value, spells) == (3.0, 2)
    # a spell that outlasts the retries: every attempt counted, the fastest kept
    value, spells = gated(iter([2.0, 1.5]).__next__, ScriptedCanary([True] * 4), retries=1, pause_s=0)
    assert (value, spells) == (1.5, 2)
    assert gated(lambda: 7.0, None) == (7.0, 0)


@pytest.mark.skipif(CORES < 2, reason="a neighbour on one core needs two cores to tell it apart")
def test_the_worker_takes_timings_again_while_a_neighbour_is_busy() -> None:
    """A worker's first job calibrates its canary on the quiet machine; a job timed while a
    real busy process shares one core has every timing spoiled and taken again (and counted).
    With the check off, nothing is counted."""
    from tests.unit.test_tuner_measure import job, kernel

    core = available_cpus()[-1]
    results = {}
    for spell_check in (True, False):
        with LocalRunner(MeasureOptions(number=1, repeat=1, timeout_s=120, spell_check=spell_check)) as runner:
            quiet = runner.run(job(kernel(4)))
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                      preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            try:
                time.sleep(0.3)
                results[spell_check] = runner.run({**job(kernel(4)), "shapes": [{"T": 64}]})
            finally:
                burner.kill()
                burner.wait()
        assert quiet["error"] is None
    assert results[True]["error"] is None and results[True]["spells"] >= 2
    assert results[False]["error"] is None and results[False]["spells"] == 0
