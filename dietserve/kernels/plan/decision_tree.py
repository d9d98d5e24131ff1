"""Decision trees over shape expressions: DietCode's dispatcher as data (pure Python).

    {"variant": "v1"}                                                    a leaf
    {"var": "batch * seq_len", "le": 64, "then": {...}, "else": {...}}  var <= 64 ? then : else

``var`` is shape-expression text over the operator's symbolic vars (names, integers and
+ - * // %). The link pass compiles a tree into nested ``IfThenElse`` inside the operator's
PrimFunc; the server walks the same tree to label the variant each execution ran. No TVM here:
the server imports it. ``segment`` chooses a tree's intervals from per-shape costs, for the
tuner's plans and the cold start's alike.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import numpy as np

MAX_DEPTH = 64

_AST_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
            ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


class TreeError(ValueError):
    """A decision tree or shape expression is malformed."""


def evaluate_text(text: str, env: Mapping[str, object]):
    """Evaluate shape-expression text with ``env``'s values: ints give an int, TIR vars a TIR
    expression (the same text serves the compiled tree and the server's mirror)."""

    def walk(node: ast.AST):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise TreeError(f"shape expression {text!r} names {node.id!r}, not one of {sorted(env)}")
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            return _AST_OPS[type(node.op)](walk(node.left), walk(node.right))
        raise TreeError(f"shape expression {text!r} may only use names, integers and + - * // %")

    if not isinstance(text, str):
        raise TreeError(f"shape expression must be text, got {text!r}")
    return walk(_parsed(text))


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> ast.Expression:
    """The text's syntax tree, parsed once: a tuner's plans evaluate the same few extents
    hundreds of thousands of times."""
    try:
        return ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise TreeError(f"shape expression {text!r} does not parse: {err.msg}") from err


def names_in(text: str) -> set[str]:
    """The var names a shape expression uses."""
    try:
        return {node.id for node in ast.walk(ast.parse(text, mode="eval")) if isinstance(node, ast.Name)}
    except SyntaxError as err:
        raise TreeError(f"shape expression {text!r} does not parse: {err.msg}") from err


def check_tree(node: object, variants: Iterable[str], names: Iterable[str], depth: int = 0) -> None:
    """Raise TreeError unless ``node`` is a well-formed tree whose leaves name ``variants`` and
    whose expressions use only ``names``."""
    variants, names = set(variants), set(names)
    if depth > MAX_DEPTH:
        raise TreeError(f"decision tree is deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict):
        raise TreeError(f"decision tree node is not an object: {node!r}")
    if "variant" in node:
        if node["variant"] not in variants:
            raise TreeError(f"decision tree names unknown variant {node['variant']!r} (known: {sorted(variants)})")
        return
    if set(node) != {"var", "le", "then", "else"} or type(node["le"]) is not int:
        raise TreeError(f"decision tree node {node!r} needs var, integer le, then and else")
    evaluate_text(node["var"], dict.fromkeys(names, 1))
    check_tree(node["then"], variants, names, depth + 1)
    check_tree(node["else"], variants, names, depth + 1)


def choose(node: Mapping, shape: Mapping[str, int]) -> str:
    """The variant a concrete shape is sent to."""
    while "variant" not in node:
        node = node["then"] if evaluate_text(node["var"], shape) <= node["le"] else node["else"]
    return node["variant"]


def leaves(node: Mapping) -> list[str]:
    if "variant" in node:
        return [node["variant"]]
    return leaves(node["then"]) + leaves(node["else"])


def thresholds(node: Mapping) -> list[tuple[str, int]]:
    """Every (var, le) split: the boundaries a test should probe on both sides."""
    if "variant" in node:
        return []
    return [(node["var"], node["le"]), *thresholds(node["then"]), *thresholds(node["else"])]


T = TypeVar("T")


def fold(node: Mapping, leaf: Callable[[str], T], branch: Callable[[str, int, T, T], T]) -> T:
    """Rebuild the tree bottom-up: ``leaf(variant)`` and ``branch(var, le, then, else)``."""
    if "variant" in node:
        return leaf(node["variant"])
    return branch(node["var"], node["le"], fold(node["then"], leaf, branch), fold(node["else"], leaf, branch))


def interval_tree(var: str, values: Iterable[int], labels: Iterable[str]) -> dict:
    """A balanced tree over ``var`` from (value -> label) pairs: consecutive values with the same
    label form one interval. Values above the largest go to the last interval's label."""
    pairs = sorted(zip(values, labels, strict=True))
    runs: list[tuple[int, str]] = []  # (last value of the run, label)
    for value, label in pairs:
        if runs and runs[-1][1] == label:
            runs[-1] = (value, label)
        else:
            runs.append((value, label))
    if not runs:
        raise TreeError("a decision tree needs at least one (value, label) pair")

    def build(lo: int, hi: int) -> dict:
        if lo == hi:
            return {"variant": runs[lo][1]}
        mid = (lo + hi) // 2
        return {"var": var, "le": runs[mid][0], "then": build(lo, mid), "else": build(mid + 1, hi)}

    return build(0, len(runs) - 1)


def segment(cost: np.ndarray, max_segments: int) -> list[int]:
    """Label each of ``n`` ordered shapes with one of ``V`` variants so that the labels form at
    most ``max_segments`` intervals and the summed ``cost[v, s]`` is least (dynamic programming).

    Bounds the tree (and the code: every leaf is a scheduled copy) however noisy the per-shape
    winners alternate. ``inf`` marks a variant forbidden on a shape; some variant must be
    allowed everywhere.
    """
    variants, n = cost.shape
    # Forbidden entries count as 0 in the sums (a huge stand-in would swamp every later sum's
    # precision); the ``forbidden`` counts exclude the intervals holding them.
    prefix = np.concatenate([np.zeros((variants, 1)), np.cumsum(np.where(np.isinf(cost), 0.0, cost), axis=1)], 1)
    forbidden = np.concatenate([np.zeros((variants, 1)), np.cumsum(np.isinf(cost), axis=1)], axis=1)
    best = np.full((max_segments + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((max_segments + 1, n + 1, 2), dtype=np.int64)  # (segment start, variant)
    for end in range(1, n + 1):
        # cost of shapes [start, end) under each variant, inf where a shape forbids it: the same
        # for every segment count, so all counts are taken at once
        run = prefix[:, end][:, None] - prefix[:, :end]
        run = np.where(forbidden[:, end][:, None] - forbidden[:, :end] > 0, np.inf, run)
        total = (best[:max_segments, :end][:, None, :] + run[None, :, :]).reshape(max_segments, -1)
        pick = np.argmin(total, axis=1)  # per count: the first (variant, start) of the least
        best[1:, end] = total[np.arange(max_segments), pick]
        choice[1:, end, 1], choice[1:, end, 0] = np.divmod(pick, end)
    count = int(np.argmin(best[:, n]))
    if not np.isfinite(best[count, n]):
        raise ValueError("no variant is allowed on every shape of some interval")
    labels = [0] * n
    end = n
    while end > 0:
        start, v = choice[count, end]
        labels[start:end] = [int(v)] * (end - start)
        end, count = int(start), count - 1
    return labels
