"""The rounds of one race (``racing.raced_rounds``): entrants clearly behind the leader after
the screen stop there, close ones run every round, and a stopped entrant's time stays behind
the leader's even when the host slows down after it stopped. Timers here replay scripted turn
times (seconds), as a worker's timers would read them. Last, what a turn of a race costs
(``racing.race``): as many calls as fill the minimum, and one warm-up call."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from tuner.measure import racing
from tuner.measure.racing import raced_rounds


def _scripted(times: list[float]):
    """A timer that returns ``times`` turn after turn, and counts its turns."""
    turns = iter(times)

    def timer() -> float:
        timer.turns += 1
        return next(turns)

    timer.turns = 0
    return timer


def test_an_entrant_behind_in_every_screen_round_stops_and_close_ones_run_every_round() -> None:
    leader, close, behind = _scripted([10.0] * 7), _scripted([10.2] * 7), _scripted([12.0] * 7)
    latencies, rounds = raced_rounds([leader, close, behind], rounds=7, screen_rounds=3, drop_margin=1.05)
    assert rounds == [7, 7, 3] and [leader.turns, close.turns, behind.turns] == [7, 7, 3]
    assert latencies == [10.0, 10.2, 12.0]


def test_one_slow_turn_in_the_screen_does_not_stop_an_entrant() -> None:
    """Behind in one screen round only (a neighbour's burst during its turn): it runs on."""
    leader, spiked = _scripted([10.0] * 7), _scripted([10.1, 13.0, 10.1, 10.1, 10.1, 10.1, 10.1])
    _latencies, rounds = raced_rounds([leader, spiked], rounds=7, screen_rounds=3, drop_margin=1.05)
    assert rounds == [7, 7]


def test_the_leader_left_alone_stops_too() -> None:
    latencies, rounds = raced_rounds([_scripted([10.0] * 7), _scripted([20.0] * 7)], 7, 3, 1.05)
    assert rounds == [3, 3] and latencies == [10.0, 20.0]


def test_a_stopped_entrant_is_priced_against_the_leader_over_the_rounds_they_shared() -> None:
    """A race from a bert-base tune (768 -> 3072 at T = 511, ms): after the third round a
    neighbour slowed the parallel kernels 1.8x. The third kernel, 1.19x behind, stopped at the
    screen; its own median (19.06) is below the leader's (28.5) over all seven rounds, and
    would have won the race. Priced as 1.19x the leader, it stays behind."""
    script = [[15.843, 16.001, 17.074, 28.613, 28.493, 28.697, 28.473],
              [16.614, 16.504, 19.651, 30.102, 30.388, 30.770, 30.421],
              [19.062, 18.987, 19.055, 34.126, 34.100, 34.617, 33.814],
              [58.536, 55.119, 61.944, 58.412, 57.432, 56.821, 57.152]]  # (serial: no slowdown)
    latencies, rounds = raced_rounds([_scripted(s) for s in script], 7, 3, 1.05)
    assert rounds == [7, 7, 3, 3]
    assert np.median(script[2][:3]) < latencies[0]  # what an unpaired median would have ranked first
    ratio = np.median([t / lead for t, lead in zip(script[2][:3], script[0][:3], strict=False)])
    assert np.isclose(latencies[2], ratio * np.median(script[0]))
    assert min(range(4), key=lambda i: latencies[i]) == 0 and latencies[3] > 1.9 * latencies[0]


def test_without_a_screen_every_entrant_runs_every_round_and_a_failed_one_none() -> None:
    timers = [_scripted([10.0] * 5), None, _scripted([30.0] * 5)]
    latencies, rounds = raced_rounds(timers, rounds=5)
    assert rounds == [5, 0, 5] and latencies == [10.0, None, 30.0]
    assert raced_rounds([None, None], 5, 3, 1.05) == ([None, None], [0, 0])


class _Operator:
    """A race's operator in a worker (``worker.JobOperator``), each entrant a Python kernel that
    sleeps ``seconds`` a call, and counts its calls."""

    on_this_cpu = True

    def __init__(self, job: dict, stream: bool):
        assert not stream
        self.weight_index = None
        self.session = None
        self.kernels: list = []
        _Operator.made = self

    def built_and_checked(self, job: dict, pack: int):
        def kernel() -> None:
            kernel.calls += 1
            time.sleep(SLEEP_S)

        kernel.calls = 0
        self.kernels.append(kernel)
        return {"main": kernel}, False

    def call_arguments(self, shape: dict, pack: int) -> list[list]:
        return [[]]

    def other_load(self):
        return None


SLEEP_S = 0.012


def test_a_hot_turn_is_as_many_calls_as_fill_the_minimum_and_no_more(monkeypatch) -> None:
    # TVM's time_evaluator adds a warm-up call to every turn and, once one call fell short of
    # min_repeat_ms, makes two a turn for good: a 7.5 ms kernel cost three calls a turn.
    monkeypatch.setattr(racing, "JobOperator", _Operator)
    job = {"shapes": [{"T": 512}], "kernels": [None, None], "rounds": 3, "min_repeat_ms": 10}
    result = racing.race(job)
    assert result["error"] is None and result["rounds"] == [3, 3]
    # one warm-up call each, then one call a turn: 12 ms fill the 10 ms minimum
    assert [kernel.calls for kernel in _Operator.made.kernels] == [4, 4]
    assert all(SLEEP_S <= latency < 3 * SLEEP_S for latency in result["latencies"])


class _Device(_Operator):
    """The same, on a device this worker does not time itself (a GPU, or a machine over RPC):
    each entrant a module whose evaluator says how it was asked to time."""

    on_this_cpu = False

    def __init__(self, job: dict, stream: bool):
        super().__init__(job, stream)
        self.session = SimpleNamespace(device="the device")

    def built_and_checked(self, job: dict, pack: int):
        asked: list[dict] = []

        class Module:
            def __getitem__(self, name: str):
                return lambda *_args: None

            def time_evaluator(self, name: str, device, **how):
                assert (name, device) == ("main", "the device")
                asked.append(how)
                return lambda *_args: type("Result", (), {"results": [SLEEP_S]})()

        self.kernels.append(asked)
        return Module(), False


def test_a_device_turn_is_timed_by_the_device_evaluator(monkeypatch) -> None:
    # (a GPU's calls return before its kernels end: a turn timed in Python would time launches)
    monkeypatch.setattr(racing, "JobOperator", _Device)
    job = {"shapes": [{"T": 512}], "kernels": [None, None], "rounds": 3, "min_repeat_ms": 10}
    result = racing.race(job)
    assert result["error"] is None and result["latencies"] == [SLEEP_S, SLEEP_S]
    assert [asked for asked in _Operator.made.kernels] == [[{"number": 1, "repeat": 1, "min_repeat_ms": 10}]] * 2
