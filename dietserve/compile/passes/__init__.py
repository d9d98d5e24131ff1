"""Small Relax IRModule -> IRModule passes of our own, one per file."""

from .fast_softmax import FastSoftmax
from .link_kernels import foreign_plans, link_tuned_kernels, linked_operators

__all__ = ["FastSoftmax", "foreign_plans", "link_tuned_kernels", "linked_operators"]
