"""Packed-weight GEMM micro-kernels: every kernel of the space matches numpy at every length
(with each epilogue BERT has), the weight packing is one map on both sides, the inner loop of
the large-T kernel is straight FMA code on registers, and the space picks packing only where
the weight allows it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.cpu_packed.kernel import crowding_rows, packed_tile, remainder_heights
from dietserve.kernels.cpu_packed.packing import pack_array, pack_prim_func, weight_param
from dietserve.kernels.cpu_packed.settings import STREAM_AHEAD_BYTES, PackedSettings, packed_settings
from dietserve.kernels.cpu_packed.tile import PackedOperator, Tile
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.settings import KernelSettings
from dietserve.kernels.space import task_space
from dietserve.kernels.space.cpu import WHOLE_TASK_L2_SHARE, cpu_space, packed_cpu_space
from dietserve.kernels.tir.build import build
from dietserve.kernels.tir.matching import ScheduleMismatch
from tuner.ops import attention_scores, dense, random_inputs

from .kernel_builds import build_each

SHAPES = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
AVX2 = CPU_PRESETS["avx2"]
K, N = 96, 144  # N = 6 panels of 24 = 9 of 16: several task widths fit, not a power of two


def run(function, spec, kernel: MicroKernel, length: int) -> tuple[np.ndarray, np.ndarray]:
    shape = {"T": length}
    inputs = random_inputs(spec, shape, seed=length)
    arguments = [pack_array(x, kernel.pack) if i == 1 else x for i, x in enumerate(inputs)]
    out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
    function(*[tvm.runtime.tensor(x) for x in arguments], out)
    return out.numpy(), spec.reference(*inputs)


def fitting_space(spec) -> list[MicroKernel]:
    return task_space(cpu_space(AVX2) + packed_cpu_space(AVX2), spec.func)


def test_every_packed_kernel_matches_numpy_at_every_length() -> None:
    spec = dense(K, N, "bias")
    kernels = fitting_space(spec)
    assert kernels and all(k.pack for k in kernels)
    assert {packed_tile(k)[0] for k in kernels} == {1, 2, 3, 4, 5, 6}  # every register-tile height
    functions = build_each(spec.func, kernels, TARGET)
    for index, kernel in enumerate(kernels):
        for length in SHAPES:
            got, expected = run(functions[index], spec, kernel, length)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"{kernel} T={length}")


@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual", "none"])
@pytest.mark.parametrize("tile", [(1, 24, 4, 1), (4, 24, 1, 2), (6, 16, 1, 3), (3, 16, 2, 1)])
def test_packed_kernels_apply_bert_epilogues(epilogue: str, tile: tuple) -> None:
    mr, panel, pk, groups = tile
    spec = dense(K, 192, epilogue)  # 8 panels of 24, 12 of 16
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (1,))), vector=8, pack=panel)
    if epilogue == "none":  # the matmul's own result is the output: nothing to stage packing through
        with pytest.raises(ScheduleMismatch, match="epilogue"):
            apply_kernel(spec.func, kernel, "llvm")
        return
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    for length in SHAPES:
        got, expected = run(function, spec, kernel, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"{epilogue} T={length}")


@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual"])
@pytest.mark.parametrize("tile", [(4, 24, 1, 2, 256), (1, 16, 2, 1, 128), (6, 16, 1, 3, 256)])
def test_reduction_blocked_kernels_match_numpy(epilogue: str, tile: tuple) -> None:
    """kc-deep blocks with the task's partial sums kept across blocks (BLIS order)."""
    mr, panel, pk, groups, kc = tile
    spec = dense(512, 96, epilogue)
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=8, pack=panel)
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    for length in SHAPES:
        got, expected = run(function, spec, kernel, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-4, err_msg=f"{epilogue} T={length}")
    with pytest.raises(ScheduleMismatch, match="blocks"):
        apply_kernel(dense(500, 96, epilogue).func, kernel, "llvm")  # 500 is no whole number of blocks


