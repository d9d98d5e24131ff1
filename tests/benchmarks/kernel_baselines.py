"""What our tuned kernels are compared against, one operator and one static shape at a time:
numpy (its BLAS), PyTorch eager (its BLAS / cuBLAS), TVM's own default schedule (serial loops on
llvm, dlight's default rules on cuda) and MetaSchedule tuned per static shape with the same
trial budget as ours.

Every timing function returns a median latency in seconds, measured after a warm-up. A shape is
either ``{"T": t}`` or the bare int ``t``. This is a library for ``bench_kernels.py``, not a test.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm.target import Target

from tuner.ops import OperatorSpec, kernel_inputs, random_inputs, rounded_operands

ShapeLike = Mapping[str, int] | int
TargetLike = Target | Mapping[str, Any]


def _as_shape(shape: ShapeLike) -> dict[str, int]:
    return {"T": int(shape)} if isinstance(shape, int) else dict(shape)


def _as_target(target: TargetLike) -> Target:
    return target if isinstance(target, Target) else Target(dict(target))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Timing helpers


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2, *, number: int | None = None,
                   min_sample_s: float = 1e-3, time_cap_s: float | None = None,
                   sync: Callable[[], object] | None = None) -> float:
    """Median wall time of one ``fn()`` call over ``repeats`` samples of ``number`` calls each.

    ``number=None`` calibrates it so one sample lasts at least ``min_sample_s``: a call of tens of
    microseconds timed alone is mostly timer noise. ``time_cap_s`` stops sampling early (at least one sample is
    always taken) for calls that take seconds. ``sync`` runs before each clock read (a device
    synchronize for asynchronous backends).
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    if number is None:
        start = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - start
        number = max(1, min(1000, math.ceil(min_sample_s / max(once, 1e-9))))
    samples: list[float] = []
    began = time.perf_counter()
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / number)
        if time_cap_s is not None and time.perf_counter() - began >= time_cap_s:
            break
    return statistics.median(samples)


def time_tvm_module(lib: tvm.runtime.Module, args: Sequence[Any], device: tvm.runtime.Device, *,
                    func_name: str = "main", repeat: int = 7, min_repeat_ms: int = 10,
                    time_cap_s: float | None = None, slow_call_s: float = 0.2) -> float:
    """Median latency in seconds of ``lib[func_name](*args)`` via ``time_evaluator``.

    One call first warms up (and loads the code) and measures the order of magnitude. A call
    slower than ``slow_call_s`` is timed with a plain clock, because ``time_evaluator`` would add
    its own warm-up run of several seconds, and at most ``time_cap_s`` is spent sampling.
    """
    func = lib[func_name]
    start = time.perf_counter()
    func(*args)
    device.sync()
    once = time.perf_counter() - start
    if once >= slow_call_s:
        return median_seconds(lambda: func(*args), repeat, warmup=0, number=1, time_cap_s=time_cap_s,
                              sync=device.sync)
    if time_cap_s is not None:
        per_repeat = max(once, min_repeat_ms / 1e3)
        repeat = max(1, min(repeat, int(time_cap_s / per_repeat)))
    evaluator = lib.time_evaluator(func_name, device, number=1, repeat=repeat, min_repeat_ms=min_repeat_ms)
    return statistics.median(evaluator(*args).results)


# ---------------------------------------------------------------------------------------------
# The computation each library runs for a spec


def dense_epilogue(spec: OperatorSpec) -> str:
    """"none", "bias" or "bias_gelu": the spec's ``epilogue`` if it has one, else from its name."""
    epilogue = getattr(spec, "epilogue", None)
    if epilogue is not None:
        return str(epilogue)
    match = re.fullmatch(r"dense(?:_(bias_gelu|bias_residual|bias))?\[.*\]", spec.name)
    if match is None:
        raise ValueError(f"cannot read a dense epilogue from operator name {spec.name!r}")
    return match.group(1) or "none"


