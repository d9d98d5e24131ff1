"""KServe v2 tensors <-> the transport-free request and answer: the checks every wire shares.

Two served models share one engine: the ids model takes ``input_ids`` (INT64 or INT32
[batch, seq]) with optional ``attention_mask`` and ``token_type_ids``; the text model takes
``text`` (BYTES [batch] or [batch, 1]; a classifier's also [batch, 2], one (text, text_pair) per
row) and tokenizes it. Both answer the engine's outputs as raw FP32: ``last_hidden_state``
[batch, seq, hidden] and ``sentence_embedding`` [batch, width], or a classifier's ``logits``
[batch, num_labels].

Each wire (gRPC messages here, REST JSON in ``http_v2.py``) describes its inputs as
:class:`InputTensor` values. Decoding is split so that per-element work is only done for
requests the model can run: :func:`check_shapes` reads names, shapes and sizes alone
(microseconds); :func:`encoder_request` then touches the elements. Large messages are decoded on
a worker thread.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..model.tokenizer import TextTokenizer
from ..runtime.engine import Engine
from ..runtime.errors import InputError
from ..runtime.request import OUTPUTS, EncoderRequest

if TYPE_CHECKING:  # messages are duck-typed: any wire-identical v2 classes work
    from ._proto import open_inference_pb2 as pb

ID_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TEXT_INPUT = "text"
PAIR_WIDTH = 2  # a classifier's text input [batch, 2]: (text, text_pair) per row
ID_DATATYPES = ("INT64", "INT32")
TRUNCATE_PARAMETER = "truncate"
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


class TensorHeader(Protocol):
    """What :func:`check_shapes` reads of an input: a gRPC tensor or an :class:`InputTensor`."""

    name: str
    shape: Iterable[int]


@dataclass(frozen=True)
class InputTensor:
    """One input as a wire carried it: ``raw`` bytes in the v2 binary layout, or ``values``,
    a flat sequence of elements (typed contents, or JSON data already checked for type)."""

    name: str
    datatype: str
    shape: Sequence[int]
    raw: bytes | None = None
    values: Sequence | np.ndarray = ()


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


def decode_tensor(tensor: InputTensor) -> np.ndarray | list[bytes]:
    """One input as a numpy array of its shape, or a flat list of ``bytes`` for BYTES."""
    name, datatype, shape, raw = tensor.name, tensor.datatype, list(tensor.shape), tensor.raw
    if any(dim < 0 for dim in shape):
        raise InputError(f"input '{name}' has a negative dimension in shape {shape}")
    count = math.prod(shape)
    if datatype == "BYTES":
        if raw is not None:
            return _split_bytes(name, raw, count)
        items = list(tensor.values)
        if len(items) != count:
            raise InputError(f"input '{name}' holds {len(items)} BYTES elements but its shape needs {count}")
        return items
    if datatype not in DATATYPES:
        raise InputError(f"input '{name}' has datatype '{datatype}', which the v2 protocol does not define")
    dtype = DATATYPES[datatype][0]
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise InputError(
                f"input '{name}' has {len(raw)} bytes of raw data; shape {shape} of {datatype} needs "
                f"{count * dtype.itemsize}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    values = tensor.values
    if len(values) != count:
        raise InputError(f"input '{name}' holds {len(values)} {datatype} values but its shape {shape} needs {count}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray | list[bytes]:
    """A gRPC input: raw bytes, or its typed contents."""
    field = "bytes_contents" if tensor.datatype == "BYTES" else DATATYPES.get(tensor.datatype, (None, None))[1]
    values = getattr(tensor.contents, field) if field is not None else ()
    return decode_tensor(InputTensor(tensor.name, tensor.datatype, tensor.shape, raw, values))


def decode_tensors(tensors: Iterable[InputTensor]) -> dict[str, tuple[str, np.ndarray | list[bytes]]]:
    """name -> (datatype, data) for every input."""
    decoded = {}
    for tensor in tensors:
        if tensor.name in decoded:
            raise InputError(f"input '{tensor.name}' appears twice")
        decoded[tensor.name] = (tensor.datatype, decode_tensor(tensor))
    return decoded


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, tuple[str, np.ndarray | list[bytes]]]:
    """name -> (datatype, data) for every input of a gRPC ``request``."""
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


def requested_outputs(names: Sequence[str], produced: Sequence[str] = OUTPUTS) -> tuple[str, ...]:
    """The outputs to return, in the order asked; all the model ``produced`` when none are named."""
    names, produced = tuple(names), tuple(produced)
    for name in names:
        if name not in produced:
            raise InputError(f"unknown output '{name}'; this model produces {', '.join(produced)}")
    if len(set(names)) != len(names):
        raise InputError("an output is requested twice")
    return names or produced


def check_truncate(value: object) -> bool | None:
    """The ``truncate`` request parameter: a bool, or None where the request has none."""
    if value is None or isinstance(value, bool):
        return value
    raise InputError(f"parameter 'truncate' must be a bool (true or false), got {value!r}")


def grpc_truncate(request: pb.ModelInferRequest) -> bool | None:
    if TRUNCATE_PARAMETER not in request.parameters:
        return None
    parameter = request.parameters[TRUNCATE_PARAMETER]
    choice = parameter.WhichOneof("parameter_choice")
    return check_truncate(getattr(parameter, choice) if choice else "nothing")


def _text_spec(engine: Engine) -> str:
    if engine.is_classifier:
        return "text (BYTES [batch, 2]: a (text, text_pair) per row, or [batch]: single texts)"
    return "text (BYTES [batch])"


def _check_names(names: list[str], engine: Engine, takes_text: bool) -> None:
    allowed = (TEXT_INPUT,) if takes_text else ID_INPUTS
    for name in names:
        if name not in allowed:
            if takes_text:
                hint = "; send each pair as one row of text, shape [batch, 2]" if name == "text_pair" else ""
                raise InputError(f"unknown input '{name}'; this model takes one input, {_text_spec(engine)}{hint}")
            hint = "; send text to the model's -text twin" if name == TEXT_INPUT else ""
            raise InputError(f"unknown input '{name}'; this model takes input_ids (with optional attention_mask "
                             f"and token_type_ids){hint}")
    required = TEXT_INPUT if takes_text else "input_ids"
    if required not in names:
        spec = _text_spec(engine) if takes_text else "input_ids (INT64 [batch, seq])"
        got = ", ".join(names) if names else "no inputs"
        raise InputError(f"missing input {spec}: got {got}")


def _check_text_shape(shape: list[int], engine: Engine) -> None:
    widths = (1, PAIR_WIDTH) if engine.is_classifier else (1,)
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] not in widths):
        allowed = "[batch], [batch, 1] or [batch, 2] (text, text_pair)" if engine.is_classifier else \
            "[batch] or [batch, 1]"
        hint = "" if engine.is_classifier or len(shape) != 2 or shape[1] != PAIR_WIDTH else \
            " (text pairs are for a classifier; this model embeds single texts)"
        raise InputError(f"input 'text' must have shape {allowed}, got {shape}{hint}")
    if shape[0] == 0:
        raise InputError("input 'text' is an empty batch")
    if shape[0] > engine.max_batch:
        raise InputError(f"batch of {shape[0]} texts exceeds the model's maximum of {engine.max_batch}")


def check_shapes(inputs: Sequence[TensorHeader], engine: Engine, takes_text: bool) -> None:
    """Names, ranks and sizes from the metadata alone, before any element is touched."""
    _check_names([tensor.name for tensor in inputs], engine, takes_text)
    for tensor in inputs:
        shape = list(tensor.shape)
        if any(dim < 0 for dim in shape):
            raise InputError(f"input '{tensor.name}' has a negative dimension in shape {shape}")
        if takes_text:
            _check_text_shape(shape, engine)
        else:
            if len(shape) != 2:
                raise InputError(f"{tensor.name} must be 2-D [batch, seq], got shape {shape}")
            engine.check_shape(*shape)


def in_pairs(inputs: Sequence[TensorHeader]) -> bool:
    """Whether checked text inputs hold (text, text_pair) rows ([batch, 2])."""
    return any(tensor.name == TEXT_INPUT and list(tensor.shape)[1:] == [PAIR_WIDTH] for tensor in inputs)


def _clipped(item: bytes, limit: int, keep_last: bool) -> bytes:
    """``item``'s first (or last) ``limit`` bytes, less a UTF-8 character the cut would split."""
    def inside_a_character(at: int) -> bool:
        return (item[at] & 0xC0) == 0x80  # a continuation byte

    if keep_last:
        cut = len(item) - limit
        while cut < len(item) and inside_a_character(cut):
            cut += 1
        return item[cut:]
    cut = limit
    while cut > 0 and inside_a_character(cut):
        cut -= 1
    return item[:cut]


