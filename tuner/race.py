"""Finalists raced: the kernels a plan weighs nearly alike on a shape, timed again side by side.

The search times each candidate once, when it is proposed. On a shared host the same kernel read
up to 1.5x apart minutes apart (``tests/benchmarks/HISTORY.md``, the nineteenth to twenty-first
sessions), so kernels within a few per cent of each other on a shape were ranked by the moment
each was timed, and fresh 64-trial tunes of the same layers picked differently from run to run
(tiles whose tasks took one panel or eight, alternating along the lengths). So before the final
plan, on every measured shape where more than one kernel is within ``RACE_MARGIN`` of the best,
as the plan ranks them, the ``RACE_SIZE`` best (and the best serial kernel and the best on every
core, however far behind) are timed again in turn, ``RACE_ROUNDS`` rounds (``racing.race``): a
slow spell of the host then falls on each of them alike. A finalist clearly behind the leader in
each of the first ``SCREEN_ROUNDS`` rounds stops there: the rounds go to the close ones.

- A race reads how much of the CPUs other work took while it ran (``measure/host_load.py``): a
  neighbour on one core slows the kernels on every core and not the serial ones, which no
  interleaving evens out. Above ``CONTENDED_SHARE`` it is run again, and if the machine is as
  busy then, the shape keeps the search's times.
- Every race is timed with the weight in cache, as the search was, and its times replace the
  finalists' measurements there, scaled to keep their geometric mean (the level the search
  measured everything else at); the estimates of the shapes around are carried from them.
- On a shape a finalist passes over in at most ``STREAM_BOUND_PASSES`` row passes, the plan
  ranks dense kernels as served, by a model of the weight's stream (``weight_stream``), which
  knows neither how a kernel's tasks split the weight nor how its prefetches fare. There the
  finalists race once more, reading the weight from DRAM (local CPU runs), and those times
  correct the model at that shape, kernel by kernel (``Tuner.corrections``): the finalists then
  rank there as they raced, at the model's level.

The packing is raced too, before the search commits to it (``race_packings``): there a plan's
choice between panel widths rests on one timing of each width's kernels per shape, and a slow
spell during the few timings of one width committed bert-base's 768 -> 3072 layer to 24-wide
panels, whose best tiles took 1.06 / 1.19 / 1.07x as long as the 16-wide ones at T = 128 / 256 /
512 timed side by side (``forced_kernels.py``). On the measured shape costing the most and one at
most half as long, the best kernel of each width races (and the one the cost model expects to be
its best), and a plan's packing that lost there by more than ``PACKING_RACE_MARGIN`` gives way.

Last, the plan's choices that rest on predictions carried far are raced
(``race_unmeasured_intervals``): the search spends its trials where the traffic costs most, so a
plan's short shapes can go to a kernel never timed near them. Where an interval's variant was
never measured in it, or not over a stretch of lengths ``STRETCH_RATIO`` apart, it races the
plan's next best there, and the plan is made again.

A race is a re-timing, not a trial: the budget does not count it and the records database does
not hold it (the records are the search's own measurements); the plan's provenance counts them.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from .commitment import STREAM_BOUND_PASSES
from .dispatch import shape_key, unmeasured_stretches
from .measure.host_load import CONTENDED_SHARE
from .planning import plan_candidates, ranking
from .progress import ProgressBar
from .weight_stream import weight_bytes

RACE_MARGIN = 1.2  # kernels within this of a shape's best (as the plan ranks them) race there
RACE_SIZE = 4  # at most this many a shape
RACE_ROUNDS = 7  # each kernel timed this many times, in turn with the others
# ... unless, after SCREEN_ROUNDS, it ran more than DROP_MARGIN times as long as the leader in
# every round: it stops there (``racing.raced_rounds``). Replayed on a bert-base tune's 61
# races, stopping so cut the rounds' time by a third and changed no race's winner.
SCREEN_ROUNDS = 3
DROP_MARGIN = 1.05
# A streamed race corrects the model by at most this factor either way: beyond, the race itself
# is in doubt (a neighbour's burst within one kernel's turns) more than the model. (A parallel
# kernel timed in a spell 1.4x behind a serial one, raced 2x ahead of it: 0.6x and 1.7x.)
CORRECTION_LIMIT = 2.0
# The packing race: on this many measured shapes (the costliest, then the costliest at most half
# as long, ...), each width's best kernels, raced; the plan's packing stands unless its weighted
# total there is more than PACKING_RACE_MARGIN times the winner's. The slow spells it is for put
# a width 1.3-3x behind; bert-base's 3072 -> 768 layer's widths tie at T = 500 within 3%, and
# races of its two costliest shapes (both near 500) came out either way.
PACKING_RACE_SHAPES = 2
PACKING_RACE_MARGIN = 1.05
# A race during which other work took more than ``CONTENDED_SHARE`` of the CPUs (``host_load``)
# is run again, at most this many runs in all; if the last is as busy, the shape keeps the
# search's times. A neighbour on one core slows a kernel on every core and not a serial one, and
# a race beside it ranks them so: one such race put a serial tile 1.76x ahead of one on both
# cores that the search had timed 2.02x faster than it.
CONTENDED_RUNS = 2
# Where the final plan's choice rests on predictions carried across lengths at least
# STRETCH_RATIO apart (or an interval has no measurement at all), it races INTERVAL_RACE_SIZE
# kernels for INTERVAL_RACE_ROUNDS rounds, then the plan is made again, at most INTERVAL_CHECKS
# times (``race_unmeasured_intervals``). The errors it is for are large (1.5-3x), so fewer kernels
# and rounds than the finalists' races: with 4 kernels and 7 rounds these races added 5.5-13.1 s
# to a 64-trial operator's 40-45 s.
STRETCH_RATIO = 2.0
INTERVAL_RACE_SIZE = 3
INTERVAL_RACE_ROUNDS = 3
INTERVAL_CHECKS = 2


@dataclass
class RaceSummary:
    """What a tune's races did (the plan's provenance carries it)."""

    shapes: int = 0  # shapes raced
    streamed: int = 0  # of them, with the weight from DRAM
    reordered: int = 0  # where the fastest finalist changed
    stopped: int = 0  # finalists that stopped after SCREEN_ROUNDS, clearly behind
    failed: int = 0  # races that came back with an error (their shapes keep the search's times)
    contended: int = 0  # races run twice beside other work (their shapes keep the search's times)
    packings: int = 0  # shapes where the packings raced before the commit (``race_packings``)
    intervals: int = 0  # plan intervals chosen on predictions carried far, raced (``race_unmeasured_intervals``)
    seconds: float = 0.0

    def describe(self) -> dict:
        return {"races": {**asdict(self), "seconds": round(self.seconds, 1)}}


def race_packings(tuner, widths: set[int], planned: int | None, summary: RaceSummary) -> int | None:
    """The packing to commit ``tuner`` to: ``planned`` (the plan's, ``PlanCommitment.choose_packing``)
    unless the ``widths`` raced on up to ``PACKING_RACE_SHAPES`` measured shapes say another is
    faster there by more than ``PACKING_RACE_MARGIN`` (weighted by the shapes' weights): the one
    costing the most (weight x FLOPs), then the one costing the most of those at most half as
    long, and so on (the widths of bert-base's FFN layers tie within 2-7% at T = 512 and differ
    by 10-19% at 256). Each width races its best kernel measured there and the one the cost model
    expects to be its best (the search may have timed only a poor kernel of a width on a shape: a
    serial one, or a one-row tile); a width's time is its faster one's. The races decide the packing
    and change no measurement. ``planned`` where nothing can race, or None was planned."""
    race = getattr(tuner.runner, "race", None)
    if planned is None or race is None or not tuner.options.race:
        return planned
    started = time.monotonic()
    totals, raced = dict.fromkeys(widths, 0.0), 0
    below = float("inf")  # the next raced shape's dispatch value at most this: half the last one's
    for shape, weight in tuner.by_cost():
        if raced == PACKING_RACE_SHAPES:
            break
        measured = tuner.measured.get(shape_key(shape))
        if not measured or tuner.task.dispatch_value(shape) > below:
            continue
        entrants = {}
        for width in sorted(widths):
            of_width = [k for k in measured if k.pack == width]
            space = [k for k in tuner.space if k.pack == width and k not in tuner.failed]
            if of_width and space:
                entrants[width] = list(dict.fromkeys([min(of_width, key=measured.get),
                                                      tuner.commitment.by_prediction(space, shape)[0]]))
        if len(entrants) < len(widths):
            continue
        finalists = [k for kernels in entrants.values() for k in kernels]
        _build_ahead(tuner, [(shape, finalists)])
        times = _race(tuner, race, shape, finalists, stream=False, summary=summary)
        if times is None or any(not any(k in times for k in kernels) for kernels in entrants.values()):
            continue
        raced += 1
        below = tuner.task.dispatch_value(shape) / 2
        fastest = {width: min(times[k] for k in kernels if k in times) for width, kernels in entrants.items()}
        for width, latency in fastest.items():
            totals[width] += weight * latency
        tuner.log(f"{tuner.task.workload}: the packings raced at {shape}: "
                  + ", ".join(f"{width}-wide {latency * 1e3:.3f} ms" for width, latency in sorted(fastest.items())))
    summary.packings += raced
    summary.seconds += time.monotonic() - started
    if not raced:
        return planned
    winner = min(totals, key=totals.get)
    if totals[planned] <= PACKING_RACE_MARGIN * totals[winner]:
        return planned
    tuner.log(f"{tuner.task.workload}: the packings raced on {raced} shapes: {winner}-wide panels ran "
              f"{totals[planned] / totals[winner]:.2f}x as fast as the {planned}-wide ones the plan took")
    return winner


def race_finalists(tuner, bar: ProgressBar | None = None, deadline: float | None = None,
                   summary: RaceSummary | None = None) -> RaceSummary:
    """Race the finalists of every measured shape of ``tuner`` (a ``tune.Tuner``), updating its
    measurements (hot races) and its stream-model corrections (streamed ones, where the stream
    bounds a finalist), until
    ``deadline`` (``time.monotonic()``; the tune's time budget) if given. Nothing where the
    runner cannot race (``race`` missing: a synthetic machine) or the options say not to.
    ``summary``: counts to add to (the packing race's), else a fresh one."""
    summary = summary if summary is not None else RaceSummary()
    race = getattr(tuner.runner, "race", None)
    if race is None or not tuner.options.race:
        return summary
    started = time.monotonic()
    _hot, served = ranking(tuner)
    candidates = plan_candidates(tuner)
    keys = sorted((key for key in set(tuner.measured) | set(tuner.default_measured)),
                  key=lambda key: tuner.task.dispatch_value(dict(key)))
    races = [(dict(key), finalists) for key in keys if len(finalists := _finalists(tuner, candidates, served, key)) > 1]
    if races and (deadline is None or time.monotonic() < deadline):
        _build_ahead(tuner, races)
    for shape, finalists in races:
        if deadline is not None and time.monotonic() >= deadline:
            tuner.log(f"{tuner.task.workload}: time budget reached; {len(races) - summary.shapes} shapes not raced")
            break
        key = shape_key(shape)
        summary.shapes += 1
        # Hot first, always: its times replace the search's, and kernels' estimates on the shapes
        # around are carried from them. Then, where the stream bounds a finalist, from DRAM.
        times = _race(tuner, race, shape, finalists, stream=False, summary=summary)
        if times is None:
            continue
        _keep_level(tuner, key, times)
        stream = _can_stream(tuner) and any(_stream_bound(tuner, k, shape) for k in finalists)
        if stream:
            streamed = _race(tuner, race, shape, finalists, stream=True, summary=summary)
            if streamed is not None:
                summary.streamed += 1
                times = streamed
                _hot, served = ranking(tuner)  # (with the hot race's times)
                ratios = {k: t / served(k, shape) for k, t in times.items()}
                middle = _geomean(ratios.values())
                tuner.corrections[key] = {k: min(max(r / middle, 1 / CORRECTION_LIMIT), CORRECTION_LIMIT)
                                          for k, r in ratios.items()}
        fastest = min(times, key=times.get)
        if fastest != finalists[0] and finalists[0] in times:
            summary.reordered += 1
            tuner.log(f"{tuner.task.workload}: raced at {shape}{' (weight from DRAM)' if stream else ''}: "
                      f"{fastest or 'the default kernel'} ran {times[finalists[0]] / times[fastest]:.2f}x "
                      f"as fast as the search's pick, {finalists[0] or 'the default kernel'}")
        if bar is not None:
            bar.update(tuner.trials, f"| raced {summary.shapes} shapes")
    elapsed = time.monotonic() - started
    summary.seconds += elapsed
    if summary.shapes:
        tuner.log(f"{tuner.task.workload}: raced the finalists of {summary.shapes} shapes "
                  f"({summary.streamed} with the weight from DRAM) in {elapsed:.1f} s; "
                  f"the fastest changed at {summary.reordered}"
                  + (f"; {summary.contended} ran beside other work and left the search's times"
                     if summary.contended else ""))
    return summary


def race_unmeasured_intervals(tuner, bar: ProgressBar | None = None, deadline: float | None = None,
                              summary: RaceSummary | None = None) -> RaceSummary:
    """Race, where an interval of ``tuner``'s plan rests on predictions carried far
    (``dispatch.unmeasured_stretches``: a stretch of lengths ``STRETCH_RATIO`` apart where its
    variant was not measured, or no measurement in it at all), that variant beside the
    ``INTERVAL_RACE_SIZE`` - 1 others the plan ranks best there, ``INTERVAL_RACE_ROUNDS`` rounds;
    their times become measurements (scaled to the search's level where the shape had some), and
    the plan is made again, at most ``INTERVAL_CHECKS`` times.

    The search spends its trials where the traffic costs most, so the short shapes get few, and
    a plan's choices there rest on predictions carried from longer ones. Fused with its softmax,
    bert-base's scores went to a 1 x 32-row tile 48 columns wide at T = 2-25 (measured only at
    T = 512): at T = 16 it took 45.6 us where the plan's other tiles took 14-29 (ad hoc)."""
    summary = summary if summary is not None else RaceSummary()
    race = getattr(tuner.runner, "race", None)
    if race is None or not tuner.options.race:
        return summary
    started, raced, changed = time.monotonic(), 0, 0
    for _check in range(INTERVAL_CHECKS):
        if deadline is not None and time.monotonic() >= deadline:
            break
        try:
            plan = tuner.plan()
        except RuntimeError:  # nothing measured successfully
            break
        intervals = unmeasured_stretches(plan, STRETCH_RATIO)
        if not intervals:
            break
        _hot, served = ranking(tuner)
        candidates = plan_candidates(tuner)
        for name, shape in intervals:
            if deadline is not None and time.monotonic() >= deadline:
                break
            chosen = plan.kernel(name)
            ranked = sorted((k for k in candidates if k != chosen), key=lambda k, shape=shape: served(k, shape))
            finalists = [chosen, *ranked[:INTERVAL_RACE_SIZE - 1]]
            _build_ahead(tuner, [(shape, finalists)])
            times = _race(tuner, race, shape, finalists, stream=False, summary=summary, rounds=INTERVAL_RACE_ROUNDS)
            if times is None:
                continue
            raced += 1
            _keep_level(tuner, shape_key(shape), times)
            fastest = min(times, key=times.get)
            if chosen in times and fastest != chosen:
                changed += 1
                tuner.log(f"{tuner.task.workload}: raced at {shape}, where the plan chose "
                          f"{chosen or 'the default kernel'} on predictions: "
                          f"{fastest or 'the default kernel'} ran "
                          f"{times[chosen] / times[fastest]:.2f}x as fast")
            if bar is not None:
                bar.update(tuner.trials, f"| raced {raced} intervals")
    summary.intervals += raced
    summary.seconds += time.monotonic() - started
    if raced:
        tuner.log(f"{tuner.task.workload}: raced {raced} intervals chosen on predictions carried far in "
                  f"{time.monotonic() - started:.1f} s; another kernel was faster at {changed}")
    return summary


def _keep_level(tuner, key: tuple, times: dict) -> None:
    """Raced ``times`` become the shape ``key``'s measurements, scaled so the kernels measured
    there before keep their geometric mean (the level the search measured everything at); as
    they are where none was."""
    known = [k for k in times if (key in tuner.default_measured if k is None else k in tuner.measured.get(key, {}))]
    scale = (_geomean([tuner.measured_latency(k, key) for k in known]) / _geomean([times[k] for k in known])
             if known else 1.0)
    for k, t in times.items():
        tuner.set_measured(k, key, t * scale)


def _race(tuner, race, shape: dict, finalists: list, stream: bool, summary: RaceSummary,
          rounds: int = RACE_ROUNDS) -> dict | None:
    """{kernel: median seconds} of ``finalists`` raced on ``shape`` (None where the race failed,
    or fewer than two came back)."""
    job = tuner._job(shape, {
        "kernels": [None if k is None else k.to_json() for k in finalists], "rounds": rounds,
        "screen_rounds": SCREEN_ROUNDS, "drop_margin": DROP_MARGIN,
        "stream": stream, "apply": tuner.options.apply, "loop_partition": tuner.options.loop_partition})
    for _run in range(CONTENDED_RUNS):
        result = race(job)
        if result.get("error") is not None:
            summary.failed += 1
            tuner.log(f"{tuner.task.workload}: the race at {shape} failed ({result['error']}); its search times stand")
            return None
        others = result.get("others_share")
        if others is None or others <= CONTENDED_SHARE:
            break
    else:
        summary.contended += 1
        tuner.log(f"{tuner.task.workload}: other work took {others:.0%} of the CPUs while the race at {shape} ran"
                  f" ({CONTENDED_RUNS} runs); its search times stand")
        return None
    ran = result.get("rounds") or []
    summary.stopped += sum(0 < n < max(ran) for n in ran)
    times = {k: t for k, t in zip(finalists, result["latencies"], strict=True) if t is not None}
    return times if len(times) > 1 else None


def _finalists(tuner, candidates: list, served, key: tuple) -> list:
    """The kernels measured on the shape ``key`` (of ``candidates``: the default kernel is None)
    within ``RACE_MARGIN`` of the best there as ``served`` ranks them, at most ``RACE_SIZE``,
    the best first; then the best tuned serial kernel and the best on every core, where missing."""
    shape = dict(key)
    here = [k for k in candidates if (key in tuner.default_measured if k is None else k in tuner.measured.get(key, {}))]
    if len(here) < 2:
        return here
    ranked = sorted(here, key=lambda k: served(k, shape))
    best = served(ranked[0], shape)
    finalists = [k for k in ranked if served(k, shape) <= RACE_MARGIN * best][:RACE_SIZE]
    # The best of each threading too, however far behind: a neighbour on one of the cores slows
    # a kernel on every core and not a serial one, and a tune that timed them in such a spell
    # ranked serial tiles first by 1.2-1.4x where, raced, a parallel one ran 1.98x faster.
    # (Of the tuned kernels: the default kernel is not one of the space's threadings.)
    for serial in (True, False):
        if not any(k is not None and (k.threads == 1) == serial for k in finalists):
            finalists += [k for k in ranked if k is not None and (k.threads == 1) == serial][:1]
    return finalists


def _build_ahead(tuner, races: list) -> None:
    """Every finalist built before the races, on all the runner's workers at once where it can
    (``LocalRunner.prepare`` skips those a worker still holds): a build evicted since the search
    would otherwise be rebuilt serially inside a race."""
    prepare = getattr(tuner.runner, "prepare", None)
    if prepare is None:
        return
    jobs, seen = [], set()
    for shape, finalists in races:
        for kernel in finalists:
            if kernel not in seen:
                seen.add(kernel)
                jobs.append(tuner._job(shape, {"kernel": None} if kernel is None else tuner._kernel_job(kernel)))
    prepare(jobs)


def _can_stream(tuner) -> bool:
    """Whether races may read a dense layer's weight from DRAM: the plan ranks as served, the
    operator has a constant weight, the kernels run on this machine's CPU."""
    return tuner.options.dram is not None and tuner.task.target.get("kind") == "llvm" \
        and getattr(tuner.runner, "device", {}).get("kind") == "local" and weight_bytes(tuner.task) is not None


def _stream_bound(tuner, kernel, shape: dict) -> bool:
    """Whether ``kernel`` passes over ``shape``'s weight in at most ``STREAM_BOUND_PASSES`` row
    passes (the untuned kernel counts as one: ``weight_stream.first_pass_share``)."""
    if kernel is None or kernel.pack <= 0:
        return True
    return tuner.task.axis_extents(shape)["i"] <= STREAM_BOUND_PASSES * kernel.tile_sizes("i")[0]


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


__all__ = ["CONTENDED_RUNS", "CORRECTION_LIMIT", "DROP_MARGIN", "PACKING_RACE_MARGIN", "PACKING_RACE_SHAPES",
           "RACE_MARGIN", "RACE_ROUNDS", "RACE_SIZE", "SCREEN_ROUNDS", "RaceSummary", "race_finalists",
           "race_packings"]
