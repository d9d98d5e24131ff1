"""The inference path every wire shares, with no wire in it: which models are served and in what
state, the concurrency cap, and one call that runs a decoded request (the reply limit, the
batcher, statistics and metrics).

The gRPC servicer (``servicer.py``) and the HTTP handlers (``http_v2.py``, ``openai_api.py``)
decode their own formats into an :class:`EncoderRequest`, call :meth:`Inference.infer` and
encode the :class:`Answer`; errors are ``runtime.errors`` types, which ``status.py`` maps to each
wire's status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..runtime.errors import NotReady, ReplyTooLarge, UnknownModel
from ..runtime.request import EncoderRequest
from .auth import ApiKeys, load_api_keys
from .config import ServerConfig
from .metrics import ServerMetrics
from .model import TEXT_MODEL_SUFFIX, VERSION, ServedModel, served_names

DECODE_THREADS = 2  # tokenizing and large tensors; bounded so decoding cannot starve the kernels
T = TypeVar("T")
W = TypeVar("W")  # what a wire decoded beside the request, handed back to encode the answer


class ConcurrencyCap:
    """``--max-concurrent-rpcs``: calls handled at once over both wires together (probes aside)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0

    def refusal(self) -> str | None:
        """Why a new call is refused now, or None if it may run."""
        if self.active < self.limit:
            return None
        return f"server busy: {self.active} calls in progress (limit {self.limit}); retry later"


@dataclass
class ServingState:
    """What the wires serve; ``models`` is set once every artifact is loaded. Each artifact is
    served as two models, ``NAME`` and ``NAME-text`` (``model.py``), with its own batcher."""

    config: ServerConfig
    metrics: ServerMetrics
    artifact_names: tuple[str, ...]  # known from the start, so requests during loading get UNAVAILABLE
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: bool = False
    model_names: tuple[str, ...] = field(init=False)
    cap: ConcurrencyCap = field(init=False)
    api_keys: ApiKeys | None = field(init=False)  # None: no keys needed
    decode_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="dietserve-decode"))

    def __post_init__(self) -> None:
        self.model_names = served_names(list(self.artifact_names))
        self.cap = ConcurrencyCap(self.config.max_concurrent_rpcs)
        self.api_keys = load_api_keys(self.config.api_key_file)  # read once, for both wires


@dataclass(frozen=True)
class Answer:
    model: ServedModel
    request: EncoderRequest
    outputs: dict[str, np.ndarray]  # in the order the request asked for them
    queue_seconds: float = 0.0  # waiting in the batcher
    compute_seconds: float = 0.0  # the batch's run, which it may share with other requests


@dataclass(frozen=True)
class ModelState:
    """One RepositoryIndex entry."""

    name: str
    version: str
    state: str  # READY, LOADING or UNAVAILABLE


class Inference:
    def __init__(self, state: ServingState):
        self.state = state

    # ------------------------------------------------------------------ models

    def check_name(self, name: str, version: str) -> None:
        """Refuses a model or version this server does not serve, loaded or not."""
        if name not in self.state.model_names:
            served = ", ".join(f"'{n}'" for n in self.state.model_names)
            raise UnknownModel(f"unknown model '{name}'; this server serves {served}")
        model = self.state.models.get(name)
        served_version = model.version if model is not None else VERSION
        if version not in ("", served_version):
            raise UnknownModel(f"model '{name}' has no version '{version}' (serving version {served_version})")

    def loaded(self, name: str, version: str = "") -> ServedModel:
        self.check_name(name, version)
        model = self.state.models.get(name)
        if model is None:
            raise NotReady(f"model '{name}' is still loading")
        return model

    def model_for(self, name: str, takes_text: bool) -> ServedModel:
        """The model of ``name``'s artifact that takes text or token ids (the OpenAI and rerank
        APIs accept either model's name and choose by the input), or of the artifact built from
        the Hugging Face Hub id ``name`` (OpenAI clients name a model so: ``BAAI/bge-small-en-v1.5``)."""
        name = self._built_from(name) or name
        self.check_name(name, "")
        artifact = name.removesuffix(TEXT_MODEL_SUFFIX) if name not in self.state.artifact_names else name
        return self.loaded(artifact + TEXT_MODEL_SUFFIX if takes_text else artifact)

    def _built_from(self, hub_id: str) -> str | None:
        """The loaded artifact whose build record names the Hub id ``hub_id``, if any."""
        if "/" not in hub_id:
            return None
        for name in self.state.artifact_names:
            model = self.state.models.get(name)
            if model is not None and (model.engine.artifact.manifest.build or {}).get("model") == hub_id:
                return name
        return None

    def text_models(self) -> list[ServedModel]:
        """Each artifact's text model, in the order the artifacts were given."""
        return [self.loaded(artifact + TEXT_MODEL_SUFFIX) for artifact in self.state.artifact_names]

    def repository_index(self, ready_only: bool) -> list[ModelState]:
        if self.state.ready:
            state = "READY"
        else:
            state = "LOADING" if not self.state.models else "UNAVAILABLE"
        if ready_only and state != "READY":
            return []
        versions = {name: model.version for name, model in self.state.models.items()}
        return [ModelState(name, versions.get(name, VERSION), state) for name in self.state.model_names]

    def truncate(self, requested: bool | None) -> bool:
        """A request's truncation choice, or the server's default (``--truncate``)."""
        return self.state.config.truncate if requested is None else requested

    # ------------------------------------------------------------------ inference

    async def off_loop(self, large: bool, work: Callable[..., T], *args) -> T:
        """``work(*args)`` on a decoding thread if ``large``, else here: a thread hop costs more
        than small work, and large work must not hold the event loop (health must answer)."""
        if not large:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.state.decode_pool, work, *args)

    async def infer(self, receive: Awaitable[tuple[ServedModel, EncoderRequest, W]]) -> tuple[Answer, W]:
        """Runs the request ``receive`` decodes; returns the answer and what ``receive`` gave
        beside the request. The request is timed from here: decoding failures count in the
        duration metric and, once the model is known, in its statistics."""
        state, metrics = self.state, self.state.metrics
        started = time.perf_counter()
        metrics.inflight.inc()
        ok, rows, queue_seconds, compute_seconds, model = False, 0, None, None, None
        try:
            model, request, wire = await receive
            rows = request.rows
            reply = request.reply_bytes(model.engine.output_shapes)
            if reply > state.config.max_response_bytes:
                raise ReplyTooLarge(
                    f"the answer would be {reply} bytes, over this server's limit of {state.config.max_response_bytes} "
                    "(--max-response-bytes); request fewer rows, or not last_hidden_state")
            result = await model.batcher.submit(request)
            queue_seconds, compute_seconds = result.queue_seconds, result.run.compute_seconds
            model.statistics.record_execution(result.run)
            ok = True
            outputs = {name: getattr(result.output, name) for name in request.outputs}
            return Answer(model, request, outputs, queue_seconds, compute_seconds), wire
        finally:
            metrics.inflight.dec()
            elapsed = time.perf_counter() - started
            artifact = model.artifact if model is not None else ""  # "": refused before naming a served model
            metrics.request_duration.labels(artifact).observe(elapsed)
            if queue_seconds is not None:
                metrics.queue_duration.labels(artifact).observe(queue_seconds)
            if model is not None:
                model.statistics.record_request(ok, rows, elapsed, queue_seconds, compute_seconds)
