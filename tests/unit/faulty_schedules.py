"""Schedule applicators that misbehave for some micro-kernels, to show that a crashing or
hanging candidate costs only itself. Imported inside the tuner's worker process."""

from __future__ import annotations

import os
import signal
import time

from dietserve.kernels.apply import apply_kernel


def crash_or_hang(func, kernel, target, loop_partition=False):
    mr = kernel.tile_sizes("i")[0]
    if mr == 2:
        os.kill(os.getpid(), signal.SIGSEGV)  # as generated code or the compiler might
    if mr == 3:
        time.sleep(3600)  # a candidate that never finishes building
    return apply_kernel(func, kernel, target, loop_partition)
