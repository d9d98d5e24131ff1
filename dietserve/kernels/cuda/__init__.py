"""The CUDA micro-kernel (``kernel.apply_cuda``: block tiles in shared memory, locally padded) and
the checks of its generated CUDA source (``source``), which run on machines without a GPU."""
