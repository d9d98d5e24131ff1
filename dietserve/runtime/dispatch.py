"""Which kernel variant each dynamic operator runs for a concrete shape.

An artifact's manifest carries, per dynamic operator, the decision tree that DietCode compiles
into the host code: inner nodes compare one shape quantity with a threshold, leaves name a
micro-kernel variant. The compiled module makes that choice itself; this mirror of the tree lets
the server report which variant served each request (and the tuner see traffic per variant).

    {"variant": "mk3"}                                           a leaf
    {"var": "tokens", "le": 64, "then": {...}, "else": {...}}   var <= 64 ? then : else

``var`` is ``batch``, ``seq_len`` or ``tokens`` (batch x seq_len, the T of the dense operator).
"""

from __future__ import annotations

import functools

from .manifest import ArtifactError

SHAPE_QUANTITIES = ("batch", "seq_len", "tokens")


def _check_tree(operator: str, node: object, variants: set[str], depth: int = 0) -> None:
    if depth > 64:
        raise ArtifactError(f"dispatch tree of {operator} is deeper than 64 levels")
    if not isinstance(node, dict):
        raise ArtifactError(f"dispatch tree of {operator} has a node that is not an object: {node!r}")
    if "variant" in node:
        if node["variant"] not in variants:
            raise ArtifactError(f"dispatch tree of {operator} names unknown variant {node['variant']!r}")
        return
    if node.get("var") not in SHAPE_QUANTITIES or not isinstance(node.get("le"), int):
        raise ArtifactError(f"dispatch tree of {operator} has a malformed node {node!r}")
    _check_tree(operator, node.get("then"), variants, depth + 1)
    _check_tree(operator, node.get("else"), variants, depth + 1)


def _choose(node: dict, shape: dict[str, int]) -> str:
    while "variant" not in node:
        node = node["then"] if shape[node["var"]] <= node["le"] else node["else"]
    return node["variant"]


class KernelDispatch:
    def __init__(self, table: dict):
        for operator, entry in table.items():
            variants = entry.get("variants") if isinstance(entry, dict) else None
            if not variants:
                raise ArtifactError(f"dispatch entry of {operator} lists no variants")
            _check_tree(operator, entry.get("tree"), set(variants))
        self._trees = {operator: entry["tree"] for operator, entry in sorted(table.items())}

    @property
    def operators(self) -> list[str]:
        return list(self._trees)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one instance per loaded artifact
    def variants(self, batch: int, seq_len: int) -> tuple[tuple[str, str], ...]:
        """((operator, variant), ...) for a batch of ``batch`` rows of ``seq_len`` tokens."""
        shape = {"batch": batch, "seq_len": seq_len, "tokens": batch * seq_len}
        return tuple((operator, _choose(tree, shape)) for operator, tree in self._trees.items())