def aligned_full(shape: tuple, value: float) -> np.ndarray:
    """A float32 array filled with ``value`` whose data starts on 64 bytes (as TVM requires of
    memory it is handed)."""
    count = int(np.prod(shape))
    storage = np.full(count + 16, value, "float32")
    start = (-storage.ctypes.data % 64) // 4
    return storage[start:start + count].reshape(shape)


def assert_exact_within_the_output(function, spec, kernel: MicroKernel, lengths, columns: int,
                                   atol: float = 2e-4) -> None:
    """At every T of ``lengths`` the kernel matches numpy and writes nothing past its output
    (``mr`` guard rows after it, in the same allocation)."""
    (mr,) = kernel.tile_sizes("i")
    for length in lengths:
        inputs = random_inputs(spec, {"T": length}, seed=length)
        arguments = [tvm.runtime.tensor(pack_array(x, kernel.pack) if i == 1 else x) for i, x in enumerate(inputs)]
        guarded = aligned_full((length + mr, columns), 7.0)
        function(*arguments, tvm.runtime.from_dlpack(guarded[:length]))
        np.testing.assert_allclose(guarded[:length], spec.reference(*inputs), rtol=1e-4, atol=atol,
                                   err_msg=f"{kernel} T={length}")
        assert (guarded[length:] == 7.0).all(), f"{kernel} wrote past row {length}"


def output_stores(func) -> list[str]:
    """The lines of a kernel's script that store to its output (the last parameter)."""
    output = str(func.params[-1].name)  # (the output buffer's name, as the script prints it)
    return [line for line in func.script().splitlines() if line.strip().startswith(f"{output}[")]


@pytest.mark.parametrize("tile", [(5, 24, 1, 2, 1), (3, 24, 2, 1, 32)])
def test_padded_rows_are_never_stored(tile: tuple) -> None:
    """Rows are padded locally, in registers: the output's neighbour in memory (here the rows
    after it, in the same allocation) is untouched for every T that leaves a partial tile."""
    mr, panel, pk, groups, kc = tile
    spec = dense(K, N, "bias_residual")
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=8, pack=panel)
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    assert_exact_within_the_output(function, spec, kernel, (1, 2, 7, 13, 127), N, atol=1e-4)


@pytest.mark.parametrize("tile, depth", [((13, 16, 1, 1, 1), K), ((9, 16, 1, 1, 256), 1024),
                                         ((13, 16, 1, 1, 1), 1024), ((6, 8, 1, 6, 1), K),
                                         ((10, 8, 1, 6, 256), 1024)])
def test_every_remainder_of_a_tall_tile_is_computed_exactly(tile: tuple, depth: int) -> None:
    """A tall tile's last row pass runs remainder tiles (``remainder_heights``): every count of
    rows left, 0 .. mr - 1, before and after a whole tile, matches numpy and writes nothing
    past the output; the 1024-deep cases also read the rows' k-major copy and block their
    reduction, except their remainder tiles of fewer than 9 rows, which read X in place. With 6
    one-vector panels per task the remainder tiles span several of them
    (``Tile.widening``: 1 x 6, 2 x 2 and 4 x 1 panels on the 6-row tile; 1 x 6, 2 x 3, 4 x 2
    and 7 x 1 on the 10-row one)."""
    mr, panel, pk, groups, kc = tile
    spec = dense(depth, 48, "bias_residual")
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=8, pack=panel)
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    assert_exact_within_the_output(function, spec, kernel, range(1, 2 * mr + 1), 48)


