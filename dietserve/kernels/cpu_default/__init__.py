"""The default CPU matmul rule (``rule.CPUMatmul``): what an untuned build schedules matmul-like
PrimFuncs with, and the variant every plan can fall back to (dlight has no CPU matmul rule)."""
