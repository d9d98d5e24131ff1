"""Small Relax IRModule -> IRModule passes of our own, one file per mechanism."""

from .fast_softmax import FastSoftmax
from .link_kernels import foreign_plans, link_tuned_kernels, linked_operators
from .sigmoid_activations import VectorGeluTanh, VectorSilu
from .vector_gelu import VectorGelu

__all__ = ["FastSoftmax", "VectorGelu", "VectorGeluTanh", "VectorSilu", "foreign_plans", "link_tuned_kernels",
           "linked_operators"]