def test_packing_is_one_map_for_the_prim_func_and_the_data() -> None:
    spec = dense(K, N, "bias")
    assert weight_param(spec.func) == (1, K, N)
    packed = pack_prim_func(spec.func, 24)
    assert [int(d) for d in packed.params[1].ty.shape] == [N // 24, K, 24]
    weight = np.arange(K * N, dtype=np.float32).reshape(K, N)
    panels = pack_array(weight, 24)
    for k, n in [(0, 0), (5, 23), (5, 24), (K - 1, N - 1)]:
        assert panels[n // 24, k, n % 24] == weight[k, n]
    with pytest.raises(ValueError, match="panels"):
        pack_array(weight[:, :100], 24)


def test_packing_needs_a_static_weight_whose_columns_fill_the_tasks() -> None:
    space = cpu_space(AVX2) + packed_cpu_space(AVX2)
    odd = task_space(space, dense(96, 37, "bias").func)
    assert odd and not any(k.pack for k in odd)  # 37 columns: no panel width fits, unpacked kernels
    attention = task_space(space, attention_scores(12, 64).func)
    assert attention and not any(k.pack for k in attention)  # no weight: nothing to pack
    assert weight_param(attention_scores(12, 64).func) is None
    bert = task_space(space, dense(768, 3072, "bias_gelu").func)
    assert bert and all(k.pack and 3072 % (k.pack * packed_tile(k)[3]) == 0 for k in bert)
    blocks = {k.tile_sizes("k")[0] for k in bert}
    assert blocks == {1, 256, 384}  # 768 deep: unblocked, or whole blocks shorter than it
    assert {k.tile_sizes("k")[0] for k in task_space(space, dense(3072, 768, "bias").func)} == {1, 256, 384, 768}


def test_whole_reduction_tasks_fit_the_l2_at_the_weights_own_depth() -> None:
    space = packed_cpu_space(AVX2)
    budget = AVX2.l2_bytes * WHOLE_TASK_L2_SHARE  # (the space itself is sized with 3/4 of it)

    def block_bytes(kernel, depth: int) -> int:
        return packed_tile(kernel)[3] * kernel.pack * depth * 4

    def whole(kernel) -> bool:
        return kernel.tile_sizes("k")[0] == 1

    deep_func = dense(3072, 768, "bias").func
    deep = task_space(space, deep_func, AVX2)
    assert all(block_bytes(k, 3072) <= budget for k in deep if whole(k) and packed_tile(k)[0] > 1)
    dropped = set(task_space(space, deep_func)) - set(deep)  # too big at 3072
    assert dropped and all(whole(k) and packed_tile(k)[0] > 1 and budget < block_bytes(k, 3072) for k in dropped)
    assert any(block_bytes(k, 768) <= budget for k in dropped)  # (fitting at 768 deep)
    assert any(whole(k) and packed_tile(k)[0] > 1 for k in deep)  # small whole-reduction tasks: kept
    assert any(packed_tile(k)[3] == 8 and k.tile_sizes("k")[0] == 384 for k in deep)  # blocked: kept
    assert any(whole(k) and packed_tile(k)[0] == 1 and block_bytes(k, 3072) > budget for k in deep)  # one row: kept
    shallow = dense(768, 3072, "bias_gelu").func
    kept = task_space(space, shallow, AVX2)
    assert all(block_bytes(k, 768) <= budget for k in kept if whole(k) and packed_tile(k)[0] > 1)
    # at 768 deep, only the whole-reduction tasks of several rows between half and 3/4 of the L2 go
    assert all(whole(k) and packed_tile(k)[0] > 1 and budget < block_bytes(k, 768) <= AVX2.l2_bytes * 3 // 4
               for k in set(task_space(space, shallow)) - set(kept))


def test_packed_space_follows_the_register_file() -> None:
    for hardware in CPU_PRESETS.values():
        lanes = hardware.lanes()
        for kernel in packed_cpu_space(hardware):
            mr, panel, pk, _ = packed_tile(kernel)
            vectors = pk * panel // lanes
            assert panel % lanes == 0
            assert mr * vectors + (vectors if mr > 1 else 1) + 1 <= hardware.vector_registers
    avx512 = {packed_tile(k)[:3] for k in packed_cpu_space(CPU_PRESETS["avx512"])}
    assert (14, 32, 1) in avx512 and (9, 48, 1) in avx512  # 32 registers: taller tiles than AVX2's


def fma_loop_bodies(asm: str) -> list[str]:
    """The body of each single-block loop (a block that jumps back to its own label) with >= 8
    FMAs and no constants broadcast: the GELU epilogue's polynomial (straight-line code after a
    whole tile, a loop over a remainder tile's rows) broadcasts its coefficients, a reduction
    step only the activations."""
    bodies = []
    for block in re.split(r"\n(?=\.LBB)", asm):
        label = re.match(r"(\.LBB\w+):", block)
        back = label and re.search(rf"\n\tj\w+\s+{re.escape(label.group(1))}\n", block + "\n")
        if back and len(re.findall(r"vfmadd\d+ps\s+[^\n]*%[yz]mm", block[:back.start()])) >= 8 \
                and not re.search(r"vbroadcastss\s+[^\n]*\(%rip\)", block[:back.start()]):
            bodies.append(block[:back.start()])
    return bodies


def fma_loops(asm: str) -> list[tuple[int, int, int, int, int]]:
    """(FMAs, vector loads, broadcasts, stack references, prefetches) of each FMA loop."""
    return [(len(re.findall(r"vfmadd\d+ps\s+[^\n]*%ymm", body)),
             len(re.findall(r"vmov[au]ps\s+-?\d*\(", body)) + len(re.findall(r"vfmadd\d+ps\s+-?\d*\(%", body)),
             len(re.findall(r"vbroadcastss", body)), len(re.findall(r"\(%rsp\)", body)),  # (%rbp may be a base)
             len(re.findall(r"prefetch", body))) for body in fma_loop_bodies(asm)]


def step_broadcasts(asm: str) -> list[list[tuple[str, int]]]:
    """Per FMA loop: the (base registers, offset) each broadcast reads, as written in the code."""
    return [[(base, int(offset or 0)) for offset, base in re.findall(r"vbroadcastss\s+(-?\d*)\(([^)]*)\)", body)]
            for body in fma_loop_bodies(asm)]


def in_place_rows(reads: list[tuple[str, int]]) -> bool:
    """A step's broadcasts read X's rows where they lie: from several bases, or a row apart."""
    offsets = [offset for _, offset in reads]
    return len({base for base, _ in reads}) > 1 or max(offsets) - min(offsets) >= 4096


def copied_rows(reads: list[tuple[str, int]], mr: int) -> bool:
    """A step's broadcasts read from one base, the rows' elements side by side."""
    offsets = sorted(offset for _, offset in reads)
    return len({base for base, _ in reads}) == 1 and offsets == list(range(offsets[0], offsets[0] + 4 * mr, 4))


@pytest.mark.parametrize("tile", [(9, 8, 1, 2, 1), (13, 8, 1, 1, 256)])
def test_tiles_whose_rows_share_an_l1_set_read_a_k_major_copy(tile: tuple) -> None:
    """Rows 1024 floats apart all fall in one L1 set: a tile of more rows than its 8 ways reads
    them from a k-major copy (each step's broadcasts from one line) when there are that many
    rows (fewer: the padded rows repeat the last real one, in place), and matches numpy at every
    length either way; a 768-deep layer's rows spread over 4 sets and are read in place."""
    mr, panel, pk, groups, kc = tile
    assert crowding_rows(mr, 1024 * 4) == 9 and crowding_rows(8, 1024 * 4) is None
    assert crowding_rows(14, 768 * 4) is None and crowding_rows(13, 3072 * 4) == 9
    spec = dense(1024, 48, "bias_residual")
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=8, pack=panel)
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    for length in SHAPES:  # 1, 2, 7 in place; 13 and longer from the copy
        got, expected = run(function, spec, kernel, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-4, err_msg=f"{kernel} T={length}")
    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    loops = step_broadcasts(build(apply_kernel(spec.func, kernel, "llvm"), haswell).mod.inspect_source("asm"))
    copied = [reads for reads in loops if copied_rows(reads, mr)]
    assert copied and all(len(reads) == mr for reads in copied), loops
    # and the in-place path: the rows a whole row (4 KB) apart, or from separate bases
    assert any(in_place_rows(reads) for reads in loops), loops
    shallow = dense(768, 48, "bias_residual")
    loops = step_broadcasts(build(apply_kernel(shallow.func, kernel, "llvm"), haswell).mod.inspect_source("asm"))
    assert loops and not any(copied_rows(reads, mr) for reads in loops), loops  # read in place


def test_short_remainder_tiles_of_copied_rows_read_them_in_place() -> None:
    """Where a tile reads its rows from the k-major copy (rows 1024 floats apart, 13 of them:
    more than an L1 set's 8 ways), its remainder tiles too short to crowd a set (1, 2, 4 and 7
    rows) read X in place, a line per 16 steps a row, not a line of the copy every step; the
    10- and 12-row ones read the copy like the whole tile. (The numerics: the test above.)"""
    spec = dense(1024, 48, "bias_residual")
    op = PackedOperator(pack_prim_func(spec.func, 16))
    crowding = crowding_rows(13, 1024 * 4)
    assert crowding == 9
    tile = Tile(op, 13, 16, 1, 8, op.extents[0], remainder_tiles=True).with_rows_copied("the copy", crowding)
    assert tile.packed == "the copy"
    heights = remainder_heights(13)[:-1]
    assert heights == [1, 2, 4, 7, 10, 12]
    assert [tile.remainder_tile(h).packed is None for h in heights] == [True, True, True, True, False, False]
    # built without the rule (``PackedSettings.remainder_rows_in_place``: no bound), all read the copy
    assert all(tile.with_rows_copied("the copy").remainder_tile(h).packed == "the copy" for h in heights)


def test_rows_too_few_to_copy_run_only_remainder_tiles() -> None:
    """Below the rows that crowd an L1 set the kernel reads its rows in place, and there they
    are fewer than one tile: that branch holds only the remainder tiles, so the whole tile's
    epilogue (a store per row and vector) is emitted once, in the copied branch, and every
    length before and after the bound still matches numpy."""
    mr, panel, lanes = 13, 16, 8
    spec = dense(1024, 48, "bias_residual")
    assert crowding_rows(mr, 1024 * 4) == 9
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, 1, 1)), ("k", (1,))), vector=lanes, pack=panel)
    func = apply_kernel(spec.func, kernel, "llvm")
    stores = output_stores(func)
    per_row = panel // lanes
    # the whole tile's rows once, and one epilogue loop over a remainder's rows per branch
    assert len(stores) == mr * per_row + 2 * per_row, len(stores)
    function = build(func, TARGET)["main"]
    for length in range(1, 2 * mr + 1):
        got, expected = run(function, spec, kernel, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-4, err_msg=f"{kernel} T={length}")


