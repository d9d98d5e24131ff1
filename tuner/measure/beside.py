"""A candidate timed beside a reference kernel of the same operator (``worker._measure``).

On the shared 2-core host the speed of the machine moved 2x within a minute, while two of our
kernels timed together kept their ratio within 0.96-1.07 (``tests/benchmarks/HISTORY.md``, the
thirty-third session). A search that times each candidate once, minutes apart, ranks them
partly by the spell each met. So a candidate's turns alternate with the turns of a reference
kernel fixed for its shape (``tune.Tuner.references``), and the tuner keeps the candidate's
ratio to it, scaled by the reference's median over the whole tune: every kernel of a shape is
then on one scale, whatever spell it was timed in. Over a reference timed beside them, four
tiles' timings 4 s apart for four minutes spread by a coefficient of variation of 0.19-0.26,
against 0.42-0.70 raw (ad hoc, the same HISTORY entry).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from .streaming import SharedCycle


@dataclass(frozen=True)
class Beside:
    """Medians of a paired timing: seconds per call of the candidate and of the reference, and
    the candidate's time over the reference's, round by round."""

    candidate_s: float
    reference_s: float
    ratio: float


def timed_beside(candidate: Callable[[], float], reference: Callable[[], float], rounds: int) -> Beside:
    """Call the turns ``candidate`` and ``reference`` (each returns its seconds per call) in
    turn, ``rounds`` rounds, the order reversed every other round so that neither always runs
    second (on a cache or a thread pool the first left warm). The ratio is the median of each
    round's, not the ratio of the medians: a spell that lasts one round falls on both its turns."""
    if rounds < 1:
        raise ValueError(f"need at least one round, got {rounds}")
    candidates, references = [], []
    for round_ in range(rounds):
        if round_ % 2 == 0:
            references.append(reference())
            candidates.append(candidate())
        else:
            candidates.append(candidate())
            references.append(reference())
    return Beside(statistics.median(candidates), statistics.median(references),
                  statistics.median(c / r for c, r in zip(candidates, references, strict=True)))


def reference_kernel(operator, job: dict):
    """(the main function, the packing) of the reference kernel a measuring ``job`` names, for
    its ``operator`` (``worker.JobOperator``), built and checked as its own measuring job was (and
    so kept from it); None where the job names none, its weight streams (the reference would read
    it from DRAM as well: no common spell), the kernels run elsewhere (a GPU or RPC: timed by the
    device's evaluator), or the reference fails its check (the candidate is then timed alone)."""
    from dietserve.kernels.microkernel import MicroKernel

    named = job.get("reference")
    if named is None or not operator.on_this_cpu or operator.weight_index is not None:
        return None
    entrant = {name: value for name, value in job.items() if name not in ("reference", "library", "abandon_above_s")}
    entrant.update(named)
    pack = MicroKernel.from_json(named["kernel"]).pack
    outcome = operator.built_and_checked(entrant, pack)
    return None if isinstance(outcome, dict) else (outcome[0]["main"], pack)


def time_beside_reference(operator, function, arguments: list, reference, shape: dict, job: dict) -> Beside:
    """``function`` (a candidate, warm) called on ``arguments`` timed beside ``reference``
    (``reference_kernel``) on ``shape``: ``job["repeat"]`` rounds, each turn as many calls as fill
    ``job["min_repeat_ms"]``."""
    reference_function, reference_pack = reference
    (reference_arguments,) = operator.call_arguments(shape, reference_pack)
    reference_function(*reference_arguments)  # warm-up, as the candidate's
    turns = SharedCycle(job.get("min_repeat_ms", 0) / 1e3)
    return timed_beside(partial(turns.turn, function, [arguments]),
                        partial(turns.turn, reference_function, [reference_arguments]), job.get("repeat", 5))
