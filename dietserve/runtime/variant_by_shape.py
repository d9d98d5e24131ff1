"""Which kernel variant each dynamic operator runs for a concrete shape.

An artifact's manifest carries, per dynamic matmul-like operator, the decision tree that the
link pass compiled into that operator (``dietserve.kernels.plan.decision_tree``: inner nodes compare a shape
expression such as ``batch * seq_len`` with a threshold, leaves name a variant) and how many
call sites (layers) the model has. The compiled code makes the choice itself; this mirror of
the tree lets the server count which variant served each execution.
"""

from __future__ import annotations

import functools

from ..kernels.plan.decision_tree import TreeError, check_tree, choose
from .manifest import ArtifactError


def dispatch_shape(batch: int, seq_len: int, tokens: int | None = None) -> dict[str, int]:
    """The values a dispatch tree's expressions read for one execution: a padded artifact's
    ``batch`` and ``seq_len``, a packed one's ``tokens`` (its dense layers' rows; every row
    full where not given)."""
    return {"batch": batch, "seq_len": seq_len, "tokens": batch * seq_len if tokens is None else tokens}


class KernelDispatch:
    def __init__(self, table: dict):
        for operator, entry in table.items():
            variants = entry.get("variants") if isinstance(entry, dict) else None
            if not variants:
                raise ArtifactError(f"dispatch entry of {operator} lists no variants")
            try:
                check_tree(entry.get("tree"), variants, entry.get("shape_vars", ()))
            except TreeError as err:
                raise ArtifactError(f"dispatch tree of {operator}: {err}") from err
        self._entries = {operator: (entry["tree"], int(entry.get("calls", 1)))
                         for operator, entry in sorted(table.items())}

    @property
    def operators(self) -> list[str]:
        return list(self._entries)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one instance per loaded artifact
    def variants(self, batch: int, seq_len: int, tokens: int | None = None) -> tuple[tuple[str, str, int], ...]:
        """((operator, variant, executions), ...) for one run of ``batch`` rows of ``seq_len``
        tokens (a packed artifact's: ``tokens`` attended ones in all, its dense layers' rows):
        each operator runs once per call site (layer)."""
        shape = dispatch_shape(batch, seq_len, tokens)
        return tuple((operator, choose(tree, shape), calls) for operator, (tree, calls) in self._entries.items())
