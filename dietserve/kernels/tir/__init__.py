"""TIR helpers the kernel families share: recognising matmul-like PrimFuncs and their shapes
(``matching``), loop scheduling helpers (``loops``), rebuilding an operator's expressions inside
an emitted kernel (``rebuild``), values computed once per task (``computed_once``), the TIR build
pipeline for emitted kernels (``build``), and math written as vectorisable TIR (``gelu``,
``fast_exp``, ``row_softmax``)."""
