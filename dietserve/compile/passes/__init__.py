"""Small Relax IRModule -> IRModule passes of our own, one per file."""

from .fast_softmax import FastSoftmax
from .link_kernels import foreign_plans, link_tuned_kernels, linked_operators
from .vector_gelu import VectorGelu
from .vector_silu import VectorSilu

__all__ = ["FastSoftmax", "VectorGelu", "VectorSilu", "foreign_plans", "link_tuned_kernels", "linked_operators"]
