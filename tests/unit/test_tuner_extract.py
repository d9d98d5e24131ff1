"""Tasks come out of a compiled Relax BERT too: a fused dense+bias+GELU PrimFunc of
all-MiniLM-L6-v2, symbolic in batch and sequence length, is tuned-for and scheduled like
the hand-written operators, and stays correct against numpy."""

from __future__ import annotations

import numpy as np
import tvm

from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.extract import spec_from_prim_func
from tuner.measure.job import MeasureJob
from tuner.measure.runner import LocalRunner, MeasureOptions
from tuner.measure.timing import TimingPolicy
from tuner.ops import from_recipe, numpy_gelu
from tuner.task import ShapeVar, TuningTask

KERNEL = MicroKernel(tile=(("i", (4, 4)), ("j", (16, 2)), ("k", (1,))), vector=8)


def test_dense_gelu_prim_func_becomes_a_task(legalized_minilm: tvm.IRModule) -> None:
    name = next(g.name_hint for g, f in legalized_minilm.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and g.name_hint.endswith("gelu") and "matmul" in g.name_hint)
    spec = spec_from_prim_func(name, legalized_minilm[name])
    assert spec.shape_vars == ("batch", "seq_len")
    assert spec.input_shapes({"batch": 2, "seq_len": 7})[0] == (14, 384)
    assert spec.flops({"batch": 2, "seq_len": 7}) == 2 * 14 * 384 * 1536
    rebuilt = from_recipe(spec.recipe)  # what a worker process receives
    assert rebuilt.name == spec.name

    task = TuningTask.create(spec, {"kind": "llvm"}, ShapeVar("seq_len", [1, 13, 128]), fixed={"batch": 2})
    assert task.axis_extents({"batch": 2, "seq_len": 13}) == {"b": 1, "i": 26, "j": 1536, "k": 384}
    with LocalRunner(MeasureOptions(timing=TimingPolicy(number=1, repeat=1))) as runner:  # in a worker process
        result = runner.run(MeasureJob(recipe=spec.recipe, target={"kind": "llvm"}, kernel=KERNEL.to_json(),
                                       shapes=({"batch": 2, "seq_len": 13},), check_shape={"batch": 1, "seq_len": 7}))
    assert result.ok, result.traceback
    assert result.latency > 0

    lib = tvm.compile(apply_kernel(spec.func, KERNEL, "llvm"), tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    for batch, seq_len in ((1, 1), (2, 13), (3, 129)):
        x, w, b = (rng.uniform(-1, 1, s).astype("float32") for s in spec.input_shapes({"batch": batch,
                                                                                       "seq_len": seq_len}))
        out = tvm.runtime.tensor(np.full((batch * seq_len, 1536), np.nan, "float32"))
        shape = {"batch": batch, "seq_len": seq_len}
        lib(*spec.call_arguments(shape, [tvm.runtime.tensor(a) for a in (x, w, b)], out))
        np.testing.assert_allclose(out.numpy(), numpy_gelu(x @ w + b), rtol=1e-4, atol=1e-4)
        # The independent check the worker uses for extracted tasks: TVM's unscheduled build.
        np.testing.assert_allclose(spec.expected(shape, [x, w, b]), numpy_gelu(x @ w + b), rtol=1e-4, atol=1e-4)
