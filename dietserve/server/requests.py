"""A v2 inference request for the BERT encoder -> validated token tensors and requested outputs.

Inputs: ``input_ids`` (INT64 or INT32 [batch, seq]) with optional ``attention_mask`` and
``token_type_ids`` of the same shape, or ``text`` (BYTES [batch] or [batch, 1]), tokenized here.
Outputs: ``last_hidden_state`` [batch, seq, hidden] and ``sentence_embedding`` [batch, hidden].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..model.tokenizer import TextTokenizer
from ..runtime.engine import Engine, InputError
from .tensors import RequestError, decode_inputs

if TYPE_CHECKING:  # messages are duck-typed: any wire-identical v2 classes work
    from ._proto import open_inference_pb2 as pb

ID_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TEXT_INPUT = "text"
OUTPUTS = ("last_hidden_state", "sentence_embedding")
ID_DATATYPES = ("INT64", "INT32")


@dataclass(frozen=True)
class EncoderRequest:
    input_ids: np.ndarray  # int64 [batch, seq], validated
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    outputs: tuple[str, ...]  # in the order the client asked for them

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def requested_outputs(request: pb.ModelInferRequest) -> tuple[str, ...]:
    names = tuple(output.name for output in request.outputs)
    for name in names:
        if name not in OUTPUTS:
            raise RequestError(f"unknown output '{name}'; this model produces {', '.join(OUTPUTS)}")
    if len(set(names)) != len(names):
        raise RequestError("an output is requested twice")
    return names or OUTPUTS


def _texts(datatype: str, data) -> list[str]:
    if datatype != "BYTES":
        raise RequestError(f"input 'text' has datatype {datatype}; expected BYTES")
    texts = []
    for index, item in enumerate(data):
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise RequestError(f"input 'text' element {index} is not UTF-8: {err}") from None
    return texts


def parse_request(request: pb.ModelInferRequest, engine: Engine, tokenizer: TextTokenizer) -> EncoderRequest:
    inputs = decode_inputs(request)
    outputs = requested_outputs(request)
    for name in inputs:
        if name not in (*ID_INPUTS, TEXT_INPUT):
            raise RequestError(
                f"unknown input '{name}'; this model takes input_ids (with optional attention_mask and "
                "token_type_ids) or text"
            )
    if TEXT_INPUT in inputs:
        if set(inputs) != {TEXT_INPUT}:
            raise RequestError("send either text or input_ids (with attention_mask, token_type_ids), not both")
        shape = list(request.inputs[0].shape)  # text is the only input
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise RequestError(f"input 'text' must have shape [batch] or [batch, 1], got {shape}")
        texts = _texts(*inputs[TEXT_INPUT])
        if not texts:
            raise RequestError("input 'text' is an empty batch")
        if len(texts) > engine.max_batch:
            raise RequestError(f"batch of {len(texts)} texts exceeds the model's maximum of {engine.max_batch}")
        encoded = tokenizer.encode(texts)
        arrays = (encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    elif "input_ids" in inputs:
        arrays = []
        for name in ID_INPUTS:
            if name not in inputs:
                arrays.append(None)
                continue
            datatype, data = inputs[name]
            if datatype not in ID_DATATYPES:
                raise RequestError(f"input '{name}' has datatype {datatype}; expected INT64 (or INT32)")
            arrays.append(data)
    else:
        missing = "attention_mask/token_type_ids without input_ids" if inputs else "no inputs"
        raise RequestError(f"missing input input_ids (INT64 [batch, seq]) or text (BYTES [batch]): got {missing}")
    try:
        ids, mask, types = engine.validate(*arrays)
    except InputError as err:
        raise RequestError(str(err)) from None
    return EncoderRequest(ids, mask, types, outputs)
