"""bf16 dense layers on AMX tiles (Sapphire, Emerald and Granite Rapids): the packed kernel's
weight and plan, its products as ``tdpbf16ps`` on 16 x 16 fp32 tiles.

A core has 8 tile registers of 16 rows x 64 bytes. One ``tdpbf16ps`` adds to a C tile (16 rows
x 16 fp32 sums) the products of an A tile (16 rows x 16 bf16 pairs of the activations) and a B
tile (16 pair steps x 16 columns of the weight): 32 reduction steps of a 16 x 16 block in one
instruction. The B tile is exactly 16 rows of the bf16 weight's pairs ``Wb[N / panel, K / 2,
panel]`` (``bf16.pack_array``), a row ``panel`` words apart, so AMX kernels read the weight the
AVX512-BF16 kernels read and one plan may hold both.

    activations -> pairs, in 16 x 16 blocks     (each A tile one contiguous KB; rows past the
                                                 last real one repeat it: local padding)
    parallel over (task: nb panels x mr rows):
        configure the tiles (all 16 rows x 64 bytes)
        for each group of pk panels:            the register tile: mr x (pk * panel), mr = 16 * mt
            zero the mt x (pk * panel / 16) C tiles
            for each 32-step block of K:
                load the mt A tiles; per 16 columns: load B, mt x tdpbf16ps
            store the C tiles to the task's sums; the epilogue over the real rows (``Tile.finish_rows``)

A row count that is not whole tiles computes its last tile padded: no remainder tiles and no
bound checks in the product loop, which one instruction per block makes cheap to pad.

The instructions come in two forms of one interface: ``MatrixTiles``, the hardware's, and
``EmulatedTiles``, the same operations as TIR loops over a register file in memory, which read
the tile configuration as the hardware does. The kernel is the same code over either, so where
the CPU has no AMX the emulated build checks its addressing, tile numbers and configuration
against numpy (``PackedSettings.emulated_tiles``).

Linux gives a process the tile state only once it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
each call of a kernel asks first, which costs one system call, so an artifact runs in any process
that loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tvm import sym, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...host.cpu import AMX_FLAGS, ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA, target_cpu_flags
from ..plan.microkernel import AMX_BF16, AMX_TILE, MicroKernel
from ..tir.build import with_exact_buffers
from ..tir.matching import ScheduleMismatch
from . import bf16
from .claimed_tasks import task_loop
from .tile import PackedOperator, Tile

if TYPE_CHECKING:
    from .settings import PackedSettings

TILE_ROWS = AMX_TILE  # rows of a tile register
TILE_WORDS = AMX_TILE  # 32-bit words in a row (64 bytes): fp32 sums of C, bf16 pairs of A and B
TILE_REGISTERS = 8


def has_matrix_tiles(target) -> bool:
    """Whether ``target`` (a tvm Target) is a CPU with AMX-BF16 tiles."""
    return target.kind.name == "llvm" and AMX_FLAGS <= target_cpu_flags(target)


def tile_registers(row_tiles: int, column_tiles: int) -> tuple[list[list[int]], list[int], list[int]]:
    """The tile numbers of a register tile of ``row_tiles`` x ``column_tiles`` C tiles: (C by row
    and column, A by row, B: two where they fit, so one loads while the other multiplies)."""
    if not fits_tile_registers(row_tiles, column_tiles):
        raise ScheduleMismatch(f"{row_tiles} x {column_tiles} C tiles with their A and B need more than "
                               f"{TILE_REGISTERS} tile registers")
    sums = row_tiles * column_tiles
    b_count = min(2, TILE_REGISTERS - sums - row_tiles)
    c = [[r * column_tiles + col for col in range(column_tiles)] for r in range(row_tiles)]
    a = [sums + r for r in range(row_tiles)]
    return c, a, [sums + row_tiles + n for n in range(b_count)]


def fits_tile_registers(row_tiles: int, column_tiles: int) -> bool:
    return row_tiles * column_tiles + row_tiles + 1 <= TILE_REGISTERS


class MatrixTiles:
    """The AMX instructions on tiles numbered 0..7. A tile's memory side is ``buffer`` read
    row by row at ``at(r, q)`` (row r, word q); its row stride is what ``at`` implies."""

    def request_permission(self) -> None:
        T.evaluate(tirx.call_extern("int64", "syscall", tirx.const(SYS_ARCH_PRCTL, "int64"),
                                    tirx.const(ARCH_REQ_XCOMP_PERM, "int64"),
                                    tirx.const(XFEATURE_XTILEDATA, "int64")))

    def configure(self, config: tirx.Buffer) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(config[0])))

    def zero(self, tile: int) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", tirx.const(tile, "int8")))

    def load(self, tile: int, buffer: tirx.Buffer, at) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", tirx.const(tile, "int8"),
                                      T.address_of(buffer[at(0, 0)]), _stride_bytes(buffer, at)))

    def product(self, c: int, a: int, b: int) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", tirx.const(c, "int8"), tirx.const(a, "int8"),
                                      tirx.const(b, "int8")))

    def store(self, tile: int, buffer: tirx.Buffer, at) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", tirx.const(tile, "int8"),
                                      T.address_of(buffer[at(0, 0)]), _stride_bytes(buffer, at)))

    def release(self) -> None:
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))


class EmulatedTiles(MatrixTiles):
    """The same operations as loops over a register file in memory (8 x 16 x 16 words), sized
    by the configuration each time as the hardware's are: a tile's rows from byte 48 + t, its
    bytes a row from bytes 16 + 2t. Slow, and exact: for checking a kernel on any CPU."""

    def __init__(self):
        self.registers = None
        self.config = None

    def request_permission(self) -> None:
        pass

    def configure(self, config: tirx.Buffer) -> None:
        self.config = config
        self.registers = T.alloc_buffer((TILE_REGISTERS, TILE_ROWS, TILE_WORDS), "uint32", scope="global")

    def _rows(self, tile: int):
        return tirx.Cast("int32", self.config[48 + tile])

    def _words(self, tile: int):
        low, high = (tirx.Cast("int32", self.config[16 + 2 * tile + n]) for n in (0, 1))
        return (low + high * 256) // 4

    def zero(self, tile: int) -> None:
        with T.serial(0, TILE_ROWS) as r, T.serial(0, TILE_WORDS) as q:
            T.buffer_store(self.registers, tirx.const(0, "uint32"), [tile, r, q])

    def load(self, tile: int, buffer: tirx.Buffer, at) -> None:
        _stride_bytes(buffer, at)  # (the same check of ``at`` as the hardware's)
        with T.serial(0, self._rows(tile)) as r, T.serial(0, self._words(tile)) as q:
            value = buffer[at(r, q)]
            T.buffer_store(self.registers, value if buffer.dtype == "uint32" else tirx.reinterpret("uint32", value),
                           [tile, r, q])

    def product(self, c: int, a: int, b: int) -> None:
        regs = self.registers
        with T.serial(0, self._rows(c)) as m, T.serial(0, self._words(c)) as n:
            with T.serial(0, self._words(a)) as k:
                total = tirx.reinterpret("float32", regs[c, m, n])
                for odd in (0, 1):
                    total = total + bf16.half(regs[a, m, k], odd) * bf16.half(regs[b, k, n], odd)
                T.buffer_store(regs, tirx.reinterpret("uint32", total), [c, m, n])

    def store(self, tile: int, buffer: tirx.Buffer, at) -> None:
        _stride_bytes(buffer, at)
        with T.serial(0, self._rows(tile)) as r, T.serial(0, self._words(tile)) as q:
            T.buffer_store(buffer, tirx.reinterpret(buffer.dtype, self.registers[tile, r, q]), at(r, q))

    def release(self) -> None:
        pass


def _stride_bytes(buffer: tirx.Buffer, at) -> tirx.Expr:
    """The bytes between rows of a tile at ``at`` in ``buffer``: its words must be contiguous
    and its rows evenly spaced, as the instruction reads them."""
    analyzer = sym.Analyzer()
    offset = lambda r, q: buffer.offset_of(list(at(r, q)))[0]  # noqa: E731
    stride = analyzer.simplify(offset(1, 0) - offset(0, 0))
    if not (analyzer.can_prove_equal(offset(0, 1) - offset(0, 0), 1)
            and analyzer.can_prove_equal(offset(2, 0) - offset(1, 0), stride)):
        raise ScheduleMismatch(f"a tile of {buffer.name} is not rows of contiguous words")
    return tirx.Cast("int64", stride) * (buffer.dtype.bits // 8)


def configure_tiles(tiles: MatrixTiles) -> None:
    """The 64-byte tile configuration (palette 1, every tile 16 rows of 64 bytes), loaded."""
    config = T.alloc_buffer((64,), "uint8", scope="global")
    with T.serial(0, 64) as byte:
        T.buffer_store(config, tirx.const(0, "uint8"), [byte])
    T.buffer_store(config, tirx.const(1, "uint8"), [0])
    for tile in range(TILE_REGISTERS):
        T.buffer_store(config, tirx.const(TILE_WORDS * 4, "uint8"), [16 + 2 * tile])
        T.buffer_store(config, tirx.const(TILE_ROWS, "uint8"), [48 + tile])
    tiles.configure(config)


def _activation_blocks(op: PackedOperator, tile: Tile, loop, row_blocks, depth: int) -> tirx.Buffer:
    """X's rows as bf16 pairs in 16 x 16 blocks ``[row block, k block, row, pair]``: an A tile's
    rows one contiguous KB. Rows past the last real one repeat it (their sums are never stored)."""
    k_blocks = depth // TILE_WORDS
    blocks = T.alloc_buffer((row_blocks, k_blocks, TILE_ROWS, TILE_WORDS), "uint32")
    with loop(0, row_blocks * k_blocks) as job:
        rb, kb = job // k_blocks, job % k_blocks
        with T.serial(0, TILE_ROWS) as r, T.serial(0, TILE_WORDS) as q:
            row = tirx.min(rb * TILE_ROWS + r, tile.rows - 1)
            T.buffer_store(blocks, op.activation_at(row, kb * TILE_WORDS + q), [rb, kb, r, q])
    return blocks


def amx_tile(kernel: MicroKernel) -> tuple[int, int]:
    """(A tiles, C tiles a row) of an AMX micro-kernel's register tile."""
    mr, = kernel.tile_sizes("i")
    panel, pk, _ = kernel.tile_sizes("j")
    return mr // TILE_ROWS, pk * panel // TILE_WORDS


