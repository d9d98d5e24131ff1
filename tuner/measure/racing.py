"""Races inside the measurement worker (``worker.main``): several candidates, built and checked
as a measuring job builds them, timed on one shape in turn round after round (``tuner/race.py``
decides what races)."""

from __future__ import annotations

import time

import numpy as np

from .streaming import SharedCycle
from .worker import JobOperator, never_raises


def race_entrant(job: dict, kernel: str | None) -> dict:
    """The job that builds ``kernel`` (JSON, None: the default rule's) of a race ``job``: its
    build key is the one the kernel's own measuring job had, so a build kept from the search
    (``_BUILDS``, or a builder's library) is reused."""
    entrant = {name: value for name, value in job.items() if name not in ("kernels", "libraries", "race")}
    entrant["kernel"] = kernel
    if kernel is None:  # (the default kernel's own jobs carry no schedule function)
        entrant.pop("apply", None)
        entrant.pop("loop_partition", None)
    return entrant


def race(job: dict) -> dict:
    """Time ``job["kernels"]`` on ``job["shapes"][0]`` in turn, ``job["rounds"]`` rounds (the order
    reversed every other round), each turn one repeat of at least ``min_repeat_ms``; the weight
    from DRAM where ``job["stream"]`` (local CPU only); entrants clearly behind after
    ``job["screen_rounds"]`` rounds stop there (``raced_rounds``). A slow spell of a shared host then falls
    on every kernel alike, where kernels timed minutes apart in the search each met the host as
    it was then. Returns the median seconds per kernel (None where one failed: its error in
    ``errors``), the rounds each ran and ``others_share``, the share of this machine's CPUs
    other work took during the rounds (``host_load``; None over RPC); never raises."""
    return never_raises(_race, job)


def _race(job: dict, started: float) -> dict:
    from dietserve.kernels.microkernel import MicroKernel

    operator = JobOperator(job, stream=bool(job.get("stream")))
    (shape,) = job["shapes"]
    timers, errors = [], []
    cycle = SharedCycle(job.get("min_repeat_ms", 0) / 1e3)  # (streamed: one cursor over the copies for all)
    touched: set[int] = set()  # the packings whose weight copies were first touched already
    libraries = job.get("libraries") or [None] * len(job["kernels"])
    for kernel, library in zip(job["kernels"], libraries, strict=True):
        pack = 0 if kernel is None else MicroKernel.from_json(kernel).pack
        outcome = operator.built_and_checked({**race_entrant(job, kernel), "library": library}, pack)
        if isinstance(outcome, dict):  # a wrong result
            timers.append(None)
            errors.append(outcome["error"])
            continue
        function = outcome[0]["main"]
        sets = operator.call_arguments(shape, pack)
        if operator.on_this_cpu:
            # Warm-up: caches, page faults, the thread pool; streamed, the first touch of every
            # copy of the weight (once per packing).
            streamed_first = operator.weight_index is not None and pack not in touched
            for arguments in sets if streamed_first else sets[:1]:
                function(*arguments)
            touched.add(pack)
            # A turn is as many calls as fill ``min_repeat_ms``, timed here, hot or streamed:
            # TVM's time_evaluator adds a warm-up call to every turn and, where one call falls
            # short of the minimum, raises the count for good (a 7.5 ms kernel: three calls a
            # turn, two of them timed).
            timers.append(lambda f=function, s=sets: cycle.turn(f, s))
        else:
            # A GPU's calls return before the kernel ends, and over RPC each call is a round
            # trip: the evaluator times on the device, synchronised.
            evaluator = outcome[0].time_evaluator("main", operator.session.device, number=1, repeat=1,
                                                  min_repeat_ms=job.get("min_repeat_ms", 0))
            timers.append(lambda e=evaluator, a=sets[0]: e(*a).results[0])
            timers[-1]()  # warm-up: caches, page faults, the device's first launch
        errors.append(None)
    load = operator.other_load()
    latencies, rounds = raced_rounds(timers, job.get("rounds", 5), job.get("screen_rounds"), job.get("drop_margin"))
    return {"latencies": latencies, "rounds": rounds, "errors": errors, "error": None,
            "others_share": None if load is None else load.share(), "seconds": time.perf_counter() - started}


def raced_rounds(timers: list, rounds: int, screen_rounds: int | None = None,
                 drop_margin: float | None = None) -> tuple[list[float | None], list[int]]:
    """Call ``timers`` (each returns one turn's seconds; None: an entrant that failed) in turn,
    ``rounds`` rounds, the order reversed every other round. From ``screen_rounds`` on, an
    entrant that ran more than ``drop_margin`` times as long as the leader (the lowest median)
    in every round so far stops: it cannot win (stopping them cut a bert-base tune's race rounds
    by a third: ``tuner/race.py``). Returns each entrant's median seconds and the rounds it ran.

    A stopped entrant's time is its median ratio to the final leader over the rounds they
    shared, times the leader's median: a host that turns 1.8x slower after the screen (a
    neighbour's job starting) must not make a stopped entrant, timed before it, read fastest."""
    samples: list[list[float]] = [[] for _ in timers]
    running = [i for i, timer in enumerate(timers) if timer is not None]
    for round_ in range(rounds):
        for i in running if round_ % 2 == 0 else running[::-1]:
            samples[i].append(timers[i]())
        if screen_rounds is not None and drop_margin is not None and len(running) > 1 \
                and screen_rounds <= round_ + 1 < rounds:
            leader = min(running, key=lambda i: np.median(samples[i]))
            running = [i for i in running
                       if min(t / lead for t, lead in zip(samples[i], samples[leader], strict=True)) <= drop_margin]
            if len(running) == 1:
                break
    if not running:
        return [None] * len(timers), [0] * len(timers)
    leader = min(running, key=lambda i: np.median(samples[i]))
    lead = float(np.median(samples[leader]))
    latencies: list[float | None] = []
    for i, own in enumerate(samples):
        if not own:
            latencies.append(None)
        elif i in running:
            latencies.append(float(np.median(own)))
        else:
            latencies.append(float(np.median([t / samples[leader][r] for r, t in enumerate(own)])) * lead)
    return latencies, [len(own) for own in samples]
