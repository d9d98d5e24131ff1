"""Rerank and classification over HTTP, for a classifier (cross-encoder) artifact: text
embeddings inference's (TEI) ``POST /rerank`` and ``POST /predict``, and Cohere's
``POST /v1/rerank``. On an embedding model each answers 400, naming what the model is. The
checks and the work of TEI's two are :class:`ClassifierCalls`', which TEI's gRPC ``Predict`` and
``Rerank`` (``tei_grpc.py``) call too.

A query and its documents become (query, document) pairs, tokenized as the checkpoint's
tokenizer encodes pairs (``model/tokenizer.py``) and run through the same core as every other
request (batcher, limits, metrics); requests with more pairs than the model's batch bound are
split into batch-sized requests, which the batcher may run together.

Scores are what sentence-transformers' CrossEncoder and TEI give: the sigmoid of the logit for
a one-label model (a relevance score), the softmax over the labels for several (``/predict``);
``raw_scores`` returns the logits as they are. Reranking needs a one-label model.

Which model: Cohere's body names it (``model``). TEI's routes have none, since TEI serves one
model; here they use the only classifier served, or, where there are several, the one named by a
``model`` field in the body or a ``?model=`` query (either model name of the artifact).
"""

from __future__ import annotations

import asyncio
import math
import uuid

import numpy as np
from aiohttp import web

from ..runtime.errors import FieldError, InputError
from ..runtime.request import EncoderRequest
from . import codec
from .http_body import json_response, read_object
from .inference import Inference
from .model import ServedModel
from .tei_api import named_model
from .tei_calls import chosen_model, flag_field, keeps_last, other_routes, string_field, wrong_kind

LOGITS = "logits"
Item = str | tuple[str, str]  # a text, or a (text, text_pair) pair
COHERE_SEARCH_UNIT = 100  # documents per search unit, as Cohere bills


def scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    """[rows, labels] logits -> TEI's scores: as they are (``raw``), a sigmoid for one label, a
    softmax over several."""
    logits = logits.astype(np.float64)
    if raw:
        return logits
    if logits.shape[1] == 1:
        return 1 / (1 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------- request fields


def _texts(body: dict, key: str) -> list[str]:
    """A non-empty list of strings, or of Cohere's {"text": str} documents."""
    value = body.get(key)
    if not isinstance(value, list) or not value:
        raise FieldError(key, f"{key} must be a non-empty list of strings")
    texts = []
    for index, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise FieldError(key, f"{key}[{index}] must be a string or {{\"text\": string}}, got {item!r:.80}")
        texts.append(item)
    return texts


def _sequence(value: object, where: str) -> Item:
    """TEI's sequence: a text, [text] or [text, text_pair]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) in (1, 2) and all(isinstance(text, str) for text in value):
        return value[0] if len(value) == 1 else (value[0], value[1])
    raise FieldError("inputs", f"{where} must be a text, [text] or [text, text_pair], got {value!r:.80}")


def predict_inputs(value: object) -> tuple[list[Item], bool]:
    """TEI's ``inputs`` -> (items, whether it was a batch): a text or a one- or two-text list is
    one input; any other list is a batch of such inputs."""
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and len(value) in (1, 2) and all(isinstance(text, str) for text in value):
        return [_sequence(value, "inputs")], False
    if not isinstance(value, list) or not value:
        raise FieldError("inputs", "inputs must be a text, [text, text_pair], or a non-empty list of them")
    return [_sequence(item, f"inputs[{index}]") for index, item in enumerate(value)], True


# ---------------------------------------------------------------------------- routes


class ClassifierCalls:
    """TEI's classifier calls, with no wire (HTTP: :class:`RerankRoutes`; gRPC: ``tei_grpc.py``):
    each takes TEI's JSON body, the model the request names (None: the only classifier) and
    whether the request is large enough to tokenize off the event loop."""

    def __init__(self, core: Inference):
        self.core = core
        self.config = core.state.config

    def _classifier(self, route: str, one_label: bool, model: ServedModel) -> ServedModel:
        """``model``, once it is known to be a classifier (with one label, to rerank)."""
        engine = model.engine
        if not engine.is_classifier:
            raise InputError(f"{route} needs {wrong_kind(True)}; the served model '{model.name}' is an embedding "
                             f"model: {other_routes(True)}")
        if one_label and len(engine.labels) != 1:
            raise InputError(f"{route} needs a classifier with one label (a relevance score); '{model.artifact}' has "
                             f"{len(engine.labels)} ({', '.join(engine.labels)}): use /predict")
        return model

    async def ranks(self, body: dict, name: str | None, large: bool) -> tuple[list[dict], int]:
        """TEI: {query, texts, raw_scores, return_text, truncate} -> ([{index, score, text?}], best
        first; the tokens read), from the classifier ``name`` names (None: the only one)."""
        query, texts = string_field(body, "query"), _texts(body, "texts")
        return await self.pair_ranks([(query, text) for text in texts], body, name, large)

    async def pair_ranks(self, pairs: list[tuple[str, str]], options: dict, name: str | None,
                         large: bool) -> tuple[list[dict], int]:
        """(query, text) pairs, each scored -> ([{index, score, text?}], best first; the tokens
        read); ``options`` holds raw_scores, return_text and truncate."""
        model = self._classifier("/rerank", True, chosen_model(self.core, "/rerank", name, classifier=True))
        raw, with_text = flag_field(options, "raw_scores", False), flag_field(options, "return_text", False)
        logits, tokens = await self._logits(model, pairs, options, large)
        ranked = sorted(enumerate(scores(logits, raw)[:, 0].tolist()), key=lambda entry: -entry[1])
        return [{"index": index, "score": score, **({"text": pairs[index][1]} if with_text else {})}
                for index, score in ranked], tokens

    async def predictions(self, body: dict, name: str | None, large: bool) -> tuple[list[list[dict]], bool, int]:
        """TEI: {inputs, raw_scores, truncate} -> ([{label, score}] per input, best first; whether
        ``inputs`` was a batch; the tokens read), from the classifier ``name`` names (None: the
        only one)."""
        model = self._classifier("/predict", False, chosen_model(self.core, "/predict", name, classifier=True))
        if "inputs" not in body:
            raise FieldError("inputs", "the body needs 'inputs': a text, [text, text_pair], or a list of them")
        items, batch = predict_inputs(body["inputs"])
        raw = flag_field(body, "raw_scores", False)
        logits, tokens = await self._logits(model, items, body, large)
        labels = model.engine.labels
        answers = [sorted(({"label": label, "score": score} for label, score in zip(labels, row, strict=True)),
                          key=lambda entry: -entry["score"])
                   for row in scores(logits, raw).tolist()]
        return answers, batch, tokens

    # ------------------------------------------------------------------ inference

    async def _logits(self, model: ServedModel, items: list[Item], options: dict,
                      large: bool) -> tuple[np.ndarray, int]:
        """[len(items), labels] logits and the tokens read, in batch-sized requests, cut as
        ``options``' truncate and truncation_direction say."""
        step, truncate = model.engine.max_batch, self.core.truncate(flag_field(options, "truncate", None))
        keep_last = keeps_last(options)
        answers = await asyncio.gather(*(
            self.core.infer(self._receive(model, items[first : first + step], first, truncate, keep_last, large))
            for first in range(0, len(items), step)))
        logits = np.concatenate([answer.outputs[LOGITS] for answer, _ in answers])
        return logits, sum(answer.request.tokens for answer, _ in answers)

    async def _receive(self, model: ServedModel, items: list[Item], first: int, truncate: bool, keep_last: bool,
                       large: bool) -> tuple[ServedModel, EncoderRequest, None]:
        return model, await self.core.off_loop(large, encode_items, model, items, first, truncate, keep_last), None



class RerankRoutes(ClassifierCalls):
    """The classifier routes over HTTP."""

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/rerank", self.rerank)
        app.router.add_post("/v1/rerank", self.cohere_rerank)
        app.router.add_post("/predict", self.predict)

    async def _body(self, request: web.Request) -> tuple[dict, bool]:
        """The JSON body, and whether it is large enough to tokenize off the event loop."""
        fields, body = await read_object(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)
        return fields, len(body) > codec.INLINE_TEXT_BYTES

    async def rerank(self, request: web.Request) -> web.Response:
        body, large = await self._body(request)
        ranks, _ = await self.ranks(body, named_model(request, body), large)
        return json_response(ranks)

    async def cohere_rerank(self, request: web.Request) -> web.Response:
        """Cohere: {model, query, documents, top_n, return_documents} -> {id, results, meta}."""
        body, large = await self._body(request)
        model = self._classifier("/v1/rerank", True, self.core.model_for(string_field(body, "model"), takes_text=True))
        query, documents = string_field(body, "query"), _texts(body, "documents")
        top_n = body.get("top_n", len(documents))
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
            raise FieldError("top_n", f"top_n must be a positive integer, got {top_n!r}")
        with_documents = flag_field(body, "return_documents", False)
        logits, tokens = await self._logits(model, [(query, document) for document in documents], body, large)
        ranked = sorted(enumerate(scores(logits, False)[:, 0].tolist()), key=lambda entry: -entry[1])[:top_n]
        results = [{"index": index, "relevance_score": score,
                    **({"document": {"text": documents[index]}} if with_documents else {})}
                   for index, score in ranked]
        meta = {"api_version": {"version": "2"}, "tokens": {"input_tokens": tokens},
                "billed_units": {"search_units": math.ceil(len(documents) / COHERE_SEARCH_UNIT)}}
        return json_response({"id": str(uuid.uuid4()), "results": results, "meta": meta})

    async def predict(self, request: web.Request) -> web.Response:
        body, large = await self._body(request)
        answers, batch, _ = await self.predictions(body, named_model(request, body), large)
        return json_response(answers if batch else answers[0])


def encode_items(model: ServedModel, items: list[Item], first: int, truncate: bool,
                 keep_last: bool = False) -> EncoderRequest:
    """Texts and pairs -> a request for the logits. Each text is cut to the tokenizer's byte limit
    (its last bytes with ``keep_last``, TEI's ``truncation_direction`` left: a pair's longest text
    cut from its start) and checked as UTF-8 as v2 text is (``codec.texts_of``); ``first`` numbers
    the items in messages as the client's request does."""
    flat = [text for item in items for text in ((item,) if isinstance(item, str) else item)]
    # Lone surrogates (JSON allows them) pass through to the UTF-8 check, which names them.
    texts, clipped_texts = codec.texts_of("BYTES", [text.encode("utf-8", "surrogatepass") for text in flat],
                                          model.tokenizer.byte_limit, keep_last)
    regrouped, clipped, offset = [], set(), 0
    for index, item in enumerate(items):
        width = 1 if isinstance(item, str) else 2
        regrouped.append(texts[offset] if width == 1 else (texts[offset], texts[offset + 1]))
        if clipped_texts.intersection(range(offset, offset + width)):
            clipped.add(index)
        offset += width
    encoded = model.tokenizer.encode(regrouped, truncate=truncate, clipped=clipped, first=first, keep_last=keep_last)
    ids, mask, types = model.engine.validate(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    return EncoderRequest(ids, mask, types, (LOGITS,))
