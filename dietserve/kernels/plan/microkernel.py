"""A micro-kernel is data: the tile it computes and how, independent of any concrete shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Matrix instruction families a kernel may name in ``mma`` (inputs rounded to that type, fp32
# accumulation): CUDA tensor cores (``cuda/tensor_core.py``) and CPU AMX tiles (``cpu_packed/amx.py``).
WMMA_F16, AMX_BF16 = "wmma_f16", "amx_bf16"
MMA_KINDS = (WMMA_F16, AMX_BF16)
MMA_FRAGMENT = 16  # the m, n and k of one wmma operation
AMX_TILE = 16  # rows of an AMX tile, and fp32 columns of a C tile


@dataclass(frozen=True)
class MicroKernel:
    """One point of the shape-generic search space.

    ``tile`` maps each spatial/reduction axis name to its per-level tile sizes, outermost
    level first (CPU: register tile, then cache tile; CUDA: thread, warp, block); shapes are
    padded up to whole tiles, so any tile fits any shape.
    """

    tile: tuple[tuple[str, tuple[int, ...]], ...]
    unroll: int = 0  # max unroll steps, 0 = leave to the backend
    vector: int = 1  # innermost vector width in elements
    cache_scopes: tuple[str, ...] = ("local",)  # where operands/accumulators are staged
    threads: int = 0  # CPU: 0 = one task per tile over every core, 1 = serial (tiny shapes skip the wake-up)
    # CPU: panel width of the packed weight the kernel reads (``cpu_packed/packing.py``); 0 = unpacked.
    # A packed kernel's j tile is (panel, panels per register tile, register tiles per task).
    pack: int = 0
    # "" = FMAs on vector units; else a kind of ``MMA_KINDS``. CUDA ``wmma_f16``: tile levels
    # (fragment, fragments per warp, warps per block) on i and j, (fragment, steps) on k. CPU
    # ``amx_bf16``: a packed kernel whose rows and columns are whole 16 x 16 tiles.
    mma: str = ""

    def __post_init__(self) -> None:
        for axis, sizes in self.tile:
            if not sizes or any(size < 1 for size in sizes):
                raise ValueError(f"tile sizes for axis {axis!r} must be positive, got {sizes}")
        if self.mma:
            self._check_tensor_core()

    def _check_tensor_core(self) -> None:
        if self.mma not in MMA_KINDS:
            raise ValueError(f"unknown tensor-core kind {self.mma!r}; known: {MMA_KINDS}")
        if self.mma == AMX_BF16:
            self._check_amx()
            return
        levels = {axis: len(sizes) for axis, sizes in self.tile}
        if levels != {"i": 3, "j": 3, "k": 2} or self.pack:
            raise ValueError(f"a tensor-core kernel tiles i and j in 3 levels and k in 2, unpacked: {self}")
        if any(sizes[0] != MMA_FRAGMENT for _, sizes in self.tile):
            raise ValueError(f"a tensor-core kernel's innermost tile is the {MMA_FRAGMENT}-wide fragment: {self}")

    def _check_amx(self) -> None:
        levels = {axis: len(sizes) for axis, sizes in self.tile}
        if levels != {"i": 1, "j": 3, "k": 1} or not self.pack or self.tile_sizes("j")[0] != self.pack:
            raise ValueError(f"an AMX kernel is packed, tiled (rows,) (panel, panels, groups) (1,): {self}")
        if self.tile_sizes("i")[0] % AMX_TILE or self.pack % AMX_TILE or self.tile_sizes("k") != (1,):
            raise ValueError(f"an AMX kernel's rows and panels are whole {AMX_TILE}-row tiles over the whole "
                             f"reduction: {self}")

    def tile_sizes(self, axis: str) -> tuple[int, ...]:
        for name, sizes in self.tile:
            if name == axis:
                return sizes
        raise KeyError(f"micro-kernel has no axis {axis!r}")

    def tile_of(self, axis: str) -> int:
        """The full extent one micro-kernel instance covers along ``axis``."""
        for name, sizes in self.tile:
            if name == axis:
                product = 1
                for size in sizes:
                    product *= size
                return product
        raise KeyError(f"micro-kernel has no axis {axis!r}")

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    def to_json(self) -> str:
        fields = asdict(self)
        if not self.mma:  # CUDA-core kernels keep the text (and so the record keys) they had
            del fields["mma"]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MicroKernel:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: dict) -> MicroKernel:
        return cls(
            tile=tuple((axis, tuple(sizes)) for axis, sizes in raw["tile"]),
            unroll=raw["unroll"],
            vector=raw["vector"],
            cache_scopes=tuple(raw["cache_scopes"]),
            threads=raw.get("threads", 0),
            pack=raw.get("pack", 0),
            mma=raw.get("mma", ""),
        )

    def __str__(self) -> str:
        tiles = " ".join(f"{axis}={'x'.join(map(str, sizes))}" for axis, sizes in self.tile)
        serial = " serial" if self.threads == 1 else ""
        packed = f" packed={self.pack}" if self.pack else ""
        mma = f" mma={self.mma}" if self.mma else ""
        return (f"MicroKernel({tiles} vec={self.vector} unroll={self.unroll} {'/'.join(self.cache_scopes)}"
                f"{serial}{packed}{mma})")