@pytest.mark.parametrize("kc", [1, 32])
def test_a_large_epilogue_runs_in_one_loop_over_the_tile_rows(kc: int) -> None:
    """BERT's GELU (hundreds of TIR nodes) runs in one loop over a tile's rows after the sums
    are stored, not written out on every row's registers (LLVM spent most of a GELU kernel's
    build on those copies): the output is stored by one row's vectors for the whole tile and one
    for its remainder tiles, where bias and residual store every row from the registers. Every
    length before and after a whole tile matches numpy and nothing is written past the output."""
    mr, panel, lanes = 8, 24, 8
    per_row = panel // lanes
    for epilogue, stores_expected in (("bias_gelu", 2 * per_row), ("bias_residual", mr * per_row + per_row)):
        spec = dense(64, 48, epilogue)
        kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, 1, 1)), ("k", (kc,))), vector=lanes, pack=panel)
        func = apply_kernel(spec.func, kernel, "llvm")
        stores = output_stores(func)
        assert len(stores) == stores_expected, (epilogue, len(stores))
        assert_exact_within_the_output(build(func, TARGET)["main"], spec, kernel, range(1, 2 * mr + 2), 48)


@pytest.mark.parametrize("workers", [None, 2])  # TVM's even split; tasks taken at run time
def test_large_tile_inner_loop_is_register_resident_fma_code(workers: int | None) -> None:
    spec = dense(768, 3072, "bias_gelu")
    kernel = MicroKernel(tile=(("i", (4,)), ("j", (24, 1, 4)), ("k", (1,))), vector=8, pack=24)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # AVX2 + FMA
    scheduled = apply_kernel(spec.func, kernel, target if workers else "llvm")  # its cores take the tasks
    asm = build(scheduled, target).mod.inspect_source("asm")
    loops = fma_loops(asm)
    assert loops, "no FMA loop in the generated code"
    # 4 rows x 3 vectors of accumulators: 12 FMAs per reduction step, fed by 3 panel loads and
    # 4 broadcasts, nothing spilled; the loop body has no compare besides the loop's own. The
    # row passes after a task's first run the same loop with one prefetch of the next block.
    # The remainder tiles (2 and 1 rows, for T not a multiple of 4) are the same loop on fewer
    # rows, which LLVM may unroll over a few steps: per step r x v FMAs, v loads, r broadcasts.
    # The 1-row tile spans the task's 4 groups of panels (12 vectors: 14 registers, within the
    # whole tile's 16), so 12 FMA chains hide the FMA's latency; the 2-row one stays one group
    # wide (2 x 6 would take 19 registers).
    tiles = {(4, 3), (2, 3), (1, 12)}
    seen = set()
    for fmas, loads, broadcasts, stack, prefetches in loops:
        matching = [(rows, vectors) for rows, vectors in tiles
                    if loads % vectors == 0 and broadcasts == rows * (loads // vectors)
                    and fmas == rows * loads]
        assert stack == 0 and len(matching) == 1, loops
        rows, vectors = matching[0]
        assert prefetches in (0, loads // vectors) and (prefetches == 0 or rows == 4), loops
        seen.add(matching[0])
    assert seen == tiles and {rows for rows, _ in tiles} == {*remainder_heights(4)}, loops
    full = [prefetches > 0 for fmas, loads, broadcasts, stack, prefetches in loops if broadcasts == 4 * loads // 3]
    assert set(full) == {False, True}, loops


HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # AVX2: runs on any x86 here
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # (code read, not run)


@pytest.mark.parametrize(("tile", "one_row_vectors"), [((6, 32, 2, 1, 1), None), ((8, 48, 1, 8, 384), 24)])
def test_no_accumulator_is_stored_in_a_reduction_loop(tile: tuple, one_row_vectors: int | None) -> None:
    """Every accumulator stays in a register for the whole reduction: no FMA loop stores a
    vector. Two ways they had not (AVX-512, bert-base's 3072 -> 768 layer): TVM's StorageRewrite
    merged a 6 x 64 tile's last row with a remainder tile's sums, which a loop indexes, so that
    row was stored every step (``build.py`` no longer runs it on our kernels); and a widened
    one-row remainder tile over 8 groups of 48 kept its 384 sums in one 1.5 KB buffer, which TVM
    allocates as a workspace instead of a stack alloca, all 24 stored every step (each panel now
    has a buffer of its own, ``Tile.accumulators``)."""
    mr, panel, pk, groups, kc = tile
    spec = dense(3072, 768, "bias_residual")
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=16, pack=panel)
    asm = build(apply_kernel(spec.func, kernel, AVX512), AVX512).mod.inspect_source("asm")
    bodies = fma_loop_bodies(asm)
    # the whole tile's loop, and the one-row remainder tile's (8 x 3 vectors: 28 registers, so
    # one row spans all 8 groups, 24 vectors in 26)
    steps = [(len(re.findall(r"vfmadd\d+ps", body)), len(re.findall(r"vbroadcastss", body))) for body in bodies]
    assert (mr * pk * panel // 16, mr) in steps, steps
    assert one_row_vectors is None or (one_row_vectors, 1) in steps, steps
    stores = [re.findall(r"vmov[au]ps\s+%[xyz]mm\d+, [^\n]*\(", body) for body in bodies]
    assert not any(stores), [s for s in stores if s]


@pytest.mark.parametrize("tile", [(4, 24, 1, 2, 1), (3, 16, 2, 1, 1), (4, 24, 1, 2, 128), (1, 16, 2, 1, 128)])
def test_kernels_fetching_their_weight_ahead_match_numpy(tile: tuple) -> None:
    """The passes that fetch no next block fetch their own panels' lines ahead, with the settings
    of the CPUs that need it (``packed_settings``; here on haswell, whose code runs on every x86
    machine): exactly one prefetch per line a step reads, the results numpy's, nothing written
    past the output; with other CPUs' settings none."""
    mr, panel, pk, groups, kc = tile
    spec = dense(512, 96, "bias_gelu")
    kernel = MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=8, pack=panel)
    assert packed_settings(HASWELL) == PackedSettings(stream_ahead_bytes=0)  # what haswell is built with
    plain = fma_loops(build(apply_kernel(spec.func, kernel, HASWELL), HASWELL).mod.inspect_source("asm"))
    assert any(prefetches == 0 for *_, prefetches in plain), plain  # (the first passes fetch nothing)
    ahead_settings = KernelSettings(packed=packed_settings(AVX512))  # (an Intel server core's)
    assert ahead_settings.packed.stream_ahead_bytes == STREAM_AHEAD_BYTES
    built = build(apply_kernel(spec.func, kernel, HASWELL, settings=ahead_settings), HASWELL)
    ahead = fma_loops(built.mod.inspect_source("asm"))
    # Every FMA loop now fetches: a next block's line a step, or a line ahead per line it reads
    # (a ymm load reads half a line: at most one prefetch per load).
    assert all(0 < prefetches <= loads for fmas, loads, broadcasts, stack, prefetches in ahead), ahead
    assert_exact_within_the_output(built["main"], spec, kernel, SHAPES, 96)


@pytest.mark.parametrize(("later_passes", "spread"), [(3, 1), (5, 1), (6, 2), (9, 2), (12, 4), (24, 8), (40, 8)])
def test_the_next_block_is_spread_over_the_later_passes(later_passes: int, spread: int) -> None:
    """A task's row passes after its first fetch its next weight block (``NextBlock``): 2 panels
    48 wide (3 lines a step each) over 64 reduction steps, 384 lines. At a line a step that takes
    3 passes of its 2 register tiles; with more later passes the lines are spread over up to 8
    times as many (the power of two that fits), a line every ``spread`` steps. Every line of the
    block is fetched within those passes, first in memory order, no unit more than its share."""
    from types import SimpleNamespace

    from tvm.sym import Analyzer

    from dietserve.kernels.cpu_packed.prefetch import NextBlock

    tile = SimpleNamespace(panel=48, pk=1, dtype=tvm.DataType("float32"))
    groups, span, lines_per_panel = 2, 64, 3 * 64
    ahead = NextBlock(tile, later_passes + 1, 0, 2, 0, span, span, spread=True)
    analyzer = Analyzer()
    units = []
    for unit in range(later_passes * groups):
        lines = []
        for step in range(span):
            panel, line = (int(analyzer.simplify(x)) for x in ahead.fetched(tvm.tirx.const(unit, "int64"), step))
            lines.append(panel * lines_per_panel + line)
        assert len(set(lines)) <= span // spread, (unit, sorted(set(lines)))
        units.append(lines)
    block = list(range(2 * lines_per_panel))
    within = [line for lines in units[:3 * spread * groups] for line in lines]
    assert list(dict.fromkeys(within)) == block  # all of it, each line first fetched in memory order


def test_a_spread_next_block_loop_stays_register_resident() -> None:
    """The spread fetch adds a shift and a clamp to the FMA loop, no division, and keeps every
    accumulator in a register (AVX-512, the 3072 -> 768 layer's 7 x 48 tile)."""
    spec = dense(3072, 768, "bias_residual")
    kernel = MicroKernel(tile=(("i", (7,)), ("j", (48, 1, 1)), ("k", (1,))), vector=16, pack=48)
    asm = build(apply_kernel(spec.func, kernel, AVX512), AVX512).mod.inspect_source("asm")
    bodies = [body for body in fma_loop_bodies(asm) if len(re.findall(r"vfmadd\d+ps", body)) == 21]
    # (the loops fetching 3 lines a step fetch their own lines ahead: ``stream_ahead``)
    fetching = [body for body in bodies if len(re.findall("prefetch", body)) == 1]
    assert fetching, bodies
    for body in fetching:
        assert re.search(r"\bsar", body) and not re.search(r"\bi?div", body), body
        assert not re.findall(r"vmov[au]ps\s+%zmm\d+, [^\n]*\(", body), body
