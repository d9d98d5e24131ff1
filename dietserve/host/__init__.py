"""The machine the code runs on, for every layer (runtime, compiler, kernels, tuner): the CPU's
flags, LLVM name and thread pool (``cpu``), the hardware limits a micro-kernel must fit
(``hardware``) and files written whole (``atomic_io``). Needs no TVM compiler: the runtime uses
it where only TVM's runtime is installed."""