def texts_of(datatype: str, data: list[bytes], byte_limit: int, keep_last: bool = False) -> tuple[list[str], set[int]]:
    """UTF-8 texts, each cut to ``byte_limit`` bytes (its first, or its last with ``keep_last``;
    at a character boundary), and the indices of those cut."""
    if datatype != "BYTES":
        raise InputError(f"input 'text' has datatype {datatype}; expected BYTES")
    texts, clipped = [], set()
    for index, item in enumerate(data):
        if len(item) > byte_limit:
            item = _clipped(item, byte_limit, keep_last)
            clipped.add(index)
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise InputError(f"input 'text' element {index} is not UTF-8: {err}") from None
    return texts, clipped


@dataclass(frozen=True)
class Decoding:
    """How to turn checked inputs into an encoder request: the model's engine and tokenizer
    (None: the ids model), whether to truncate long texts, and the caller's deadline."""

    engine: Engine
    tokenizer: TextTokenizer | None
    truncate: bool
    deadline: float | None = None
    pairs: bool = False  # the text input holds (text, text_pair) rows: see in_pairs
    first: int = 0  # the index of the first row in the client's request (a request split in parts), for messages
    keep_last: bool = False  # truncation keeps a text's last tokens (TEI's truncation_direction "left")


def encoder_request(inputs: dict[str, tuple[str, np.ndarray | list[bytes]]], outputs: tuple[str, ...],
                    how: Decoding, request_id: str = "") -> EncoderRequest:
    """Inputs that passed :func:`check_shapes`, decoded (name -> (datatype, data)) -> validated
    token tensors (may tokenize)."""
    if how.tokenizer is not None:
        texts, clipped = texts_of(*inputs[TEXT_INPUT], byte_limit=how.tokenizer.byte_limit, keep_last=how.keep_last)
        if how.pairs:  # row-major [batch, 2]: a row's two texts are neighbours
            texts = list(zip(texts[0::PAIR_WIDTH], texts[1::PAIR_WIDTH], strict=True))
            clipped = {index // PAIR_WIDTH for index in clipped}
        encoded = how.tokenizer.encode(texts, truncate=how.truncate, clipped=clipped, first=how.first,
                                       keep_last=how.keep_last)
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
    ids, mask, types = how.engine.validate(*arrays)
    return EncoderRequest(ids, mask, types, outputs, how.deadline, request_id)


def decode(request: pb.ModelInferRequest, how: Decoding) -> EncoderRequest:
    """A gRPC request that passed :func:`check_shapes` -> an encoder request."""
    outputs = requested_outputs([output.name for output in request.outputs], how.engine.output_shapes)
    return encoder_request(decode_inputs(request), outputs, how, request.id)


# ---------------------------------------------------------------------------- the answer


def add_output(response: pb.ModelInferResponse, name: str, array: np.ndarray) -> None:
    """FP32 output in ``raw_output_contents``: what tritonclient and KServe's client read."""
    array = np.ascontiguousarray(array, dtype="<f4")
    response.outputs.add(name=name, datatype="FP32", shape=array.shape)
    response.raw_output_contents.append(array.tobytes())
