"""The kernel layer: TVM-only code that both the model compiler and the tuner import.

- ``microkernel``, ``hardware``: a micro-kernel as data and the hardware limits it must fit;
- ``matching``: which PrimFuncs are matmul-like operators, their shapes as text, workload keys;
- ``loops``, ``cpu``, ``cpu_packed``, ``cuda``, ``default_cpu``, ``apply``: schedules
  (micro-kernels with local padding, the packed-weight CPU GEMM kernels, and the default CPU
  matmul rule an untuned build uses); ``packed_tile``, ``packed_loops``, ``packed_prefetch``:
  the packed kernels' register tile, loop nests and weight prefetch;
- ``packing``: a dense layer's weight laid out in panels (PrimFunc side and data side);
- ``gelu``: the exact-erf GELU in float32 vector arithmetic (through erfc);
- ``fast_exp``: TOPI's vectorisable exp as an expression for any kernel;
- ``tree``, ``plan``: the dispatch tree and the kernel plan format (pure Python, read by the server);
- ``dispatch``: a plan compiled into one branching PrimFunc;
- ``host``: this machine's CPU (flags, LLVM name).

Nothing here imports the tuner, the runtime engine or the server.
"""
