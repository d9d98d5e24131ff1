"""The packed-weight CPU GEMM for dense layers: the weight laid out once in column panels
(``packing``), and a BLAS-style kernel emitted with the IR builder (``kernel``) from its register
tile (``tile``), loop nests (``loop_nests``), weight prefetches (``prefetch``) and run-time task
claiming (``claimed_tasks``); what it is built with, per target, is ``settings.PackedSettings``."""
