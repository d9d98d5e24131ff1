"""KServe v2 messages <-> the transport-free request and answer: the only wire conversions.

Two served models share one engine: the ids model takes ``input_ids`` (INT64 or INT32
[batch, seq]) with optional ``attention_mask`` and ``token_type_ids``; the text model takes
``text`` (BYTES [batch] or [batch, 1]) and tokenizes it. Both answer ``last_hidden_state``
[batch, seq, hidden] and ``sentence_embedding`` [batch, hidden] as raw FP32.

Decoding is split so that per-element work is only done for requests the model can run:
:func:`check_shapes` reads names, shapes and sizes alone (microseconds); :func:`decode` then
touches the elements. The servicer runs both on a worker thread when the message is large.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import numpy as np

from ..model.tokenizer import TextTokenizer
from ..runtime.engine import Engine
from ..runtime.errors import InputError
from ..runtime.request import OUTPUTS, EncoderRequest

if TYPE_CHECKING:  # messages are duck-typed: any wire-identical v2 classes work
    from ._proto import open_inference_pb2 as pb

ID_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TEXT_INPUT = "text"
ID_DATATYPES = ("INT64", "INT32")
# Text beyond this many bytes per token of the model's maximum length is cut before tokenizing:
# it could only add tokens past the truncation point. English averages 4-6 bytes a token, so
# this changes an answer only for text whose first tokens are spread over unusually long words
# or whitespace runs; in exchange a request's tokenizing time is bounded by the maximum length.
TEXT_BYTES_PER_TOKEN = 64
# Messages up to this size are parsed and decoded on the event loop, where a thread hop would
# cost more than the work (tens of microseconds); text over INLINE_TEXT_BYTES is tokenized on a
# worker thread.
INLINE_MESSAGE_BYTES = 64 << 10
INLINE_TEXT_BYTES = 1 << 10

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


# ---------------------------------------------------------------------------- generic v2 tensors


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    """BYTES raw layout: each element is a 4-byte little-endian length, then the bytes."""
    items, offset = [], 0
    while offset < len(raw) and len(items) <= count:
        if offset + 4 > len(raw):
            raise InputError(f"input '{name}': raw BYTES data ends inside an element length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InputError(f"input '{name}': raw BYTES element of {length} bytes runs past the data")
        items.append(raw[offset : offset + length])
        offset += length
    if len(items) != count or offset != len(raw):
        found = f"more than {count}" if len(items) > count or offset != len(raw) else str(len(items))
        raise InputError(f"input '{name}' holds {found} BYTES elements but its shape needs {count}")
    return items


def decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray | list[bytes]:
    """One input as a numpy array of its shape, or a flat list of ``bytes`` for BYTES."""
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InputError(f"input '{name}' has a negative dimension in shape {shape}")
    count = math.prod(shape)
    if datatype == "BYTES":
        if raw is not None:
            return _split_bytes(name, raw, count)
        items = list(tensor.contents.bytes_contents)
        if len(items) != count:
            raise InputError(f"input '{name}' holds {len(items)} BYTES elements but its shape needs {count}")
        return items
    if datatype not in DATATYPES:
        raise InputError(f"input '{name}' has datatype '{datatype}', which the v2 protocol does not define")
    dtype, field = DATATYPES[datatype]
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise InputError(
                f"input '{name}' has {len(raw)} bytes of raw data; shape {shape} of {datatype} needs "
                f"{count * dtype.itemsize}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InputError(f"input '{name}' holds {len(values)} {datatype} values but its shape {shape} needs {count}")
    return np.array(values, dtype=dtype).reshape(shape)


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, tuple[str, np.ndarray | list[bytes]]]:
    """name -> (datatype, data) for every input of ``request``."""
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise InputError(
            f"raw_input_contents has {len(raw_contents)} entries for {len(request.inputs)} inputs; "
            "send all inputs raw or none"
        )
    decoded = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in decoded:
            raise InputError(f"input '{tensor.name}' appears twice")
        raw = raw_contents[index] if raw_contents else None
        decoded[tensor.name] = (tensor.datatype, decode_input(tensor, raw))
    return decoded


# ---------------------------------------------------------------------------- the encoder's inputs


def parse_infer_request(message: bytes) -> pb.ModelInferRequest:
    from google.protobuf.message import DecodeError

    from ._proto import open_inference_pb2 as pb

    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as err:
        raise InputError(f"the request is not a valid ModelInferRequest message: {err}") from None


def requested_outputs(request: pb.ModelInferRequest) -> tuple[str, ...]:
    names = tuple(output.name for output in request.outputs)
    for name in names:
        if name not in OUTPUTS:
            raise InputError(f"unknown output '{name}'; this model produces {', '.join(OUTPUTS)}")
    if len(set(names)) != len(names):
        raise InputError("an output is requested twice")
    return names or OUTPUTS


def check_shapes(request: pb.ModelInferRequest, engine: Engine, takes_text: bool) -> None:
    """Names, ranks and sizes from the metadata alone, before any element is touched."""
    names = [tensor.name for tensor in request.inputs]
    allowed = (TEXT_INPUT,) if takes_text else ID_INPUTS
    for name in names:
        if name not in allowed:
            if takes_text:
                raise InputError(f"unknown input '{name}'; this model takes one input, text (BYTES [batch])")
            hint = "; send text to the model's -text twin" if name == TEXT_INPUT else ""
            raise InputError(f"unknown input '{name}'; this model takes input_ids (with optional attention_mask "
                             f"and token_type_ids){hint}")
    required = TEXT_INPUT if takes_text else "input_ids"
    if required not in names:
        spec = "text (BYTES [batch])" if takes_text else "input_ids (INT64 [batch, seq])"
        got = ", ".join(names) if names else "no inputs"
        raise InputError(f"missing input {spec}: got {got}")
    for tensor in request.inputs:
        shape = list(tensor.shape)
        if any(dim < 0 for dim in shape):
            raise InputError(f"input '{tensor.name}' has a negative dimension in shape {shape}")
        if takes_text:
            if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
                raise InputError(f"input 'text' must have shape [batch] or [batch, 1], got {shape}")
            if shape[0] == 0:
                raise InputError("input 'text' is an empty batch")
            if shape[0] > engine.max_batch:
                raise InputError(f"batch of {shape[0]} texts exceeds the model's maximum of {engine.max_batch}")
        else:
            if len(shape) != 2:
                raise InputError(f"{tensor.name} must be 2-D [batch, seq], got shape {shape}")
            engine.check_shape(*shape)


def _texts(datatype: str, data: list[bytes], byte_limit: int) -> list[str]:
    if datatype != "BYTES":
        raise InputError(f"input 'text' has datatype {datatype}; expected BYTES")
    texts = []
    for index, item in enumerate(data):
        if len(item) > byte_limit:
            cut = byte_limit
            while cut > 0 and (item[cut] & 0xC0) == 0x80:  # do not split a UTF-8 character
                cut -= 1
            item = item[:cut]
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise InputError(f"input 'text' element {index} is not UTF-8: {err}") from None
    return texts


def decode(request: pb.ModelInferRequest, engine: Engine, tokenizer: TextTokenizer | None,
           deadline: float | None) -> EncoderRequest:
    """A request that passed :func:`check_shapes` -> validated token tensors (may tokenize)."""
    inputs = decode_inputs(request)
    outputs = requested_outputs(request)
    if tokenizer is not None:
        texts = _texts(*inputs[TEXT_INPUT], byte_limit=engine.max_seq_len * TEXT_BYTES_PER_TOKEN)
        encoded = tokenizer.encode(texts)
        arrays = (encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    else:
        arrays = []
        for name in ID_INPUTS:
            if name not in inputs:
                arrays.append(None)
                continue
            datatype, data = inputs[name]
            if datatype not in ID_DATATYPES:
                raise InputError(f"input '{name}' has datatype {datatype}; expected INT64 (or INT32)")
            arrays.append(data)
    ids, mask, types = engine.validate(*arrays)
    return EncoderRequest(ids, mask, types, outputs, deadline)


# ---------------------------------------------------------------------------- the answer


def add_output(response: pb.ModelInferResponse, name: str, array: np.ndarray) -> None:
    """FP32 output in ``raw_output_contents``: what tritonclient and KServe's client read."""
    array = np.ascontiguousarray(array, dtype="<f4")
    response.outputs.add(name=name, datatype="FP32", shape=array.shape)
    response.raw_output_contents.append(array.tobytes())
