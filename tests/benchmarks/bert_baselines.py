"""The baselines users run BERT with on a CPU, each on the same checkpoint and thread count:
PyTorch eager, ONNX Runtime and OpenVINO (CPU plugin, latency hint, fp32 inference precision) on one ONNX export;
for bf16 comparisons, OpenVINO at its default precision and PyTorch under bf16 autocast."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

Run = Callable[[np.ndarray, np.ndarray, np.ndarray], object]


def export_onnx(model, path: Path) -> None:
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    example = torch.ones((1, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        LastHiddenState(model).eval(), (example, example, torch.zeros_like(example)), str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes}, dynamo=False,
    )


def torch_eager(model) -> Run:
    import torch

    def run(ids, mask, types):
        with torch.inference_mode():
            return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).last_hidden_state

    return run


def onnx_runtime(onnx_path: Path, threads: int) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    return lambda ids, mask, types: session.run(None, {"input_ids": ids, "attention_mask": mask,
                                                       "token_type_ids": types})


def openvino(onnx_path: Path, threads: int) -> Run:
    import openvino as ov

    core = ov.Core()
    # On CPUs with AVX512_BF16 or AMX the CPU plugin's default inference precision is bf16:
    # it would be timed at half the bytes and twice the FMA rate of every other (fp32) backend.
    compiled = core.compile_model(str(onnx_path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_NUM_THREADS": threads,
                                                          "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda ids, mask, types: request.infer({"input_ids": ids, "attention_mask": mask,
                                                   "token_type_ids": types})


def torch_bf16(model) -> Run:
    """PyTorch eager under ``torch.autocast(cpu, bfloat16)``: its matrix products in bf16 (oneDNN)."""
    import torch

    def run(ids, mask, types):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).last_hidden_state

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
    return (lambda ids, mask, types: request.infer({"input_ids": ids, "attention_mask": mask,
                                                    "token_type_ids": types})), chosen
