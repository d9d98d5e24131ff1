"""Text embeddings inference's (TEI) embedding routes, for clients written against TEI
(huggingface_hub's ``InferenceClient``, LangChain's Hugging Face endpoint embeddings):
``POST /embed``, ``/embed_sparse`` (a SPLADE encoder's nonzero weights of the vocabulary),
``/embed_all``, ``/similarity``, ``/tokenize``, ``/decode``, ``GET /info``, and ``POST /`` with
its SageMaker name ``/invocations``. TEI answers ``/`` by what its one model is;
here the body decides: a ``query`` is reranked, ``inputs`` holding a ``source_sentence`` are
compared, other ``inputs`` are embedded by an embedding model and classified by a classifier.
TEI's classifier routes, ``/rerank`` and ``/predict``, are in ``rerank_api.py``; both modules
pick the model with :func:`chosen_model`.

Errors carry TEI's ``error_type`` beside the message; the status codes are this server's, as on
every route. ``prompt_name`` names one of the checkpoint's sentence-transformers prompts. What
an artifact cannot do as TEI does is refused, naming it: ``normalize: false`` for a model that
normalises inside its graph (sentence-transformers' Normalize module), and, as TEI does,
``normalize: true`` (its default) for a sparse encoder.
"""

from __future__ import annotations

import numpy as np
from aiohttp import web

from .. import __version__
from ..runtime.errors import InputError, ReplyTooLarge
from ..runtime.request import OUTPUTS
from . import codec
from .http_body import JSON_TYPE, FieldError, dumps, json_response, read_object
from .inference import DECODE_THREADS, Inference
from .model import ServedModel
from .openai_api import (
    EMBEDDING,
    dimensions_field,
    infer_inputs,
    is_large,
    l2_normalized,
    normalizes,
    parse_input,
    shorten,
    token_lists,
)

LAST_HIDDEN_STATE = OUTPUTS[0]
# The routes whose errors take TEI's shape, and TEI's name for the kind of each error.
TEI_ROUTES = frozenset({"/", "/invocations", "/embed", "/embed_sparse", "/embed_all", "/similarity", "/tokenize",
                        "/decode", "/info", "/rerank", "/predict"})
ERROR_TYPES = {429: "Overloaded", 503: "Unhealthy"}  # other 4xx: Validation; 5xx: Backend
DIRECTIONS = {"right": False, "Right": False, "left": True, "Left": True}  # -> whether the last tokens are kept


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "Validation" if status < 500 else "Backend")
    return {"error": message, "error_type": kind}


