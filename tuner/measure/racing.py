"""Races inside the measurement worker (``worker.main``): several candidates, built and checked
as a measuring job builds them, timed on one shape in turn round after round (``tuner/race.py``
decides what races)."""

from __future__ import annotations

import time

import numpy as np

from .streaming import SharedCycle
from .worker import (
    _built_and_checked,
    _freeze,
    _kernel_inputs,
    _session,
    _spec,
    _streamed_sets,
    _weight_copies,
    never_raises,
)


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
    from DRAM where ``job["stream"]`` (local CPU only). A slow spell of a shared host then falls
    on every kernel alike, where kernels timed minutes apart in the search each met the host as
    it was then. Returns the median seconds per kernel (None where one failed: its error in
    ``errors``); never raises."""
    return never_raises(_race, job)


def _race(job: dict, started: float) -> dict:
    from dietserve.kernels.host import target_cores
    from dietserve.kernels.microkernel import MicroKernel

    from ..ops import weight_input

    recipe = _freeze(job["recipe"])
    spec = _spec(recipe)
    target_kind = job["target"]["kind"]
    session = _session(job["device"], target_kind, target_cores(job["target"]))
    (shape,) = job["shapes"]
    key = tuple(sorted(shape.items()))
    weight_index = weight_input(spec) if job.get("stream") and session.remote is None \
        and target_kind == "llvm" else None
    timers, errors = [], []
    cycle = SharedCycle(job.get("min_repeat_ms", 0) / 1e3)  # (streamed: one cursor over the copies for all)
    touched: set[int] = set()  # the weight copies first touched already (one list per packing)
    libraries = job.get("libraries") or [None] * len(job["kernels"])
    for kernel, library in zip(job["kernels"], libraries, strict=True):
        pack = 0 if kernel is None else MicroKernel.from_json(kernel).pack
        outcome = _built_and_checked({**race_entrant(job, kernel), "library": library}, spec, recipe, session, pack)
        if isinstance(outcome, dict):  # a wrong result
            timers.append(None)
            errors.append(outcome["error"])
            continue
        function = outcome[0]["main"]
        arrays = _kernel_inputs(recipe, key, pack)
        output = session.tensor(np.empty(spec.output_shape(shape), "float32"))
        inputs = [session.tensor(x) for x in arrays]
        if weight_index is not None:
            weights = _weight_copies(session, recipe, pack, arrays[weight_index])
            sets = _streamed_sets(spec, shape, inputs, output, weight_index, weights)
            for arguments in sets if id(weights) not in touched else sets[:1]:
                function(*arguments)  # first touch of every copy (page faults) and of the kernel
            touched.add(id(weights))
            timers.append(lambda f=function, s=sets: cycle.turn(f, s))
        else:
            evaluator = outcome[0].time_evaluator("main", session.device, number=job.get("number", 3), repeat=1,
                                                  min_repeat_ms=job.get("min_repeat_ms", 0))
            args = spec.call_arguments(shape, inputs, output)
            timers.append(lambda e=evaluator, a=args: e(*a).results[0])
            timers[-1]()  # warm-up: caches, page faults, the thread pool
        errors.append(None)
    samples: list[list[float]] = [[] for _ in timers]
    order = [i for i, timer in enumerate(timers) if timer is not None]
    for round_ in range(job.get("rounds", 5)):
        for i in order if round_ % 2 == 0 else order[::-1]:
            samples[i].append(timers[i]())
    return {"latencies": [float(np.median(s)) if s else None for s in samples], "errors": errors, "error": None,
            "seconds": time.perf_counter() - started}
