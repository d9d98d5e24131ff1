"""The shapes a server really executes, decayed over time: what the tuner re-weights shapes by.

Each model execution adds 1 to the weight of its shape (batch rows, sequence length; a packed
execution, whose sequences each run at their own length, adds one row at each); all weights
halve every ``half_life_seconds``, so the mix follows the traffic. A packed execution also adds 1
to the weight of its token count, the rows its dense layers ran (``tokens``). The file (JSON,
written whole or not at all) is the one format for this concept: the server writes it, and
``dietserve tune --lengths FILE`` reads it through :func:`observed_lengths` and
:func:`observed_tokens`.

    {"format": "dietserve.traffic", "version": 1, "half_life_seconds": 3600.0,
     "as_of": 1763860000.0, "shapes": [[rows, seq_len, weight], ...], "tokens": [[tokens, weight], ...]}

``weight`` is decayed to ``as_of`` (Unix seconds); ``tokens`` may be absent (no packed execution).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from ..host.atomic_io import write_text_atomic

FORMAT = "dietserve.traffic"
VERSION = 1
NEGLIGIBLE_WEIGHT = 1e-3  # a shape decayed below this is forgotten: the file stays bounded
OBSERVATIONS_FOR_TUNING = 10_000


class TrafficError(ValueError):
    """A traffic file that cannot be read; the message names the file and the problem."""


class Traffic:
    """``weights``: shape -> executions, decayed to the latest time recorded or decayed to."""

    def __init__(self, half_life_seconds: float, as_of: float, weights: dict[tuple[int, int], float] | None = None,
                 tokens: dict[int, float] | None = None):
        if not half_life_seconds > 0:
            raise TrafficError(f"half-life must be positive, got {half_life_seconds}")
        self.half_life_seconds = half_life_seconds
        self.as_of = as_of
        self._latest = as_of
        # Kept as of ``as_of``: an execution at a later time t counts 2^((t - as_of) / half-life)
        # there, so recording is O(1) and only reads decay the whole table.
        self._weights = dict(weights or {})
        self._tokens = dict(tokens or {})

    @property
    def weights(self) -> dict[tuple[int, int], float]:
        self.decay_to(self._latest)
        return self._weights

    @property
    def token_weights(self) -> dict[int, float]:
        """Tokens a packed execution ran -> decayed executions."""
        self.decay_to(self._latest)
        return self._tokens

    def decay_to(self, now: float) -> None:
        self._latest = max(self._latest, now)
        if now <= self.as_of:
            return
        factor = 0.5 ** ((now - self.as_of) / self.half_life_seconds)
        self._weights = {shape: w * factor for shape, w in self._weights.items() if w * factor >= NEGLIGIBLE_WEIGHT}
        self._tokens = {tokens: w * factor for tokens, w in self._tokens.items() if w * factor >= NEGLIGIBLE_WEIGHT}
        self.as_of = now

    def record(self, rows: int, seq_len: int, now: float) -> None:
        scale = self._scale(now)
        self._weights[(rows, seq_len)] = self._weights.get((rows, seq_len), 0.0) + scale

    def record_packed(self, row_lengths: tuple[int, ...], now: float) -> None:
        """A packed execution: each sequence a row at its own length, and its token count."""
        scale = self._scale(now)
        for length in row_lengths:
            if length > 0:  # (a row without tokens runs nothing)
                self._weights[(1, length)] = self._weights.get((1, length), 0.0) + scale
        tokens = sum(row_lengths)
        if tokens > 0:
            self._tokens[tokens] = self._tokens.get(tokens, 0.0) + scale

    def _scale(self, now: float) -> float:
        """What an execution at ``now`` counts as of ``as_of``."""
        if now - self.as_of > 32 * self.half_life_seconds:  # keep the scale factor far from overflow
            self.decay_to(now)
        self._latest = max(self._latest, now)
        return 2.0 ** ((now - self.as_of) / self.half_life_seconds)

    def row_weights(self) -> dict[int, float]:
        """Sequence length -> decayed rows executed at that length."""
        by_length: dict[int, float] = {}
        for (rows, seq_len), weight in self.weights.items():
            by_length[seq_len] = by_length.get(seq_len, 0.0) + rows * weight
        return by_length

    def execution_shapes(self) -> list[tuple[tuple[int, int], float]]:
        """The executions as (rows, length) shapes with their decayed weights, what to time or
        price a version at. A packed record holds each row at its own length and each
        execution's tokens: an execution of T tokens reads as full rows about the rows' mean
        length, as many as make T (its dense layers cost its tokens, attention each row's
        length), not as the single rows it recorded."""
        if not self.token_weights:
            return list(self.weights.items())
        by_length = self.row_weights()
        rows = sum(by_length.values())
        if rows <= 0:
            return []
        mean = max(1, round(sum(length * weight for length, weight in by_length.items()) / rows))
        shapes = []
        for tokens, weight in self.token_weights.items():
            count = max(1, round(tokens / mean))
            shapes.append(((count, max(1, round(tokens / count))), weight))
        return shapes

    def to_json(self) -> str:
        shapes = [[rows, seq, round(w, 6)] for (rows, seq), w in sorted(self.weights.items())]
        tokens = [[count, round(w, 6)] for count, w in sorted(self.token_weights.items())]
        return json.dumps({"format": FORMAT, "version": VERSION, "half_life_seconds": self.half_life_seconds,
                           "as_of": self.as_of, "shapes": shapes, "tokens": tokens})

    def save(self, path: Path) -> None:
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: Path) -> Traffic:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TrafficError(f"traffic file {path} is unreadable: {err}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, where: str) -> Traffic:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TrafficError(f"{where} is not a dietserve traffic file (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise TrafficError(f"{where} has traffic format version {data.get('version')}; this is {VERSION}")
        try:
            half_life, as_of = float(data["half_life_seconds"]), float(data["as_of"])
            weights = {}
            for rows, seq, weight in data["shapes"]:
                if int(rows) < 1 or int(seq) < 1 or not (math.isfinite(float(weight)) and float(weight) >= 0):
                    raise ValueError(f"bad shape entry {[rows, seq, weight]}")
                weights[(int(rows), int(seq))] = float(weight)
            tokens = {}
            for count, weight in data.get("tokens", []):
                if int(count) < 1 or not (math.isfinite(float(weight)) and float(weight) >= 0):
                    raise ValueError(f"bad tokens entry {[count, weight]}")
                tokens[int(count)] = float(weight)
        except (KeyError, TypeError, ValueError) as err:
            raise TrafficError(f"{where} is malformed: {err}") from None
        if not math.isfinite(as_of):
            raise TrafficError(f"{where} is malformed: as_of {as_of}")
        return cls(half_life, as_of, weights, tokens)


def observed_lengths(traffic: Traffic, total: int = OBSERVATIONS_FOR_TUNING) -> tuple[int, ...]:
    """The mix as the tuner takes it (one sequence length per observed row): each length
    repeated in proportion to its decayed rows, ``total`` in all (lengths too rare to round to one
    observation are dropped)."""
    return _observations(traffic.row_weights(), total)


def observed_tokens(traffic: Traffic, total: int = OBSERVATIONS_FOR_TUNING) -> tuple[int, ...]:
    """The packed executions' token counts as the tuner takes them (one per execution, in
    proportion to their decayed weights, as ``observed_lengths``); empty: none recorded."""
    return _observations(traffic.token_weights, total)


def _observations(weights: dict[int, float], total: int) -> tuple[int, ...]:
    scale = total / sum(weights.values()) if weights else 0.0
    values = []
    for value, weight in sorted(weights.items()):
        values.extend([value] * round(weight * scale))
    return tuple(values)


def mix_distance(observed: dict[int, float], reference: dict[int, float], edges: list[int]) -> float:
    """Total variation distance (0: same mix, 1: disjoint) between two sequence-length mixes
    (length -> weight), over the buckets ``edges`` (upper bounds, ascending)."""

    def shares(mix: dict[int, float]) -> list[float]:
        counts = [0.0] * len(edges)
        for length, weight in mix.items():
            counts[min(bisect.bisect_left(edges, length), len(edges) - 1)] += weight
        total = sum(counts)
        return [c / total for c in counts] if total > 0 else counts

    a, b = shares(observed), shares(reference)
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b, strict=True))
