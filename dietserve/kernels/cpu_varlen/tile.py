"""The packed attention kernel's register tiles, and the shape-generic space of them that tuning
times: chosen from the register file and the vector width, never from a sequence length (no TVM
here: the plan format and the server read it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ...host.hardware import CpuHardware

LENGTH_VAR = "length"  # what a tile tree branches on: each sequence's own length
# Rows of queries a tile may hold (the scores' register tile is rows x key vectors).
TILE_ROWS = (1, 2, 3, 4, 6, 8)
KEY_VECTORS = (1, 2, 3, 4)
CONTEXT_VECTORS = (1, 2, 4)


@dataclass(frozen=True)
class VarlenTile:
    """Register tiles: ``mr`` queries at a time; scores ``mr x nr`` (keys), context ``mr x nc``
    (head_dim columns). ``lanes``: the vector width in float32s."""

    mr: int = 4
    nr: int = 16
    nc: int = 16
    lanes: int = 8

    def __post_init__(self) -> None:
        if any(type(v) is not int for v in (self.mr, self.nr, self.nc, self.lanes)) or self.lanes < 1:
            raise ValueError(f"tile sizes must be positive integers, got {self}")
        if self.mr < 1 or self.nr % self.lanes or self.nc % self.lanes or min(self.nr, self.nc) < self.lanes:
            raise ValueError(f"tiles {self} are not whole {self.lanes}-lane vectors")

    def describe(self) -> str:
        return f"varlen:{self.mr}x{self.nr},{self.nc}/{self.lanes}"

    def to_dict(self) -> dict:
        return asdict(self)


def tile_for(hardware: CpuHardware) -> VarlenTile:
    """Two vectors of keys (scores) and of head_dim columns (context) a tile: 8 accumulators of
    4 rows in 16 vector registers (AVX2), 12 of 6 rows in 32 (AVX-512), the rest for the
    operands, as the dense kernels' 4 x 16 and 6 x 32 tiles."""
    lanes = hardware.lanes()
    return VarlenTile(mr=6 if hardware.vector_registers >= 32 else 4, nr=2 * lanes, nc=2 * lanes, lanes=lanes)


def context_tile(head_dim: int, tile: VarlenTile) -> tuple[int, int]:
    """(columns, vector lanes) of the context's register tiles: the tile's own where they divide
    head_dim; otherwise the widest vectors and tiles that do (head_dim 12 on AVX2: one tile of
    12 columns in 4-lane vectors), so any model's heads run without a partial tile."""
    lanes = math.gcd(head_dim, tile.lanes)
    return max(c for c in range(lanes, max(tile.nc, lanes) + 1, lanes) if head_dim % c == 0), lanes


def attention_tiles(hardware: CpuHardware, head_dim: int) -> list[VarlenTile]:
    """Every tile whose accumulators, a row of operand vectors and a broadcast fit the vector
    registers in both products, with at least a quarter of the registers accumulating (fewer
    leave the FMA units idle on every tile), one per distinct context tile for ``head_dim``."""
    lanes, registers = hardware.lanes(), hardware.vector_registers
    tiles: dict[tuple, VarlenTile] = {}
    for mr in TILE_ROWS:
        for keys in KEY_VECTORS:
            for columns in CONTEXT_VECTORS:
                fits = all(mr * v + v + 1 <= registers for v in (keys, columns))
                if fits and mr * keys >= registers // 4:
                    tile = VarlenTile(mr=mr, nr=keys * lanes, nc=columns * lanes, lanes=lanes)
                    tiles.setdefault(same_code(tile, head_dim), tile)
    return list(tiles.values())


def same_code(tile: VarlenTile, head_dim: int) -> tuple:
    """What a tile's kernel for ``head_dim`` is made of: tiles equal here build the same code."""
    return tile.mr, tile.nr, context_tile(head_dim, tile)


__all__ = ["LENGTH_VAR", "VarlenTile", "attention_tiles", "context_tile", "same_code", "tile_for"]
