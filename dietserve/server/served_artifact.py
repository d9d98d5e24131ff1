"""What the server holds for each artifact it serves: where it comes from (``ModelSource``), its
parts once started (``ServedArtifact``), and the warm-up that settles its memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..model.tokenizer import TextTokenizer
from ..runtime.batcher import DynamicBatcher, largest_batch
from ..runtime.engine import Engine
from ..runtime.memory import resident_bytes
from .metrics import ModelMetrics
from .model import ServedModel
from .swap import HotSwap, MeasuredGain
from .traffic_log import TrafficLog


def warm_up(engine: Engine, rows: int, tokens: int) -> int:
    """Runs a small shape and the largest batch the server forms (``largest_batch``): first touch
    of the weights and of the planned buffers, thread pool start. Returns the resident bytes
    afterwards: what the server needs for any batch it forms. A single request beyond that (more
    rows, or more tokens than a packed budget, up to the artifact's bound) needs more while it
    runs; the pool is released after it (``runtime/memory.py``). Warming up at the artifact's own
    bound instead would keep its worst case resident for good."""
    import numpy as np

    for batch, seq in ((1, min(8, engine.max_seq_len)), largest_batch(engine, rows, tokens)):
        ids = np.ones((batch, seq), np.int64)
        engine.execute(ids, np.ones_like(ids), np.zeros_like(ids))
    return resident_bytes()


@dataclass(frozen=True)
class ModelSource:
    """An artifact to serve: the name of its ids model (its text model is ``name-text``), how to
    load it (on a worker thread), and, served from a version store, its hot swap (the version
    loaded, the store it watches)."""

    name: str
    load: Callable[[], tuple[Engine, TextTokenizer]]
    hot_swap: HotSwap | None = None


@dataclass
class ServedArtifact:
    """One source's parts in the server; its engine, tokenizer and batcher once loaded."""

    source: ModelSource
    metrics: ModelMetrics
    traffic: TrafficLog
    gain: MeasuredGain
    say: Callable[[str], None]  # the server's, naming the model when there are several
    loaded: Engine | None = None  # as loaded at start; a hot swap replaces the batcher's
    tokenizer: TextTokenizer | None = None
    batcher: DynamicBatcher | None = None
    models: dict[str, ServedModel] = field(default_factory=dict)  # its ids and text models

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def engine(self) -> Engine:
        """The engine serving now: the batcher's, once it runs."""
        return self.batcher.engine if self.batcher is not None else self.loaded
