"""Small Relax IRModule -> IRModule passes of our own, one per file."""

from .fast_softmax import FastSoftmax

__all__ = ["FastSoftmax"]
