"""Attention over packed sequences of their own lengths (``attention``): the padding-free encoder's kernel."""
