"""The server warms up at the largest batch its batcher forms from several requests
(``batcher.largest_batch``), and at no more: a long-context model's start-up would
otherwise run ``--max-batch-size`` rows of its longest sequence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dietserve.runtime.batcher import DynamicBatcher, largest_batch

ROWS = 8


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("max_seq_len", [128, 512, 8192])
@pytest.mark.parametrize("budget", [100, 2048, 65536])
def test_the_warm_up_holds_every_batch_the_batcher_forms_and_no_more(packed: bool, max_seq_len: int, budget: int):
    engine = SimpleNamespace(packed=packed, max_seq_len=max_seq_len, max_batch=16)
    batcher = DynamicBatcher(engine, batching=True, max_batch_size=ROWS, max_queue_delay_s=0.0, bucket_ratio=1.5,
                             max_queue_rows=1000, max_batch_tokens=budget)
    rows, seq = largest_batch(engine, ROWS, budget)
    assert seq == max_seq_len
    # (padded, a batch runs at its bucket's length, up to the longest)
    lengths = (max_seq_len,) if not packed else (1, max_seq_len // 3, max_seq_len)
    formed = [(n, n * length) for n in range(1, ROWS + 1) for length in lengths if batcher._fits(n, n * length)]
    assert all(tokens <= rows * seq for _, tokens in formed)
    if not packed:  # (packed, memory follows the tokens, however many rows hold them)
        assert all(n <= rows for n, _ in formed)
    # A request of the longest sequence runs, alone if over the budget; one row fewer holds less.
    needed = max([tokens for _, tokens in formed] + [max_seq_len])
    assert rows >= 1 and (rows - 1) * seq < needed
