"""How the clamped-tile kernel is built, as data (``ClampedSettings``), passed down to the code
that reads it: the kernel and the cost model's count of the columns it computes alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClampedSettings:
    """The clamped kernel's switches; the same on every CPU target."""

    # The columns left after the whole column tiles go to the narrowest tile of whole vectors that
    # holds them, not to a whole tile started before them, which would recompute up to a tile's
    # width of columns (``kernel._column_tiles``).
    remainder_columns: bool = True


__all__ = ["ClampedSettings"]
