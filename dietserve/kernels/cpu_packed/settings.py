"""How the packed GEMM is built, as data: one frozen ``PackedSettings`` per build, chosen for the
target by ``packed_settings`` and passed down to the code that reads it.

Each switch turns one mechanism of the kernel off, so a benchmark can build it both ways and
measure what the mechanism buys (``tests/benchmarks/cold_weights.py --without``); the defaults
are what the model is built with.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from .amx import has_matrix_tiles
from .bf16 import has_dot_pairs

# The CPUs (LLVM names) whose passes over a weight streamed from DRAM do not overlap the stream
# with their FMAs: Intel's server cores. Their hardware prefetchers run a few lines ahead and
# stop at every 4 KB page, so the kernel fetches a page ahead itself; AMD's Zen cores overlap
# the stream without it.
STREAM_AHEAD_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "sapphirerapids",
                     "emeraldrapids", "graniterapids")
STREAM_AHEAD_BYTES = 4096


@dataclass(frozen=True)
class PackedSettings:
    """The packed GEMM's switches and the cache geometry its tiles are shaped for."""

    # The row passes after a task's first prefetch the weight block the task reads next
    # (``NextBlock``): the first pass reads its block from DRAM (no cache holds a served model's
    # weights) while the later ones compute from cache with the memory bus idle.
    prefetch_next_block: bool = True
    # Where the later passes are more than the next block needs at a line a step, its lines are
    # spread over up to 8 times as many of them, rather than fetched by the first few at a pace
    # one core's share of DRAM cannot keep.
    spread_next_block: bool = True
    # The passes that fetch no next block also fetch, each step, the lines this many bytes ahead
    # in their panel's run (0: not). Set per CPU by ``packed_settings``.
    stream_ahead_bytes: int = 0
    # Tasks taken at run time by the target's cores (``claimed_tasks``), not split evenly in
    # advance: on a shared machine a call then waits less for a core slowed by a neighbour.
    claimed_tasks: bool = True
    # A tile whose rows crowd one L1 set (a row stride of a multiple of ``l1_set_span_bytes``,
    # more rows than ``l1_ways``) evicts its own rows every step; it reads a k-major copy of them
    # instead (``packed_rows``), where one line holds a step's broadcasts. Made only where rows
    # crowd a set: elsewhere the copy costs more than it saves.
    pack_rows: bool = True
    # Remainder tiles too short to crowd a set read their rows in place, not from the copy, whose
    # stride is the whole tile's rows (a new line of it every step).
    remainder_rows_in_place: bool = True
    # The last row pass of a tile that does not divide the rows runs a shorter tile of the rows
    # left (``Tile.passes``), not the whole tile with padded rows.
    remainder_tiles: bool = True
    # An epilogue of more than ``epilogue_unrolled_nodes`` TIR nodes (BERT's GELU; bias and
    # residual are far smaller) runs in one loop over the tile's rows after the sums are stored
    # to the stack, not inline on every row's registers: LLVM's build time grows with every
    # inline copy, and the tuner builds a kernel per trial.
    epilogue_loop: bool = True
    epilogue_unrolled_nodes: int = 64
    # x86 L1 data caches index their sets within a 4 KB page (64 sets of 64-byte lines); 8 ways
    # is the fewest among the x86 cores in view (AMD Zen: 8, Intel's recent cores: 12).
    l1_set_span_bytes: int = 4096
    l1_ways: int = 8
    # The target's ISA has vdpbf16ps (AVX512-BF16): bf16 dense layers can be built
    # (``bf16.py``). Not a switch: a fact of the target, set by ``packed_settings``.
    dot_pairs: bool = False
    # The target has AMX-BF16 tiles: AMX kernels can be built (``amx.py``). A fact, as ``dot_pairs``.
    matrix_tiles: bool = False
    # AMX kernels run their tile instructions as loops over a register file in memory
    # (``amx.EmulatedTiles``): for checking them against numpy on CPUs without AMX.
    emulated_tiles: bool = False


def packed_settings(target: Target | None = None) -> PackedSettings:
    """The settings the packed GEMM is built with for ``target``: the defaults, fetching ahead on
    the CPUs of ``STREAM_AHEAD_CPUS`` only (None, or a target naming no CPU: the defaults)."""
    llvm = target is not None and target.kind.name == "llvm"
    mcpu = target.attrs.get("mcpu") if llvm else None
    ahead = mcpu is not None and str(mcpu) in STREAM_AHEAD_CPUS
    return PackedSettings(stream_ahead_bytes=STREAM_AHEAD_BYTES if ahead else 0,
                          dot_pairs=llvm and has_dot_pairs(target), matrix_tiles=llvm and has_matrix_tiles(target))


__all__ = ["STREAM_AHEAD_BYTES", "STREAM_AHEAD_CPUS", "PackedSettings", "packed_settings"]
