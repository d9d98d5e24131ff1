"""The kernel layer: TVM code that both the model compiler and the tuner import, one sub-package
per kernel family plus the data and TIR helpers they share.

- ``apply``: one variant of an operator (a micro-kernel of any family, or the default rule's
  kernel); ``decision_tree_func``: a plan's variants in one PrimFunc that branches on its shape;
  ``settings``: what the families are built with, chosen per target (``kernel_settings``);
- ``plan/``: pure-Python data that crosses files: micro-kernels, kernel plans, decision trees,
  tuning task files (the server reads these, so no TVM there);
- ``tir/``: helpers every family shares: matching matmul-like PrimFuncs, loop helpers, rebuilding
  expressions, the TIR build pipeline, and the math emitted into kernels (GELU, exp, softmax);
- ``cpu_default/``: the rule an untuned CPU build schedules matmuls with;
- ``cpu_padded/``: DietCode's CPU micro-kernel with local padding;
- ``cpu_packed/``: the packed-weight CPU GEMM (dense layers);
- ``cpu_clamped/``: clamped register tiles for operators symbolic in both output axes (attention);
- ``cuda/``: the CUDA micro-kernel and checks of its generated source.

Nothing here imports the tuner, the runtime or the server; facts about the machine (CPU flags,
thread pool, hardware limits) live in ``dietserve.host``.
"""