def string_field(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        got = type(value).__name__ if key in body else "nothing"
        raise FieldError(key, f"{key} must be a string, got {got}")
    return value


def flag_field(body: dict, key: str, default: bool | None) -> bool | None:
    value = body.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise FieldError(key, f"{key} must be true or false, got {value!r}")
    return value


def named_model(request: web.Request, body: dict) -> str | None:
    """The model a TEI route's request names: ``model`` in the body, else ``?model=``, else none."""
    return request.query.get("model") if "model" not in body else string_field(body, "model")


def chosen_model(core: Inference, route: str, request: web.Request, body: dict, classifier: bool) -> ServedModel:
    """The text model a TEI route runs (TEI serves one model): the one ``model`` names in the
    body or ``?model=``, else the only served model of the kind the route needs (a classifier or
    an embedding model), else the only model (which the route then refuses, naming its kind)."""
    name = named_model(request, body)
    if name is not None:
        return core.model_for(name, takes_text=True)
    models = core.text_models()
    fitting = [model for model in models if model.engine.is_classifier == classifier]
    if len(fitting) == 1 or len(models) == 1:
        return (fitting or models)[0]
    served = ", ".join(f"'{model.artifact}'" for model in fitting or models)
    if not fitting:
        served_kind = "embedding models" if classifier else "classifiers"
        raise InputError(f"{route} needs {wrong_kind(classifier)}; the served models ({served}) are {served_kind}: "
                         f"{other_routes(classifier)}")
    kind = "classifiers" if classifier else "embedding models"
    raise FieldError("model", f"this server serves several {kind} ({served}): name one with 'model' in the body or "
                              "?model= in the URL")


def wrong_kind(classifier: bool) -> str:
    return "a classifier (cross-encoder)" if classifier else "an embedding model"


def other_routes(classifier: bool) -> str:
    """Where a request for the other kind of model goes."""
    if classifier:
        return "use /v1/embeddings, /embed or the v2 infer routes"
    return "a classifier gives scores, not embeddings; use /rerank, /v1/rerank or /predict"


def _prompted(options: dict, model: ServedModel, inputs: list) -> list:
    """``inputs`` with the prompt ``prompt_name`` names prepended to each text (sentence-transformers'
    ``prompts``, kept in the artifact: ``TextTokenizer.prompts``)."""
    name = options.get("prompt_name")
    if name is None:
        return inputs
    prompts = model.tokenizer.prompts
    if not isinstance(name, str) or name not in prompts:
        known = ", ".join(f"'{known}'" for known in prompts) or "none (its config_sentence_transformers.json has none)"
        raise FieldError("prompt_name", f"prompt_name {name!r} is not one of the prompts of '{model.artifact}': "
                                        f"{known}")
    if not isinstance(inputs[0], str):
        raise FieldError("prompt_name", "prompt_name prefixes texts; token ids are run as given")
    return [prompts[name] + text for text in inputs]


def _check_embed(model: ServedModel, body: dict) -> None:
    """What /embed refuses: ``normalize: false`` where the graph normalises; for a sparse encoder,
    as TEI does, ``normalize: true`` (its default), and ``dimensions``."""
    normalize, dimensions = flag_field(body, "normalize", True), dimensions_field(body)
    if model.engine.sparse and (normalize or dimensions is not None):
        raise FieldError("normalize" if normalize else "dimensions",
                         f"'{model.artifact}' is a sparse encoder (SPLADE): /embed gives its weights of the "
                         "whole vocabulary only with normalize=false and no dimensions; /embed_sparse gives "
                         "the nonzero ones")
    if not normalize and normalizes(model):
        raise FieldError("normalize", f"normalize=false is not available: '{model.artifact}' normalises its "
                                      "embeddings inside the compiled model (its Normalize module)")


def _check_sparse(model: ServedModel, _body: dict) -> None:
    if not model.engine.sparse:
        raise InputError(f"/embed_sparse needs a sparse encoder (SPLADE); '{model.artifact}' gives dense "
                         "embeddings: use /embed")


def _keeps_last(options: dict) -> bool:
    """TEI's ``truncation_direction``: "right" (the default) keeps a text's first tokens, "left"
    its last."""
    direction = options.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise FieldError("truncation_direction", f"truncation_direction must be 'right' or 'left', got {direction!r}")
    return DIRECTIONS[direction]


def _ids_lists(value: object) -> tuple[list[list[int]], bool]:
    """``/decode``'s ``ids``: token ids, or a list of them -> (sequences, whether a batch)."""
    sequences = token_lists(value) if isinstance(value, list) and value else None
    if sequences is None or not all(sequences):
        raise FieldError("ids", "ids must be a list of token ids (integers), or a non-empty list of such lists")
    return sequences, isinstance(value[0], list)


class TeiRoutes:
    """``rerank`` and ``predict``: the classifier routes' handlers, which ``POST /`` hands a
    classifier's body to."""

    def __init__(self, core: Inference, rerank, predict):
        self.core = core
        self.config = core.state.config
        self._rerank, self._predict = rerank, predict

    def add_to(self, app: web.Application) -> None:
        for path in ("/", "/invocations"):
            app.router.add_post(path, self.root)
        app.router.add_post("/embed", self.embed)
        app.router.add_post("/embed_sparse", self.embed_sparse)
        app.router.add_post("/embed_all", self.embed_all)
        app.router.add_post("/similarity", self.similarity)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/decode", self.decode)
        app.router.add_get("/info", self.info)

    async def _body(self, request: web.Request) -> tuple[dict, bytes]:
        return await read_object(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)

    async def root(self, request: web.Request) -> web.Response:
        """A ``query`` is reranked, ``inputs`` holding a ``source_sentence`` compared; other
        ``inputs`` go to /predict, /embed_sparse or /embed, by the named model's kind or, where
        none is named, the kind every served model is. The handler it hands to finds the body
        parsed already."""
        body, _ = await self._body(request)
        if "query" in body:
            return await self._rerank(request)
        if isinstance(body.get("inputs"), dict):
            return await self.similarity(request)
        name = named_model(request, body)
        models = [self.core.model_for(name, takes_text=True)] if name is not None else self.core.text_models()
        kinds = {model.engine.is_classifier for model in models}
        if len(kinds) != 1:
            raise FieldError("model", f"{request.path} serves one model's kind, and this server serves embedding "
                                      "models and classifiers: name one with 'model' in the body or ?model= in "
                                      "the URL, or use /embed, /predict or /rerank")
        if kinds.pop():
            return await self._predict(request)
        sparse = {model.engine.sparse for model in models}
        return await (self.embed_sparse(request) if sparse == {True} else self.embed(request))

    async def _embedded(self, request: web.Request, route: str, output: str,
                        check=lambda _model, _body: None) -> tuple[dict, list, ServedModel]:
        """The body, the outputs of its ``inputs`` (one array per batch-sized request) and the
        model; ``check(model, body)`` refuses what the route cannot answer, before any work."""
        body, raw = await self._body(request)
        if "inputs" not in body:
            raise FieldError("inputs", "the body needs 'inputs': the text(s) or token ids to embed")
        answers, model = await self._run(request, route, body, raw, parse_input(body["inputs"], "inputs"), body, output,
                                         check)
        return body, answers, model

    async def _run(self, request: web.Request, route: str, body: dict, raw: bytes, inputs: list, options: dict,
                   output: str, check=lambda _model, _body: None) -> tuple[list, ServedModel]:
        """``inputs`` through the embedding model the route takes, once ``check`` passes it;
        ``options`` holds truncate, its direction and the prompt's name."""
        model = chosen_model(self.core, route, request, body, classifier=False)
        if model.engine.is_classifier:
            raise InputError(f"{route} needs an embedding model; '{model.artifact}' is a classifier: "
                             f"{other_routes(False)}")
        check(model, body)
        keep_last = _keeps_last(options)
        inputs = _prompted(options, model, inputs)
        takes_text = isinstance(inputs[0], str)
        model = self.core.model_for(model.artifact, takes_text)
        truncate = flag_field(options, "truncate", None)
        large = is_large(raw, takes_text)
        return await infer_inputs(self.core, model, inputs, truncate, large, (output,), keep_last), model

    async def similarity(self, request: web.Request) -> web.Response:
        """{inputs: {source_sentence, sentences}, parameters: {truncate}} -> the cosine similarity
        of each sentence's embedding to the source sentence's."""
        body, raw = await self._body(request)
        pair = body.get("inputs")
        sentences = pair.get("sentences") if isinstance(pair, dict) else None
        if not (isinstance(pair, dict) and isinstance(pair.get("source_sentence"), str) and isinstance(sentences, list)
                and sentences and all(isinstance(sentence, str) for sentence in sentences)):
            raise FieldError("inputs", "inputs must be {\"source_sentence\": text, \"sentences\": [text, ...]}, "
                                       "with at least one sentence")
        options = body.get("parameters") or {}
        if not isinstance(options, dict):
            raise FieldError("parameters", f"parameters must be an object, got {type(options).__name__}")
        answers, _ = await self._run(request, "/similarity", body, raw, [pair["source_sentence"], *sentences],
                                     options, EMBEDDING)
        unit = l2_normalized(np.concatenate([answer.outputs[EMBEDDING] for answer in answers])).astype(np.float64)
        return json_response((unit[1:] @ unit[0]).tolist())

    async def embed(self, request: web.Request) -> web.Response:
        """{inputs, normalize, truncate, dimensions} -> one embedding per input."""
        body, answers, model = await self._embedded(request, "/embed", EMBEDDING, _check_embed)
        normalize, dimensions = flag_field(body, "normalize", True), dimensions_field(body)
        embeddings = shorten(np.concatenate([answer.outputs[EMBEDDING] for answer in answers]), dimensions,
                             normalizes(model))
        if normalize and not normalizes(model):
            embeddings = l2_normalized(embeddings)
        return await self._answer(embeddings.nbytes, embeddings.tolist)

    async def embed_sparse(self, request: web.Request) -> web.Response:
        """{inputs, truncate} -> per input, the sparse encoder's nonzero weights as
        ``[{index, value}, ...]`` in vocabulary order."""
        _, answers, _ = await self._embedded(request, "/embed_sparse", EMBEDDING, _check_sparse)
        weights = np.concatenate([answer.outputs[EMBEDDING] for answer in answers])

        def nonzero() -> list:
            return [[{"index": int(i), "value": float(row[i])} for i in np.flatnonzero(row)] for row in weights]

        return await self._answer(weights.nbytes, nonzero)

    async def embed_all(self, request: web.Request) -> web.Response:
        """{inputs, truncate} -> each input's token embeddings (the last hidden state, its own
        length). Each batch-sized request passed the reply limit; the whole answer must too."""
        _, answers, _ = await self._embedded(request, "/embed_all", LAST_HIDDEN_STATE)
        hidden = [rows[:length] for answer in answers
                  for rows, length in zip(answer.outputs[LAST_HIDDEN_STATE], answer.request.attention_mask.sum(axis=1),
                                          strict=True)]
        size, limit = 4 * sum(rows.size for rows in hidden), self.config.max_response_bytes
        if size > limit:
            raise ReplyTooLarge(f"the token embeddings would be {size} bytes as float32, over this server's limit of "
                                f"{limit} (--max-response-bytes); send fewer inputs")
        return await self._answer(size, lambda: [rows.tolist() for rows in hidden])

    async def _answer(self, size: int, value) -> web.Response:
        """JSON of ``value()``, made off the event loop when ``size`` bytes of floats make it slow."""
        payload = await self.core.off_loop(size > codec.INLINE_MESSAGE_BYTES, lambda: dumps(value()))
        return web.Response(body=payload, content_type=JSON_TYPE)

    async def tokenize(self, request: web.Request) -> web.Response:
        """{inputs, add_special_tokens} -> each text's tokens (``TextTokenizer.tokens``)."""
        body, raw = await self._body(request)
        model = chosen_model(self.core, "/tokenize", request, body, classifier=False)
        texts = body.get("inputs")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
            raise FieldError("inputs", "inputs must be a text or a non-empty list of texts")
        for index, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone surrogate, which JSON allows
                raise FieldError("inputs", f"inputs[{index}] is not UTF-8 text: {err.reason} at {err.start}") from None
        texts = _prompted(body, model, texts)
        special = flag_field(body, "add_special_tokens", True)
        tokens = await self.core.off_loop(is_large(raw, True), lambda: [model.tokenizer.tokens(text, special)
                                                                         for text in texts])
        return json_response(tokens)

    async def decode(self, request: web.Request) -> web.Response:
        """{ids, skip_special_tokens} -> one text per list of ids."""
        body, raw = await self._body(request)
        model = chosen_model(self.core, "/decode", request, body, classifier=False)
        sequences, batch = _ids_lists(body.get("ids"))
        skip = flag_field(body, "skip_special_tokens", True)
        def decoded() -> list[str]:
            return [model.tokenizer.decode(ids, skip, f"ids[{index}]" if batch else "ids")
                    for index, ids in enumerate(sequences)]

        return json_response(await self.core.off_loop(is_large(raw, False), decoded))

    async def info(self, request: web.Request) -> web.Response:
        """TEI's ``/info``, for the model ``?model=`` names or the only one."""
        model = chosen_model(self.core, "/info", request, {}, classifier=False)
        engine, manifest, config = model.engine, model.engine.artifact.manifest, self.config
        if engine.is_classifier:
            kind = "reranker" if len(engine.labels) == 1 else "classifier"
            model_type = {kind: {"id2label": dict(enumerate(engine.labels)),
                                 "label2id": {label: index for index, label in enumerate(engine.labels)}}}
        else:
            pooling = "splade" if engine.sparse else ",".join((manifest.pooling or {}).get("modes") or ["mean"])
            model_type = {"embedding": {"pooling": pooling}}
        return json_response({
            "model_id": model.artifact, "model_sha": None, "served_model_name": model.artifact,
            "model_dtype": "bfloat16" if manifest.precision == "bf16" else "float32", "model_type": model_type,
            "max_concurrent_requests": config.max_concurrent_rpcs, "max_input_length": model.max_input_tokens,
            "max_batch_tokens": config.max_batch_tokens, "max_batch_requests": config.max_batch_size,
            "max_client_batch_size": config.max_queue_rows, "auto_truncate": config.truncate,
            "tokenization_workers": DECODE_THREADS, "version": __version__, "sha": None, "docker_label": None})
