"""A kernel's parallel tasks taken at run time rather than split evenly in advance.

TVM's ``parallel`` loop hands each thread an equal, contiguous share of the tasks, so a call
lasts as long as its slowest thread. On a shared machine one core is often slower for a while
(a neighbour on its other hardware thread, or the host lending it out), and with an even split
the other cores then wait idle at the end of the call.

Here each of ``workers`` workers owns an equal segment of the tasks and takes them from its
front; when it is through, it takes the tasks left in the next worker's segment from its back
(worker ``w`` helps worker ``w + 1``, the last the first). Each segment has two counters, one
cache line each: the tasks taken from its front, written by its owner only, and from its back,
written by its one helper only. A worker takes a task only where the two counters leave it
free, and publishes the new count before running it. (A helper that went on to further segments
would be a second writer of their back counters, and a stale store of one could undo the
other's, so a task could run any number of times.)

TIR's CPU backend has no atomic read-modify-write, so the counters are plain volatile loads and
stores (volatile: the compiler may not keep a counter in a register across tasks). Owner and
helper can then take the same last task of a segment, each reading the other's count before its
own store lands: that task is computed twice, writing the same values. None is ever skipped: a
worker stops short of a task only when the other has published that it took it. So a task must
write only its own outputs, from inputs no task writes: the packed GEMM's tasks (whole output
tiles, partial sums in a workspace of their own) are such.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from tvm import tirx
from tvm.script.ir_builder import tirx as T

COUNTER_STRIDE = 16  # int32s between two counters: one 64-byte line each, so no two share a line


@dataclass(frozen=True)
class Claim:
    """The task a loop body runs, and the direction its worker goes (``forward``: the task it is
    likely to run next is ``task + 1``, else ``task - 1``): what a body prefetching for its next
    task needs."""

    task: tirx.Expr
    forward: tirx.Expr
    worker: tirx.Expr | None = None  # the worker running it (``claimed_tasks``; None: TVM's split)

    def successor(self) -> tirx.Expr:
        return tirx.Select(self.forward, self.task + 1, self.task - 1)

    def has_successor(self, extent) -> tirx.Expr:
        return tirx.Select(self.forward, self.task + 1 < extent, self.task >= 1)


@contextmanager
def static_tasks(loop, extent):
    """``loop`` (``T.parallel`` or ``T.serial``) over ``extent`` tasks, as a ``Claim``: TVM's own
    even split, each thread going forward."""
    with loop(0, extent) as task:
        yield Claim(task, tirx.const(True, "bool"))


@contextmanager
def claimed_tasks(extent, workers: int):
    """A body run once for each of ``extent`` tasks (a ``Claim``; one task of a segment at most
    twice, see above), by ``workers`` parallel workers that take their tasks at run time;
    ``extent`` may be symbolic (a share is then empty where it is below ``workers``)."""
    workers = max(1, int(workers))
    if isinstance(extent, (int, tirx.IntImm)):
        workers = min(workers, max(1, int(extent)))
    counters = T.alloc_buffer((2 * workers * COUNTER_STRIDE,), "int32", annotations={"tirx.volatile": True})
    with T.serial(0, 2 * workers) as counter:
        T.buffer_store(counters, 0, [counter * COUNTER_STRIDE])
    with T.parallel(0, workers) as worker:
        # [0]: the segment may hold free tasks; [1], [2]: its two counts as read; [3]: the task
        state = T.alloc_buffer((4,), "int32", scope="local")
        with T.serial(0, 2) as turn:  # its own segment, then the next worker's
            segment = (worker + turn) % workers
            low, high = segment * extent // workers, (segment + 1) * extent // workers
            front, back = 2 * segment * COUNTER_STRIDE, (2 * segment + 1) * COUNTER_STRIDE
            owner = turn == 0
            T.buffer_store(state, 1, [0])
            with T.While(state[0] == 1):
                T.buffer_store(state, counters[front], [1])
                T.buffer_store(state, counters[back], [2])
                with T.If(low + state[1] < high - state[2]):
                    with T.Then():
                        with T.If(owner):
                            with T.Then():
                                T.buffer_store(counters, state[1] + 1, [front])
                                T.buffer_store(state, low + state[1], [3])
                            with T.Else():
                                T.buffer_store(counters, state[2] + 1, [back])
                                T.buffer_store(state, high - 1 - state[2], [3])
                        # (the task as a variable, not a load of ``state``: its row and panel
                        # addresses are then plain values, kept in registers in the FMA loop)
                        yield Claim(T.bind(state[3]), owner, worker)
                    with T.Else():
                        T.buffer_store(state, 0, [0])


def task_loop(threads: int, loop, workers: int | None, claimed: bool):
    """A kernel's task loop: ``claimed_tasks`` by ``workers`` where it runs on every core
    (``threads`` != 1) and ``claimed`` (``PackedSettings.claimed_tasks``), else ``static_tasks``
    over ``loop``."""
    if threads != 1 and workers and claimed:
        return partial(claimed_tasks, workers=workers)
    return partial(static_tasks, loop)


__all__ = ["COUNTER_STRIDE", "Claim", "claimed_tasks", "static_tasks", "task_loop"]
