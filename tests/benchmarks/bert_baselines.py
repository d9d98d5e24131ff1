"""The baselines users run BERT (and its relatives) with on a CPU, each on the same checkpoint and
thread count: PyTorch eager, ONNX Runtime and OpenVINO (CPU plugin, latency hint, fp32 inference
precision) on one ONNX export; for bf16 comparisons, OpenVINO at its default precision and
PyTorch under bf16 autocast. Each is given the inputs its model takes (MPNet and DistilBERT take
no token types)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np

Run = Callable[[np.ndarray, np.ndarray, np.ndarray], object]
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def input_names(model) -> tuple[str, ...]:
    """Which of ``INPUTS`` the transformers model's forward takes."""
    return tuple(name for name in INPUTS if name in inspect.signature(model.forward).parameters)


def _feed(names, ids, mask, types) -> dict:
    arrays = dict(zip(INPUTS, (ids, mask, types), strict=True))
    return {name: arrays[name] for name in names}


def torch_inputs(names, ids, mask, types) -> dict:
    """``_feed`` as tensors; ``names``: ``input_names(model)``, found once, not in a timed run."""
    import torch

    return {name: torch.from_numpy(array) for name, array in _feed(names, ids, mask, types).items()}


def traceable_masks(config, mask):
    """Gemma3's attention masks by layer kind, built from the padding mask by plain tensor ops
    (transformers' own mask functions do not trace): additive, 0 where a query reads a key
    (bidirectional; the sliding layers' keys less than ``config.sliding_window`` away)."""
    import torch

    keys = mask[:, None, None, :].bool()
    positions = torch.arange(mask.shape[1])
    near = (positions[None, :] - positions[:, None]).abs() < config.sliding_window

    def additive(allowed):
        return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)

    return {"full_attention": additive(keys & torch.ones_like(near)), "sliding_attention": additive(keys & near)}


def export_onnx(model, path: Path) -> None:
    import torch

    names = input_names(model)
    gemma = model.config.model_type == "gemma3_text"

    class LastHiddenState(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, *inputs):
            feed = dict(zip(names, inputs, strict=True))
            if gemma:
                feed["attention_mask"] = traceable_masks(self.encoder.config, feed["attention_mask"])
            return self.encoder(**feed).last_hidden_state

    example = torch.ones((1, 8), dtype=torch.int64)  # (token type 0: a model may have no other)
    examples = tuple(torch.zeros_like(example) if name == "token_type_ids" else example for name in names)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        LastHiddenState(model).eval(), examples, str(path), input_names=list(names),
        output_names=["last_hidden_state"], dynamic_axes=dict.fromkeys(names, axes), dynamo=False,
    )


def torch_eager(model) -> Run:
    import torch

    names = input_names(model)

    def run(ids, mask, types):
        with torch.inference_mode():
            return model(**torch_inputs(names, ids, mask, types)).last_hidden_state

    return run


def onnx_runtime(onnx_path: Path, threads: int) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    names = [each.name for each in session.get_inputs()]
    return lambda ids, mask, types: session.run(None, _feed(names, ids, mask, types))


def openvino(onnx_path: Path, threads: int) -> Run:
    import openvino as ov

    core = ov.Core()
    # On CPUs with AVX512_BF16 or AMX the CPU plugin's default inference precision is bf16:
    # it would be timed at half the bytes and twice the FMA rate of every other (fp32) backend.
    compiled = core.compile_model(str(onnx_path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_NUM_THREADS": threads,
                                                          "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    names = [each.get_any_name() for each in compiled.inputs]
    return lambda ids, mask, types: request.infer(_feed(names, ids, mask, types))


def torch_bf16(model) -> Run:
    """PyTorch eager under ``torch.autocast(cpu, bfloat16)``: its matrix products in bf16 (oneDNN)."""
    import torch

    names = input_names(model)

    def run(ids, mask, types):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**torch_inputs(names, ids, mask, types)).last_hidden_state

    return run


def openvino_default(onnx_path: Path, threads: int) -> tuple[Run, str]:
    """OpenVINO as a user gets it, the inference precision left to the CPU plugin (bf16 where the
    CPU has AVX512_BF16 or AMX); returns the run and the precision it chose."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(onnx_path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                               "INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    chosen = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    names = [each.get_any_name() for each in compiled.inputs]
    return (lambda ids, mask, types: request.infer(_feed(names, ids, mask, types))), chosen
