"""KServe v2 tensors <-> numpy: raw or typed contents in, raw contents out.

Independent of the model: names, ranks and meanings are checked in ``requests.py``.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import grpc
import numpy as np

if TYPE_CHECKING:  # messages are duck-typed: any wire-identical v2 classes work
    from ._proto import open_inference_pb2 as pb


# v2 datatype -> (little-endian numpy dtype, typed-contents field)
DATATYPES: dict[str, tuple[np.dtype, str]] = {
    "BOOL": (np.dtype("?"), "bool_contents"),
    "UINT8": (np.dtype("<u1"), "uint_contents"),
    "UINT16": (np.dtype("<u2"), "uint_contents"),
    "UINT32": (np.dtype("<u4"), "uint_contents"),
    "UINT64": (np.dtype("<u8"), "uint64_contents"),
    "INT8": (np.dtype("<i1"), "int_contents"),
    "INT16": (np.dtype("<i2"), "int_contents"),
    "INT32": (np.dtype("<i4"), "int_contents"),
    "INT64": (np.dtype("<i8"), "int64_contents"),
    "FP16": (np.dtype("<f2"), "fp32_contents"),
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "FP64": (np.dtype("<f8"), "fp64_contents"),
}
_LENGTH = struct.Struct("<I")


class RequestError(Exception):
    """A request the server rejects; ``code`` is the gRPC status it answers with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def _element_count(name: str, shape: list[int]) -> int:
    if any(dim < 0 for dim in shape):
        raise RequestError(f"input '{name}' has a negative dimension in shape {shape}")
    return math.prod(shape)


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    """BYTES raw layout: each element is a 4-byte little-endian length, then the bytes."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise RequestError(f"input '{name}': raw BYTES data ends inside an element length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise RequestError(f"input '{name}': raw BYTES element of {length} bytes runs past the data")
        items.append(raw[offset : offset + length])
        offset += length
    if len(items) != count:
        raise RequestError(f"input '{name}' holds {len(items)} BYTES elements but its shape needs {count}")
    return items


def decode_input(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None
) -> np.ndarray | list[bytes]:
    """One input as a numpy array of its shape, or a flat list of ``bytes`` for BYTES."""
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    count = _element_count(name, shape)
    if datatype == "BYTES":
        if raw is not None:
            return _split_bytes(name, raw, count)
        items = list(tensor.contents.bytes_contents)
        if len(items) != count:
            raise RequestError(f"input '{name}' holds {len(items)} BYTES elements but its shape needs {count}")
        return items
    if datatype not in DATATYPES:
        raise RequestError(f"input '{name}' has datatype '{datatype}', which the v2 protocol does not define")
    dtype, field = DATATYPES[datatype]
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise RequestError(
                f"input '{name}' has {len(raw)} bytes of raw data; shape {shape} of {datatype} needs "
                f"{count * dtype.itemsize}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise RequestError(f"input '{name}' holds {len(values)} {datatype} values but its shape {shape} needs {count}")
    return np.array(values, dtype=dtype).reshape(shape)


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, tuple[str, np.ndarray | list[bytes]]]:
    """name -> (datatype, data) for every input of ``request``."""
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents has {len(raw_contents)} entries for {len(request.inputs)} inputs; "
            "send all inputs raw or none"
        )
    decoded = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in decoded:
            raise RequestError(f"input '{tensor.name}' appears twice")
        raw = raw_contents[index] if raw_contents else None
        decoded[tensor.name] = (tensor.datatype, decode_input(tensor, raw))
    return decoded


def add_output(response: pb.ModelInferResponse, name: str, array: np.ndarray) -> None:
    """FP32 output in ``raw_output_contents``: what tritonclient and KServe's client read."""
    array = np.ascontiguousarray(array, dtype="<f4")
    response.outputs.add(name=name, datatype="FP32", shape=array.shape)
    response.raw_output_contents.append(array.tobytes())