def numpy_computation(spec: OperatorSpec) -> Callable[..., np.ndarray]:
    """The operator in vectorised numpy (``spec.reference`` computes GELU with one Python call per
    element, which would time the interpreter rather than numpy)."""
    if spec.kind in ("attention_scores", "attention_context"):
        return np.matmul
    if spec.kind != "dense":
        raise ValueError(f"no numpy baseline for operator kind {spec.kind!r}")
    epilogue = dense_epilogue(spec)
    if epilogue == "none":
        return np.matmul
    if epilogue == "bias":
        return lambda x, w, bias: x @ w + bias
    if epilogue == "bias_residual":
        return lambda x, w, bias, residual: x @ w + bias + residual

    from scipy.special import erf

    def dense_bias_gelu(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
        y = x @ w + bias
        return 0.5 * y * (1.0 + erf(y * np.float32(1.0 / math.sqrt(2.0))))

    return dense_bias_gelu


def torch_computation(spec: OperatorSpec) -> Callable[..., Any]:
    """The operator as PyTorch eager runs it: addmm (+ exact GELU) for dense, bmm for attention."""
    import torch

    if spec.kind in ("attention_scores", "attention_context"):
        return torch.bmm
    if spec.kind != "dense":
        raise ValueError(f"no torch baseline for operator kind {spec.kind!r}")
    epilogue = dense_epilogue(spec)
    if epilogue == "none":
        return torch.matmul
    if epilogue == "bias":
        return lambda x, w, bias: torch.addmm(bias, x, w)
    if epilogue == "bias_residual":
        return lambda x, w, bias, residual: torch.addmm(bias, x, w).add_(residual)
    return lambda x, w, bias: torch.nn.functional.gelu(torch.addmm(bias, x, w), approximate="none")


# ---------------------------------------------------------------------------------------------
# Library baselines


def time_numpy(spec: OperatorSpec, shape: ShapeLike, repeats: int = 7, *, warmup: int = 2,
               time_cap_s: float | None = None, seed: int = 0) -> float:
    """Median seconds of the operator in numpy (matmul on numpy's BLAS, threads as numpy sets them)."""
    inputs = random_inputs(spec, _as_shape(shape), seed)
    compute = numpy_computation(spec)
    return median_seconds(lambda: compute(*inputs), repeats, warmup, time_cap_s=time_cap_s)


def time_torch(spec: OperatorSpec, shape: ShapeLike, repeats: int = 7, device: str = "cpu", *, warmup: int = 3,
               threads: int | None = None, time_cap_s: float | None = None, seed: int = 0) -> float:
    """Median seconds of the operator in PyTorch eager on ``device`` ("cpu" or "cuda"); a bf16
    operator's in bf16 tensors, as ``torch.autocast`` runs a linear layer (oneDNN's bf16 GEMM).

    On the CPU torch gets ``threads`` intra-op threads (default: every CPU). On CUDA each sample
    is bracketed by CUDA events, so host launch overhead overlapping the kernel is not counted.
    """
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    compute = torch_computation(spec)
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
    inputs = [torch.from_numpy(a).to(device, dtype) for a in random_inputs(spec, _as_shape(shape), seed)]
    with torch.inference_mode():
        if device == "cpu":
            return median_seconds(lambda: compute(*inputs), repeats, warmup, time_cap_s=time_cap_s)
        return _median_cuda_events(lambda: compute(*inputs), repeats, warmup, time_cap_s)


def _median_cuda_events(fn: Callable[[], object], repeats: int, warmup: int, time_cap_s: float | None,
                        min_sample_s: float = 1e-3) -> float:
    import torch

    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(number: int) -> float:
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / number  # elapsed_time is in milliseconds

    # Kernels of a few microseconds are batched so one sample spans at least min_sample_s.
    number = max(1, min(1000, math.ceil(min_sample_s / max(sample(1), 1e-9))))
    samples: list[float] = []
    began = time.perf_counter()
    for _ in range(max(1, repeats)):
        samples.append(sample(number))
        if time_cap_s is not None and time.perf_counter() - began >= time_cap_s:
            break
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------
# TVM baselines


def _device_for(target: Target) -> tvm.runtime.Device:
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


def tvm_arguments(spec: OperatorSpec, shape: ShapeLike, device: tvm.runtime.Device,
                  seed: int = 0) -> tuple[list[Any], list[np.ndarray]]:
    """Random inputs plus an output buffer on ``device``, and the inputs as numpy arrays."""
    shape = _as_shape(shape)
    inputs = random_inputs(spec, shape, seed)
    output = tvm.runtime.empty(spec.output_shape(shape), "float32", device)
    return [tvm.runtime.tensor(a, device) for a in inputs] + [output], inputs


def tvm_arguments_packed(spec: OperatorSpec, shape: ShapeLike, device: tvm.runtime.Device, pack: int,
                         seed: int = 0) -> tuple[list[Any], list[np.ndarray]]:
    """``tvm_arguments`` with the weight in panels of ``pack`` (0: as it is), as a packed
    kernel reads it in the model (packed once at load, so not timed)."""
    shape = _as_shape(shape)
    inputs = random_inputs(spec, shape, seed)
    output = tvm.runtime.empty(spec.output_shape(shape), "float32", device)
    return [tvm.runtime.tensor(a, device) for a in kernel_inputs(spec, inputs, pack)] + [output], inputs


_DEFAULT_RULE_CACHE: dict[tuple[str, str], tvm.runtime.Module] = {}


def time_default_rule(spec: OperatorSpec, shape: ShapeLike, target: TargetLike, repeats: int = 7, *,
                      time_cap_s: float | None = 10.0, seed: int = 0) -> float:
    """Median seconds of the model's own default schedule for the operator (the CPU matmul rule
    an untuned artifact runs, symbolic in T: what linking a plan replaces)."""
    from dietserve.kernels.apply import apply_default

    target = _as_target(target)
    key = (spec.name, str(target))
    if key not in _DEFAULT_RULE_CACHE:
        _DEFAULT_RULE_CACHE[key] = tvm.compile(apply_default(spec.func, target), target=target).jit()
    device = _device_for(target)
    args, _ = tvm_arguments(spec, shape, device, seed)
    return time_tvm_module(_DEFAULT_RULE_CACHE[key], args, device, repeat=repeats, time_cap_s=time_cap_s)


def machine_ceiling(target: TargetLike, repeats: int = 5) -> tuple[float, float]:
    """(sgemm GFLOP/s of numpy's BLAS on 2048^3, read GB/s of a parallel read-only pass over a
    BERT-base weight-sized array in TVM): the compute and weight-streaming ceilings of this
    machine, measured in the same run as the kernels they judge."""
    return sgemm_rate(repeats), read_rate(target, 128, repeats * 4)  # 128 panels: a 768 x 3072 weight


FMA_CHAINS = 12  # independent accumulators per core: more than latency x pipes on any x86 core in view


def fma_peak_rate(target: TargetLike, repeats: int = 5, steps: int = 200_000) -> float:
    """GFLOP/s of fused multiply-adds alone, on every core the target names: ``FMA_CHAINS``
    vector accumulators per core kept in registers, no memory traffic. The most any fp32 kernel
    reaches here, the bound a kernel's GFLOP/s is read against (numpy's sgemm, ``sgemm_rate``,
    runs below it: our dense kernels beat it by 10-15%)."""
    from tvm.script import tirx as T

    from dietserve.kernels.apply import target_cores
    from dietserve.kernels.tir.loops import float_lanes

    target = _as_target(target)
    lanes = float_lanes(target)
    cores = target_cores(target) or os.cpu_count() or 1
    width = FMA_CHAINS * lanes
    scale, offset = 0.9999999, 1e-7  # (stays finite over any number of steps)

    @T.prim_func
    def fma_loop(out: T.Buffer((cores, width), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for task in T.parallel(cores):
            # scope "global": a small stack array, which LLVM keeps in vector registers
            acc = T.alloc_buffer((width,), "float32", scope="global")
            for c in T.unroll(FMA_CHAINS):
                for lane in T.vectorized(lanes):
                    acc[c * lanes + lane] = T.float32(task) + T.float32(c)
            for _step in range(steps):
                for c in T.unroll(FMA_CHAINS):
                    for lane in T.vectorized(lanes):
                        acc[c * lanes + lane] = acc[c * lanes + lane] * T.float32(scale) + T.float32(offset)
            for c in T.unroll(FMA_CHAINS):
                for lane in T.vectorized(lanes):
                    out[task, c * lanes + lane] = acc[c * lanes + lane]

    function = tvm.compile(tvm.IRModule({"main": fma_loop}), target=target).jit()["main"]
    out = tvm.runtime.tensor(np.zeros((cores, width), np.float32))
    time.sleep(0.2)
    return 2 * cores * width * steps / median_seconds(lambda: function(out), repeats, warmup=2, number=1) / 1e9


def bf16_peak_rate(target: TargetLike, repeats: int = 5, steps: int = 200_000) -> float:
    """GFLOP/s of bf16 dot products alone (``vdpbf16ps``: 16 lanes, two multiply-adds each), on
    every core the target names, ``FMA_CHAINS`` accumulators per core in registers: the bound a
    bf16 kernel is read against, as ``fma_peak_rate`` is an fp32 one's. The target must have
    AVX512-BF16."""
    from tvm.script import tirx as T

    from dietserve.kernels.apply import target_cores
    from dietserve.kernels.cpu_packed import bf16

    target = _as_target(target)
    bf16.check_bf16_target(target)
    lanes = bf16.PAIR_LANES
    cores = target_cores(target) or os.cpu_count() or 1
    width = FMA_CHAINS * lanes
    pair = 0x3A833A83  # two bf16 of 0.001: the sums grow by 2e-6 a step and stay finite

    @T.prim_func
    def dot_loop(out: T.Buffer((cores, width), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        with T.attr(0, "pragma_import_llvm", bf16.BF16_LLVM):
            for task in T.parallel(cores):
                acc = T.alloc_buffer((width,), "float32", scope="global")
                for c in T.unroll(FMA_CHAINS):
                    acc[T.Ramp(c * lanes, 1, lanes)] = T.Broadcast(T.float32(task) + T.float32(c), lanes)
                for _step in range(steps):
                    for c in T.unroll(FMA_CHAINS):
                        acc[T.Ramp(c * lanes, 1, lanes)] = T.call_extern(
                            f"float32x{lanes}", bf16.DOT_PAIRS, acc[T.Ramp(c * lanes, 1, lanes)],
                            T.Broadcast(T.int32(pair), lanes), T.Broadcast(T.int32(pair), lanes))
                for c in T.unroll(FMA_CHAINS):
                    out[task, T.Ramp(c * lanes, 1, lanes)] = acc[T.Ramp(c * lanes, 1, lanes)]

    function = tvm.compile(tvm.IRModule({"main": dot_loop}), target=target).jit()["main"]
    out = tvm.runtime.tensor(np.zeros((cores, width), np.float32))
    time.sleep(0.2)
    return 4 * cores * width * steps / median_seconds(lambda: function(out), repeats, warmup=2, number=1) / 1e9


def amx_peak_rate(target: TargetLike, repeats: int = 5, steps: int = 200_000) -> float:
    """GFLOP/s of AMX tile products alone (``tdpbf16ps`` on 2 x 2 C tiles, their operands held
    in the other four tiles) on every core the target names: the bound an AMX kernel is read
    against. The target must have AMX-BF16 tiles."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from dietserve.kernels.apply import target_cores
    from dietserve.kernels.cpu_packed import amx

    target = _as_target(target)
    if not amx.has_matrix_tiles(target):
        raise ValueError(f"{target} has no AMX-BF16 tiles")
    cores = target_cores(target) or os.cpu_count() or 1
    tiles = amx.MatrixTiles()
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            operand = T.arg("operand", T.buffer((amx.TILE_ROWS, amx.TILE_WORDS), "uint32"))
            out = T.arg("out", T.buffer((cores, 4, amx.TILE_ROWS, amx.TILE_WORDS), "float32"))
            tiles.request_permission()
            with T.parallel(0, cores) as task:
                amx.configure_tiles(tiles)
                for c in range(4):
                    tiles.zero(c)
                for t in range(4, 8):
                    tiles.load(t, operand, lambda r, q: (r, q))
                with T.serial(0, steps):
                    for c, (a, b) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
                        tiles.product(c, a, b)
                for c in range(4):
                    tiles.store(c, out, lambda r, q, c=c, task=task: (task, c, r, q))
                tiles.release()
    function = tvm.compile(tvm.IRModule({"main": builder.get()}), target=target)["main"]
    operand = tvm.runtime.tensor(np.full((amx.TILE_ROWS, amx.TILE_WORDS), 0x3A833A83, np.uint32))  # bf16 0.001s
    out = tvm.runtime.tensor(np.zeros((cores, 4, amx.TILE_ROWS, amx.TILE_WORDS), np.float32))
    time.sleep(0.2)
    flops = 2 * amx.TILE_ROWS * amx.TILE_WORDS * 2 * amx.TILE_WORDS * 4 * steps * cores
    return flops / median_seconds(lambda: function(operand, out), repeats, warmup=2, number=1) / 1e9


def sgemm_rate(repeats: int = 5) -> float:
    """GFLOP/s of numpy's BLAS on 2048^3."""
    rng = np.random.default_rng(0)
    a, b = rng.random((2048, 2048), dtype=np.float32), rng.random((2048, 2048), dtype=np.float32)
    time.sleep(0.2)
    return 2 * 2048**3 / median_seconds(lambda: a @ b, repeats, warmup=1, number=1) / 1e9


PANEL_BYTES = 192 * 4 * 24 * 4  # one panel of the read-only pass: 192 x 96 floats


def read_rate(target: TargetLike, panels: int, repeats: int = 20) -> float:
    """GB/s of a parallel read-only pass over ``panels`` x PANEL_BYTES (``read_pass``): a weight
    that stays in cache (a BERT-base weight: 128 panels) or, with a few hundred MB, the DRAM
    rate at which a model streams every weight once per run."""
    stream = read_pass(target, panels * PANEL_BYTES)
    time.sleep(0.2)
    return panels * PANEL_BYTES / median_seconds(stream, repeats, warmup=3) / 1e9


def read_pass(target: TargetLike, nbytes: int) -> Callable[[], object]:
    """One parallel read-only pass over ``nbytes`` (rounded up to a panel) on huge pages, where a
    served model keeps its weights (``dietserve.runtime.huge_pages``): a call takes as long as
    reading that model's weights once from DRAM takes at that moment. Timed beside the model in
    each round, since on a shared machine the DRAM rate moves by half over minutes."""
    from dietserve.runtime.huge_pages import on_huge_pages

    panels = -(-nbytes // PANEL_BYTES)
    stream = _stream_function(_as_target(target), panels)
    weight = on_huge_pages([np.random.default_rng(0).random((panels, 192, 4, 24), dtype=np.float32)])[0]
    out = tvm.runtime.tensor(np.zeros((panels, 4, 24), np.float32))
    return lambda: stream(weight, out)


def _stream_function(target: Target, panels: int):
    """Sum each 24-wide panel over its rows, panels in parallel, 4 partial sums per lane (so
    the adds do not serialize): a read-only pass at the memory system's rate."""
    from tvm import te

    w = te.placeholder((panels, 192, 4, 24), "float32", name="w")
    r = te.reduce_axis((0, 192), name="r")
    out = te.compute((panels, 4, 24), lambda p, q, j: te.sum(w[p, r, q, j], axis=r), name="panel_sum")
    sch = tvm.s_tir.Schedule(te.create_prim_func([w, out]).with_attr("global_symbol", "main"))
    block = sch.get_sblock("panel_sum")
    p, q, j, r = sch.get_loops(block)
    sch.reorder(p, r, q, j)
    sch.parallel(p)
    outer, lanes = sch.split(j, [None, 8])
    sch.vectorize(lanes)
    sch.unroll(outer)
    sch.unroll(q)
    sch.cache_write(block, 0, "local")
    return tvm.compile(sch.mod, target=target).jit()["main"]


def compile_tvm_default(spec: OperatorSpec, shape: ShapeLike, target: TargetLike) -> tvm.runtime.Module:
    """The static-shape operator as TVM builds it with no tuning: unscheduled (serial, scalar)
    loops on llvm; on cuda, dlight's default GPU rules (Matmul, GEMV, then Fallback)."""
    target = _as_target(target)
    func = spec.static(_as_shape(shape))
    if target.kind.name == "cuda":
        from tvm.s_tir import dlight

        rules = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Fallback())
        with target:
            mod = rules(tvm.IRModule({"main": func}))
        return tvm.compile(mod, target=target).jit()
    return tvm.compile(func, target=target).jit()


def time_tvm_default(spec: OperatorSpec, shape: ShapeLike, target: TargetLike, repeats: int = 3, *,
                     time_cap_s: float | None = 20.0, seed: int = 0) -> float:
    """Median seconds of TVM's untuned build (see ``compile_tvm_default``). Serial llvm loops
    take seconds per call at T=512, K=3072: ``time_cap_s`` bounds the sampling."""
    target = _as_target(target)
    device = _device_for(target)
    lib = compile_tvm_default(spec, shape, target)
    args, _ = tvm_arguments(spec, shape, device, seed)
    return time_tvm_module(lib, args, device, repeat=repeats, time_cap_s=time_cap_s)


def _fast_build_function() -> Callable[..., tvm.runtime.Module]:
    """MetaSchedule's default build, less its ``import tvm.s_tir.tensor_intrin`` (~25-35 s in every
    fresh worker, and fp32 schedules use no tensor intrinsics). Returned as a closure so
    cloudpickle ships it by value: the builder's worker cannot import this module."""

    def build(mod: tvm.IRModule, target: Target, _params: object) -> tvm.runtime.Module:
        import tvm as tvm_in_worker
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        return tvm_in_worker.tirx.build(mod, target=target)

    return build


SETTLE_S = 0.3  # after a library call, before timing another: its spinning worker threads go idle


def check_against_reference(spec: OperatorSpec, output: np.ndarray, inputs: Sequence[np.ndarray],
                            rel_tol: float = 1e-4) -> float:
    """Max abs error against ``spec.reference`` (a bf16 operator's on its product's operands
    rounded to bf16); raises when it exceeds ``rel_tol`` times the largest reference magnitude
    (float32 sums of a few thousand terms sit near 1e-6 of it)."""
    if spec.precision == "bf16":
        inputs = rounded_operands(inputs, "bf16")
    expected = spec.reference(*inputs)
    error = float(np.max(np.abs(output - expected)))
    bound = rel_tol * max(1.0, float(np.max(np.abs(expected))))
    if not error <= bound:
        raise AssertionError(f"{spec.name}: max abs error {error:.3g} exceeds {bound:.3g}")
    # The reference ran on numpy's BLAS, whose worker threads spin on the cores for a while after
    # a call: a TVM kernel timed at once shares the cores with a spinning thread, and each of its
    # parallel calls then waits a scheduler tick, far longer than the call. Let them sleep.
    time.sleep(SETTLE_S)
    return error


def tune_metaschedule(spec: OperatorSpec, shapes: Sequence[ShapeLike], target: TargetLike, trials: int,
                      work_dir: str | Path, *, repeats: int = 7, time_cap_s: float | None = 20.0, seed: int = 0,
                      build_timeout_s: float = 60.0, run_timeout_s: float = 60.0,
                      verify: bool = True) -> tuple[dict[int, float | None], float]:
    """MetaSchedule on each static shape with ``trials`` trials each (what its users give it:
    it tunes one static shape at a time).

    Returns (latency in seconds of the best schedule per T, total tuning wall seconds). The wall
    time covers ``tune_tir`` only (search, builds, measurements), not compiling and timing the
    winner afterwards. A shape whose tuning, build or check fails gets ``None`` and an error line
    on stderr. With ``verify`` the winner's output is checked against ``spec.reference``.
    ``work_dir`` receives MetaSchedule's logs; the tuning records stay in memory.
    """
    import logging

    from tvm.s_tir import meta_schedule as ms

    # TuneContext imports the tensor intrinsics once per process (~35-70 s here): a fixed cost of
    # loading MetaSchedule, paid before the clock starts rather than billed to the first shape.
    began = time.perf_counter()
    importlib.import_module("tvm.s_tir.tensor_intrin")

    _log(f"metaschedule: importing tvm.s_tir.tensor_intrin took {time.perf_counter() - began:.1f} s (not counted)")
    target = _as_target(target)
    device = _device_for(target)
    lengths = [_as_shape(shape)["T"] for shape in shapes]
    # One build worker: two cores are shared with the runner and the search itself.
    builder = ms.builder.LocalBuilder(max_workers=1, timeout_sec=build_timeout_s, f_build=_fast_build_function())
    runner = ms.runner.LocalRunner(timeout_sec=run_timeout_s)
    latencies: dict[int, float | None] = {}
    total_wall = 0.0
    for length in lengths:
        latencies[length] = None
        began = time.perf_counter()
        tuning_s: float | None = None
        try:
            func = spec.static({"T": length})
            # tune_tir sets its console handler to this logger's level: keep the task tables and
            # XGB lines in work_dir/logs and off the benchmark's stdout.
            logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
            database = ms.tir_integration.tune_tir(
                func, target, work_dir=str(Path(work_dir) / f"T{length}"), max_trials_global=trials,
                num_trials_per_iter=min(64, trials), builder=builder, runner=runner,
                # In memory: a rerun into the same work_dir must not start from old records.
                database="memory", num_tuning_cores=os.cpu_count() or 1, seed=seed,
            )
            tuning_s = time.perf_counter() - began
            total_wall += tuning_s
            schedule = ms.tir_integration.compile_tir(database, func, target)
            if schedule is None:
                raise RuntimeError("no schedule built and ran successfully")
            lib = tvm.compile(schedule.mod, target=target).jit()
            args, inputs = tvm_arguments(spec, {"T": length}, device, seed)
            error = "unchecked"
            if verify:
                lib["main"](*args)
                error = f"{check_against_reference(spec, args[-1].numpy(), inputs):.2g}"
            latencies[length] = time_tvm_module(lib, args, device, repeat=repeats, time_cap_s=time_cap_s)
            _log(f"metaschedule T={length}: {trials} trials in {tuning_s:.1f} s ({tuning_s / trials:.2f} s/trial), "
                 f"best {latencies[length] * 1e3:.3f} ms, max abs err {error}")
        except Exception as exc:  # noqa: BLE001 - a failed shape is reported, the others still run
            if tuning_s is None:
                total_wall += time.perf_counter() - began
            _log(f"metaschedule T={length}: FAILED after {time.perf_counter() - began:.1f} s: "
                 f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
            _log("".join(traceback.format_exception(exc, limit=-3)).rstrip())
    return latencies, total_wall


__all__ = [
    "check_against_reference", "compile_tvm_default", "dense_epilogue", "machine_ceiling", "median_seconds",
    "numpy_computation", "read_pass", "read_rate", "sgemm_rate", "time_default_rule", "time_numpy", "time_torch",
    "time_tvm_default",
    "time_tvm_module", "torch_computation", "tune_metaschedule", "tvm_arguments", "tvm_arguments_packed",
]
