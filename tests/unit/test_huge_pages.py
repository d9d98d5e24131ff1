"""The weights' huge-page arena: exact copies, each tensor page-aligned from a 2 MB boundary,
and, where Linux offers transparent huge pages on advice, backed by them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm

from dietserve.runtime.huge_pages import ALIGNMENT, HUGE_PAGE_BYTES, on_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode (always / madvise / never), or None off Linux."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1: text.index("]")]


def huge_kb_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(value, 16) for value in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_are_exact_aligned_and_in_order() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.random((768, 2304), dtype=np.float32), rng.random((7,), dtype=np.float32),
              rng.integers(0, 100, (3, 5)).astype(np.int64)]
    copies = on_huge_pages([tvm.runtime.tensor(a) for a in arrays])
    addresses = [np.from_dlpack(c).ctypes.data for c in copies]
    for array, copy, address in zip(arrays, copies, addresses, strict=True):
        np.testing.assert_array_equal(copy.numpy(), array)
        assert copy.dtype == str(array.dtype) and tuple(copy.shape) == array.shape
        assert address % ALIGNMENT == 0
    assert addresses[0] % HUGE_PAGE_BYTES == 0 and addresses == sorted(addresses)
    assert on_huge_pages([]) == []


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on advice here")
def test_a_weight_sized_arena_is_backed_by_huge_pages() -> None:
    weight = tvm.runtime.tensor(np.ones((3072, 768), np.float32))  # 9.4 MB: four whole huge pages at least
    (copy,) = on_huge_pages([weight])
    assert huge_kb_at(np.from_dlpack(copy).ctypes.data) >= 4 * HUGE_PAGE_BYTES // 1024
