"""Text embeddings inference's (TEI) embedding calls, with no wire: the checks and the work behind
TEI's HTTP routes (``tei_api.py``) and its gRPC services (``tei_grpc.py``), so that both answer
and refuse alike. A call takes TEI's JSON body (the gRPC service builds the same dict from its
message), the model the request names (None: the only one of the kind) and the request's size
in bytes (large requests are tokenized off the event loop); it returns arrays and plain values
for the wire to encode.

``prompt_name`` names one of the checkpoint's sentence-transformers prompts. What an artifact
cannot do as TEI does is refused, naming it: ``normalize: false`` for a model that normalises
inside its graph (sentence-transformers' Normalize module), and, as TEI does, ``normalize:
true`` (its default) for a sparse encoder.
"""

from __future__ import annotations

import numpy as np

from .. import __version__
from ..runtime.errors import FieldError, InputError, ReplyTooLarge
from ..runtime.request import OUTPUTS
from .embedding_inputs import (
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
from .inference import DECODE_THREADS, Answer, Inference
from .model import ServedModel

LAST_HIDDEN_STATE = OUTPUTS[0]
DIRECTIONS = {"right": False, "Right": False, "left": True, "Left": True}  # -> whether the last tokens are kept


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


def chosen_model(core: Inference, route: str, name: str | None, classifier: bool) -> ServedModel:
    """The text model a TEI call runs (TEI serves one model): the one ``name`` names, else the
    only served model of the kind the route needs (a classifier or an embedding model), else
    the only model (which the route then refuses, naming its kind)."""
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
                              "?model= in the URL (gRPC: 'model' metadata)")


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


def keeps_last(options: dict) -> bool:
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


def _texts_field(body: dict) -> list[str]:
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
    return texts


