"""What other work took of this process's CPUs (``tuner/measure/host_load.py``), the reading a
race uses to tell a neighbour's spell from its kernels' speed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tuner.measure.host_load import OtherLoad, busy_seconds

STAT = """cpu  500 0 300 9000 100 0 0 0 0 0
cpu0 100 20 50 4000 30 5 5 10 0 0
cpu1 400 0 250 5000 70 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_time_is_every_field_but_idle_and_io_wait_of_the_cpus_asked() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # cpu0: user 100 + nice 20 + system 50 + irq 5 + softirq 5 + steal 10 (idle, iowait left out)
    assert busy_seconds({0}, STAT) == pytest.approx(190 / ticks)
    assert busy_seconds({1}, STAT) == pytest.approx(650 / ticks)
    assert busy_seconds({0, 1}, STAT) == pytest.approx(840 / ticks)
    assert busy_seconds({2}, STAT) == 0


@pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                    reason="needs Linux's /proc/stat")
def test_a_process_spinning_on_one_of_our_cpus_is_read_as_other_work() -> None:
    """A child process spins on one of this process's CPUs for a second while this one sleeps:
    at least a third of that CPU's time reads as other work (a shared host may add more)."""
    cpus = sorted(os.sched_getaffinity(0))
    spin = f"import os, time; os.sched_setaffinity(0, {{{cpus[0]}}}); end = time.time() + 1.2\n" \
        "while time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.15)  # (the child's start-up)
        load = OtherLoad()
        time.sleep(1.0)
        share = load.share()
    finally:
        child.wait(timeout=30)
    assert share is not None and share >= 1 / (3 * len(cpus)), share
    assert share <= 1.0
