"""Embedding requests with no wire, for OpenAI's and TEI's APIs alike: an ``input`` parsed into
texts or token id sequences, run through a model in batch-sized requests the batcher may run
together, and the embeddings shortened (``dimensions``) and normalised."""

from __future__ import annotations

import asyncio

import numpy as np

from ..runtime.errors import FieldError, InputTooLong
from ..runtime.request import EncoderRequest
from . import codec
from .inference import Answer, Inference
from .model import ServedModel

EMBEDDING = "sentence_embedding"


def token_lists(value: list) -> list[list[int]] | None:
    """``value`` as token id sequences, or None if it is not made of integers."""
    def ints(items: list) -> bool:
        return all(isinstance(i, int) and not isinstance(i, bool) for i in items)

    if ints(value):
        return [value]
    if all(isinstance(item, list) for item in value) and all(ints(item) for item in value):
        return value
    return None


def parse_input(value: object, field: str = "input") -> list[str] | list[list[int]]:
    """A string, strings, token ids or lists of token ids -> texts or token id sequences;
    ``field`` names the body field in errors."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise FieldError(field, f"{field} must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids, and not empty")
    if all(isinstance(item, str) for item in value):
        return value
    tokens = token_lists(value)
    if tokens is None:
        raise FieldError(field, f"{field} mixes types: give strings only, or token ids (integers) only")
    for index, sequence in enumerate(tokens):
        if not sequence:
            raise FieldError(field, f"{field}[{index}] is an empty list of token ids")
    return tokens


def dimensions_field(body: dict) -> int | None:
    """``dimensions``: how many of each embedding's first dimensions to answer (None: all)."""
    value = body.get("dimensions")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise FieldError("dimensions", f"dimensions must be a positive integer, got {value!r}")
    return value


def _ids_rows(sequences: list[list[int]], max_length: int, truncate: bool, first: int, keep_last: bool = False):
    """Token id sequences -> padded ids and mask (rows from input ``first`` on); truncation
    keeps each sequence's first ids, or its last with ``keep_last``."""
    for index, sequence in enumerate(sequences):
        if len(sequence) > max_length and not truncate:
            raise InputTooLong(f"input[{first + index}] has {len(sequence)} tokens, over the model's maximum of "
                               f"{max_length}; shorten it, or send truncate=true to embed its first {max_length}")
    rows = [sequence[-max_length:] if keep_last else sequence[:max_length] for sequence in sequences]
    seq = max(len(row) for row in rows)
    ids, mask = np.zeros((len(rows), seq), np.int64), np.zeros((len(rows), seq), np.int64)
    for index, row in enumerate(rows):
        try:
            ids[index, : len(row)] = row
        except OverflowError:
            raise FieldError("input", f"input[{first + index}] holds a token id outside int64") from None
        mask[index, : len(row)] = 1
    return ids, mask


def shorten(embeddings: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The first ``dimensions`` of each row; re-normalised if the model normalises."""
    if dimensions is None or dimensions == embeddings.shape[1]:
        return embeddings
    if dimensions > embeddings.shape[1]:
        raise FieldError("dimensions", f"dimensions is {dimensions}, over this model's {embeddings.shape[1]}")
    short = embeddings[:, :dimensions]
    return l2_normalized(short) if normalized else short


def l2_normalized(embeddings: np.ndarray) -> np.ndarray:
    """Each row over its L2 norm, as torch.nn.functional.normalize: x / max(||x||, 1e-12)."""
    norms = np.linalg.norm(embeddings.astype(np.float64), axis=1, keepdims=True)
    return (embeddings / np.maximum(norms, 1e-12)).astype(np.float32)


def is_large(size: int, takes_text: bool) -> bool:
    """Whether a request of ``size`` bytes is worth decoding off the event loop (``Inference.off_loop``)."""
    return size > (codec.INLINE_TEXT_BYTES if takes_text else codec.INLINE_MESSAGE_BYTES)


async def infer_inputs(core: Inference, model: ServedModel, inputs: list, truncate: bool | None, large: bool,
                       outputs: tuple[str, ...], keep_last: bool = False) -> list[Answer]:
    """Texts or token id sequences (``parse_input``) through ``model`` (its text or its ids
    model, as the inputs are), in batch-sized requests the batcher may run together; the
    answers in the inputs' order. ``keep_last``: truncation keeps the last tokens."""
    step, truncate = model.engine.max_batch, core.truncate(truncate)

    async def received(first: int) -> tuple[ServedModel, EncoderRequest, None]:
        chunk = inputs[first : first + step]
        request = await core.off_loop(large, decode_inputs, model, chunk, first, truncate, outputs, keep_last)
        return model, request, None

    answers = await asyncio.gather(*(core.infer(received(first)) for first in range(0, len(inputs), step)))
    return [answer for answer, _ in answers]


def decode_inputs(model: ServedModel, inputs: list, first: int, truncate: bool, outputs: tuple[str, ...],
                  keep_last: bool = False) -> EncoderRequest:
    """Texts (tokenized as the ``-text`` model's) or token id sequences (run as given) -> a
    request; ``first`` numbers the inputs in messages as the client's request does."""
    if isinstance(inputs[0], str):
        # Lone surrogates (JSON allows them) pass through to codec's UTF-8 check, which names them.
        tensor = codec.InputTensor(codec.TEXT_INPUT, "BYTES", [len(inputs)],
                                   values=[text.encode("utf-8", "surrogatepass") for text in inputs])
        how = codec.Decoding(model.engine, model.tokenizer, truncate, first=first, keep_last=keep_last)
        return codec.encoder_request(codec.decode_tensors([tensor]), outputs, how)
    ids, mask = _ids_rows(inputs, model.max_input_tokens, truncate, first, keep_last)
    ids, mask, types = model.engine.validate(ids, mask)
    return EncoderRequest(ids, mask, types, outputs)


def normalizes(model: ServedModel) -> bool:
    """Whether the model's graph L2-normalises its sentence embeddings (a Normalize module)."""
    return bool(model.engine.artifact.manifest.normalize_embeddings)