def nonzero_weights(weights: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """[rows, vocab] sparse-encoder weights -> per row, (the nonzero entries' vocabulary ids, their
    weights), in vocabulary order."""
    return [(indices, row[indices]) for row in weights for indices in (np.flatnonzero(row),)]


class TeiCalls:
    """TEI's embedding calls over ``core``; see the module's docstring for the arguments."""

    def __init__(self, core: Inference):
        self.core = core
        self.config = core.state.config

    async def _embedded(self, route: str, body: dict, name: str | None, size: int, output: str,
                        check=lambda _model, _body: None) -> tuple[list[Answer], ServedModel]:
        """The answers to ``body``'s ``inputs`` (one per batch-sized request) and the model;
        ``check(model, body)`` refuses what the route cannot answer, before any work."""
        if "inputs" not in body:
            raise FieldError("inputs", "the body needs 'inputs': the text(s) or token ids to embed")
        return await self.run(route, name, size, parse_input(body["inputs"], "inputs"), body, output, check)

    async def run(self, route: str, name: str | None, size: int, inputs: list, options: dict, output: str,
                  check=lambda _model, _options: None) -> tuple[list[Answer], ServedModel]:
        """``inputs`` through the embedding model the call takes, once ``check`` passes it;
        ``options`` holds truncate, its direction and the prompt's name."""
        model = chosen_model(self.core, route, name, classifier=False)
        if model.engine.is_classifier:
            raise InputError(f"{route} needs an embedding model; '{model.artifact}' is a classifier: "
                             f"{other_routes(False)}")
        check(model, options)
        keep_last = keeps_last(options)
        inputs = _prompted(options, model, inputs)
        takes_text = isinstance(inputs[0], str)
        model = self.core.model_for(model.artifact, takes_text)
        truncate = flag_field(options, "truncate", None)
        large = is_large(size, takes_text)
        return await infer_inputs(self.core, model, inputs, truncate, large, (output,), keep_last), model

    async def embeddings(self, body: dict, name: str | None, size: int) -> tuple[np.ndarray, list[Answer]]:
        """/embed: {inputs, normalize, truncate, dimensions, ...} -> one embedding per input."""
        answers, model = await self._embedded("/embed", body, name, size, EMBEDDING, _check_embed)
        normalize, dimensions = flag_field(body, "normalize", True), dimensions_field(body)
        embeddings = shorten(np.concatenate([answer.outputs[EMBEDDING] for answer in answers]), dimensions,
                             normalizes(model))
        if normalize and not normalizes(model):
            embeddings = l2_normalized(embeddings)
        return embeddings, answers

    async def sparse_weights(self, body: dict, name: str | None, size: int) -> tuple[np.ndarray, list[Answer]]:
        """/embed_sparse: {inputs, truncate, ...} -> per input, the sparse encoder's weights of the
        whole vocabulary (the wire keeps the nonzero ones)."""
        answers, _ = await self._embedded("/embed_sparse", body, name, size, EMBEDDING, _check_sparse)
        return np.concatenate([answer.outputs[EMBEDDING] for answer in answers]), answers

    async def token_embeddings(self, body: dict, name: str | None,
                               size: int) -> tuple[list[np.ndarray], list[Answer]]:
        """/embed_all: {inputs, truncate, ...} -> each input's token embeddings (the last hidden
        state, its own length). Each batch-sized request passed the reply limit; the whole
        answer must too."""
        answers, _ = await self._embedded("/embed_all", body, name, size, LAST_HIDDEN_STATE)
        hidden = [rows[:length] for answer in answers
                  for rows, length in zip(answer.outputs[LAST_HIDDEN_STATE], answer.request.attention_mask.sum(axis=1),
                                          strict=True)]
        size, limit = 4 * sum(rows.size for rows in hidden), self.config.max_response_bytes
        if size > limit:
            raise ReplyTooLarge(f"the token embeddings would be {size} bytes as float32, over this server's limit of "
                                f"{limit} (--max-response-bytes); send fewer inputs")
        return hidden, answers

    async def similarity(self, body: dict, name: str | None, size: int) -> list[float]:
        """/similarity: {inputs: {source_sentence, sentences}, parameters: {truncate}} -> the cosine
        similarity of each sentence's embedding to the source sentence's."""
        pair = body.get("inputs")
        sentences = pair.get("sentences") if isinstance(pair, dict) else None
        if not (isinstance(pair, dict) and isinstance(pair.get("source_sentence"), str) and isinstance(sentences, list)
                and sentences and all(isinstance(sentence, str) for sentence in sentences)):
            raise FieldError("inputs", "inputs must be {\"source_sentence\": text, \"sentences\": [text, ...]}, "
                                       "with at least one sentence")
        options = body.get("parameters") or {}
        if not isinstance(options, dict):
            raise FieldError("parameters", f"parameters must be an object, got {type(options).__name__}")
        answers, _ = await self.run("/similarity", name, size, [pair["source_sentence"], *sentences], options,
                                    EMBEDDING)
        unit = l2_normalized(np.concatenate([answer.outputs[EMBEDDING] for answer in answers])).astype(np.float64)
        return (unit[1:] @ unit[0]).tolist()

    async def tokens(self, body: dict, name: str | None, size: int) -> list[list[dict]]:
        """/tokenize: {inputs, add_special_tokens, prompt_name} -> each text's tokens
        (``TextTokenizer.tokens``)."""
        model = chosen_model(self.core, "/tokenize", name, classifier=False)
        texts = _prompted(body, model, _texts_field(body))
        special = flag_field(body, "add_special_tokens", True)
        return await self.core.off_loop(is_large(size, True), lambda: [model.tokenizer.tokens(text, special)
                                                                        for text in texts])

    async def decoded(self, body: dict, name: str | None, size: int) -> list[str]:
        """/decode: {ids, skip_special_tokens} -> one text per list of ids."""
        model = chosen_model(self.core, "/decode", name, classifier=False)
        sequences, batch = _ids_lists(body.get("ids"))
        skip = flag_field(body, "skip_special_tokens", True)

        def decoded() -> list[str]:
            return [model.tokenizer.decode(ids, skip, f"ids[{index}]" if batch else "ids")
                    for index, ids in enumerate(sequences)]

        return await self.core.off_loop(is_large(size, False), decoded)

    def info(self, name: str | None) -> dict:
        """TEI's /info, for the model ``name`` names or the only one."""
        model = chosen_model(self.core, "/info", name, classifier=False)
        engine, manifest, config = model.engine, model.engine.artifact.manifest, self.config
        if engine.is_classifier:
            kind = "reranker" if len(engine.labels) == 1 else "classifier"
            model_type = {kind: {"id2label": dict(enumerate(engine.labels)),
                                 "label2id": {label: index for index, label in enumerate(engine.labels)}}}
        else:
            pooling = "splade" if engine.sparse else ",".join((manifest.pooling or {}).get("modes") or ["mean"])
            model_type = {"embedding": {"pooling": pooling}}
        return {
            "model_id": model.artifact, "model_sha": None, "served_model_name": model.artifact,
            "model_dtype": "bfloat16" if manifest.precision == "bf16" else "float32", "model_type": model_type,
            "max_concurrent_requests": config.max_concurrent_rpcs, "max_input_length": model.max_input_tokens,
            "max_batch_tokens": config.max_batch_tokens, "max_batch_requests": config.max_batch_size,
            "max_client_batch_size": config.max_queue_rows, "auto_truncate": config.truncate,
            "tokenization_workers": DECODE_THREADS, "version": __version__, "sha": None, "docker_label": None}