def apply_cpu_amx(func: tirx.PrimFunc, kernel: MicroKernel, workers: int | None = None, *,
                  settings: PackedSettings) -> tirx.PrimFunc:
    """``func`` (a bf16 dense layer reading its weight as pairs, ``packed_form``) as ``kernel``,
    an AMX micro-kernel (``MicroKernel.mma`` ``amx_bf16``); ``workers``, ``settings``: as
    ``apply_cpu_packed``'s. With ``settings.emulated_tiles`` the tiles are ``EmulatedTiles``."""
    if kernel.mma != AMX_BF16:
        raise ScheduleMismatch(f"not an AMX micro-kernel: {kernel}")
    if not (settings.matrix_tiles or settings.emulated_tiles):
        raise ScheduleMismatch("an AMX kernel needs a target with AMX-BF16 tiles (e.g. --mcpu sapphirerapids)")
    op = PackedOperator(func)
    if not op.bf16:
        raise ScheduleMismatch("an AMX kernel multiplies bf16 pairs: build the layer with --precision bf16")
    rows, panels, width, depth = op.extents
    (mr,), (panel, pk, groups) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
    nb = pk * groups
    if not isinstance(width, tirx.IntImm) or int(width) != panel or int(panels) % nb:
        raise ScheduleMismatch(f"weight packing does not fit {nb} panels of {panel} per task")
    if not isinstance(depth, tirx.IntImm) or int(depth) % TILE_WORDS:
        raise ScheduleMismatch(f"{depth} pair steps are not whole {TILE_WORDS}-pair tiles")
    row_tiles, column_tiles = amx_tile(kernel)
    c_tiles, a_tiles, b_tiles = tile_registers(row_tiles, column_tiles)
    tiles = EmulatedTiles() if settings.emulated_tiles else MatrixTiles()
    tile = Tile(op, mr, panel, pk, bf16.PAIR_LANES, rows, remainder_tiles=False, epilogue_loop=True)
    loop = T.parallel if kernel.threads != 1 else T.serial
    tasks = task_loop(kernel.threads, loop, workers, settings.claimed_tasks)
    depth, blocks, row_groups = int(depth), int(panels) // nb, tile.row_tiles()
    with IRBuilder() as builder, T.seq_scope():
        tiles.request_permission()
        x = _activation_blocks(op, tile, loop, row_groups * row_tiles, depth)
        with tasks(blocks * row_groups) as claim:
            block, group_row = claim.task // row_groups, claim.task % row_groups
            i0 = group_row * mr
            configure_tiles(tiles)
            sums = T.alloc_buffer((mr, pk * panel), "float32", scope="global")
            with T.serial(0, groups) as group:
                panel0 = block * nb + group * pk
                for row in c_tiles:
                    for c in row:
                        tiles.zero(c)
                with T.serial(0, depth // TILE_WORDS) as kb:
                    for r, a in enumerate(a_tiles):
                        tiles.load(a, x, lambda m, q, r=r: (group_row * row_tiles + r, kb, m, q))
                    for col in range(column_tiles):
                        p, offset = divmod(col * TILE_WORDS, panel)
                        b = b_tiles[col % len(b_tiles)]
                        tiles.load(b, op.weight, lambda k, q, p=p, offset=offset: (
                            panel0 + p, kb * TILE_WORDS + k, offset + q))
                        for r, a in enumerate(a_tiles):
                            tiles.product(c_tiles[r][col], a, b)
                for r, row in enumerate(c_tiles):
                    for col, c in enumerate(row):
                        tiles.store(c, sums, lambda m, q, r=r, col=col: (r * TILE_ROWS + m, col * TILE_WORDS + q))
                tile.finish_rows(sums, 0, 0, i0, panel0, tirx.min(mr, rows - i0))
            tiles.release()
    body = builder.get().body
    return with_exact_buffers(func.with_body(body).with_attr("tirx.is_scheduled", True), own_storage=True)


__all__ = ["EmulatedTiles", "MatrixTiles", "amx_tile", "apply_cpu_amx", "configure_tiles", "fits_tile_registers",
           "has_matrix_tiles", "tile_registers"]
