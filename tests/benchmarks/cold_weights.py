"""One dense operator's micro-kernels with the weight in cache and with it coming from DRAM, as in
the served model (whose 340 MB of weights no cache holds): where a short sequence's time goes.

    python tests/benchmarks/cold_weights.py --op dense_3072x768 --lengths 1,7 \
        --kernel 5,16,1,1,384 --kernel 1,16,4,4,256 [--copies 40] [--rounds 3] [--without prefetch]
    python tests/benchmarks/cold_weights.py --op dense_768x768 --lengths 1,7 --interleaved \
        --kernel 7,32,1,8,1 --kernel 7,32,1,1,1 --kernel default --rounds 9

Each ``--kernel mr,panel,panels_per_tile,tiles_per_task,kc`` is forced as a plan's only variant
(``forced_kernels.py``; ``default``: the model's untuned kernel, on the unpacked weight) and
timed at every length. "Hot" runs one argument set over and over;
"cold" cycles through ``--copies`` of them (40 x 9.4 MB for the 3072 -> 768 layer: more than
the L3), so each call reads its weight from DRAM. Prints ms per call, median of ``--rounds``.
``--interleaved`` times the cold case only, every kernel (and its builds ``--without`` a
feature) once per round in turn (the order reversed every other round), so a change of the DRAM
rate falls on all of them alike; it prints each one's speed against the first kernel's.
``--without FEATURE`` builds each kernel also with one ``PackedSettings`` switch off
(``FEATURES``): ``prefetch`` the prefetch of the next weight block, ``spread`` its spreading
over more passes, ``row-copy`` the k-major copy of the activations' rows, ``remainder-in-place``
(the short remainder tiles of such copied rows then read the copy too), ``remainder`` the
remainder tiles, ``epilogue-loop`` the epilogue loop, ``stream-ahead`` the fetches ahead of a
pass's own weight lines; and times them side by side: "gain" is the full kernel's speed over
each. The full kernel is built with this target's own settings (``kernel_settings``). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_baselines as baselines  # noqa: E402
import tvm  # noqa: E402
from bench_kernels import OPERATORS  # noqa: E402
from forced_kernels import llvm_target, packed_kernel  # noqa: E402

from dietserve.kernels.decision_tree_func import dispatched_prim_func  # noqa: E402
from dietserve.kernels.plan.kernel_plan import KernelPlan  # noqa: E402
from dietserve.kernels.plan.microkernel import MicroKernel  # noqa: E402
from dietserve.kernels.settings import KernelSettings, kernel_settings  # noqa: E402
from dietserve.kernels.tir.build import build as build_kernels  # noqa: E402
from dietserve.runtime.huge_pages import on_huge_pages  # noqa: E402
from tuner.ops import weight_input  # noqa: E402


def per_call(function, argument_sets: list, rounds: int) -> float:
    for arguments in argument_sets[:3]:
        function(*arguments)
    time.sleep(baselines.SETTLE_S)
    samples = []
    for _round in range(rounds):
        calls = max(1, 40 // len(argument_sets)) * len(argument_sets)
        start = time.perf_counter()
        for call in range(calls):
            function(*argument_sets[call % len(argument_sets)])
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


# Features of the packed kernel that ``--without`` can switch off: the ``PackedSettings`` fields
# that switch each off.
FEATURES = {"prefetch": {"prefetch_next_block": False}, "row-copy": {"pack_rows": False},
            "remainder": {"remainder_tiles": False}, "epilogue-loop": {"epilogue_loop": False},
            "remainder-in-place": {"remainder_rows_in_place": False}, "stream-ahead": {"stream_ahead_bytes": 0},
            "spread": {"spread_next_block": False}}


def settings_without(target, name: str | None) -> KernelSettings:
    """The settings ``target``'s kernels are built with, less the feature ``name`` (``FEATURES``;
    None: all of them on)."""
    settings = kernel_settings(target)
    if name is None:
        return settings
    return replace(settings, packed=replace(settings.packed, **FEATURES[name]))


def build(op: str, kernel: MicroKernel | None, where, target, settings: KernelSettings):
    """The operator with only ``kernel`` (None: the default rule), built with ``settings``."""
    spec = OPERATORS[op]()
    name = "default" if kernel is None else "v0"
    plan = KernelPlan(workload="forced", operator=spec.name, shape_vars=["T"], axes={}, target=dict(where.target),
                      tvm_version=tvm.__version__, variants={name: None if kernel is None else kernel.to_dict()},
                      tree={"variant": name}, tuned_range={})
    return spec, build_kernels(dispatched_prim_func(spec.func, plan, target, settings=settings), target).jit()


def built(op: str, text: str, where, target, lanes: int, without: str | None):
    """(operator, the weight's panel width: 0 unpacked, the kernel's function)."""
    kernel = None if text == "default" else packed_kernel(text, lanes)
    spec, lib = build(op, kernel, where, target, settings_without(target, without))
    return spec, 0 if kernel is None else kernel.pack, lib["main"]


def argument_sets(spec, length: int, copies: int):
    """``sets_of(pack)``: ``copies`` argument sets of ``spec`` at T = ``length``, the weight in
    panels of ``pack`` (0: unpacked) on huge pages, where the served model keeps its weights
    (huge_pages.py); made once per packing, shared by the kernels that read it."""
    made: dict[int, list] = {}

    def sets_of(pack: int) -> list:
        if pack not in made:
            sets = [baselines.tvm_arguments_packed(spec, {"T": length}, tvm.cpu(0), pack)[0] for _ in range(copies)]
            at = weight_input(spec)
            weights = on_huge_pages([each[at] for each in sets])
            made[pack] = [[w if i == at else x for i, x in enumerate(each)]
                          for each, w in zip(sets, weights, strict=True)]
        return made[pack]

    return sets_of


def interleaved(builds: dict, keys: list[tuple], sets_of, rounds: int) -> dict[tuple, float]:
    """Median seconds per cold call of each build (``keys``: (kernel, without)), every build
    once per round in turn."""
    for key in keys:
        _spec, pack, function = builds[key]
        for arguments in sets_of(pack):
            function(*arguments)
    samples: dict[tuple, list[float]] = {key: [] for key in keys}
    for turn in range(rounds):
        for key in keys if turn % 2 == 0 else keys[::-1]:
            _spec, pack, function = builds[key]
            sets = sets_of(pack)
            start = time.perf_counter()
            for arguments in sets:
                function(*arguments)
            samples[key].append((time.perf_counter() - start) / len(sets))
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="dense_3072x768", choices=[op for op in OPERATORS if op.startswith("dense")])
    parser.add_argument("--lengths", default="1,7")
    parser.add_argument("--kernel", action="append", required=True,
                        help="mr,panel,panels_per_tile,tiles_per_task,kc, or default (repeatable)")
    parser.add_argument("--copies", type=int, default=40, help="weight copies cycled through for the cold run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interleaved", action="store_true",
                        help="cold only, every kernel once per round in turn (see above)")
    parser.add_argument("--without", action="append", default=[], choices=list(FEATURES),
                        help="also time each kernel built without this feature (repeatable)")
    args = parser.parse_args()
    where, target, lanes = llvm_target()
    builds = {(text, without): built(args.op, text, where, target, lanes, without)
              for text in args.kernel for without in [None, *args.without]}
    spec = builds[args.kernel[0], None][0]
    if args.interleaved:
        print(f"{args.op}, cold ms per call ({args.copies} weight copies cycled), rounds interleaved")
        for length in (int(v) for v in args.lengths.split(",")):
            cold = interleaved(builds, list(builds), argument_sets(spec, length, args.copies), args.rounds)
            first = cold[args.kernel[0], None]
            print(f"T={length}: " + "  ".join(
                f"{text}{f' without {without}' if without else ''} {seconds * 1e3:.4f} ({first / seconds:.3f}x)"
                for (text, without), seconds in cold.items()), flush=True)
        return 0
    print(f"{args.op}, ms per call (hot: one weight; cold: {args.copies} copies cycled)")
    print(f"{'T':>5} {'kernel':>16} {'without':>9} {'hot':>8} {'cold':>8} {'cold/hot':>9}"
          f" {'hot gain':>9} {'cold gain':>10}")
    for length in (int(v) for v in args.lengths.split(",")):
        sets_of = argument_sets(spec, length, args.copies)
        for text in args.kernel:
            full = None
            for without in [None, *args.without]:
                _spec, pack, function = builds[text, without]
                sets = sets_of(pack)
                hot, cold = per_call(function, sets[:1], args.rounds), per_call(function, sets, args.rounds)
                # the full kernel's gain over this one built without the feature
                gains = f" {hot / full[0]:>8.2f}x {cold / full[1]:>9.2f}x" if full else ""
                full = full or (hot, cold)
                print(f"{length:>5} {text:>16} {without or '-':>9} {hot * 1e3:>8.4f} {cold * 1e3:>8.4f}"
                      f" {cold / hot:>9.2f}{gains}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
