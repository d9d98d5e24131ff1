"""A served model: the engine it runs on, whether it takes text, its v2 metadata, Triton config
(outputs as the engine has them: an embedding model's or a classifier's) and statistics. Each
artifact's engine serves two models, ``NAME`` (token ids) and ``NAME-text`` (text, tokenized by
the server), so that each model's config lists only inputs a client must send, as Triton's
clients (perf_analyzer among them) expect."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from ..model.tokenizer import TextTokenizer
from ..runtime.batcher import BatchRun, DynamicBatcher
from ..runtime.engine import Engine
from ._proto import open_inference_pb2 as pb
from .codec import ID_INPUTS, PAIR_WIDTH, TEXT_INPUT

PLATFORM = "dietserve_tvm"
VERSION = "1"
TEXT_MODEL_SUFFIX = "-text"


def served_names(artifact_names: list[str]) -> tuple[str, ...]:
    """Every model name the artifacts are served under (``NAME``, ``NAME-text`` each); a name two
    artifacts would share is refused, naming both."""
    owners: dict[str, str] = {}
    for artifact in artifact_names:
        for name in (artifact, artifact + TEXT_MODEL_SUFFIX):
            if name in owners:
                raise ValueError(f"two artifacts would both serve a model named '{name}' ('{owners[name]}' and "
                                 f"'{artifact}'); rename one (its manifest's model_name, or --model-name with a "
                                 "single artifact)")
            owners[name] = artifact
    return tuple(owners)


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def proto(self) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=self.count, ns=self.ns)


@dataclass
class ModelStatistics:
    """Triton's per-model statistics; updated on the event loop thread only."""

    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    by_batch_size: dict = field(default_factory=lambda: defaultdict(_Duration))
    # A batch's answers are handled one after another, so a short memory recognises its repeats.
    _recent_runs: deque = field(default_factory=lambda: deque(maxlen=64))

    def record_request(self, ok: bool, rows: int, seconds: float, queue_seconds: float | None,
                       compute_seconds: float | None) -> None:
        """As Triton counts: per request, each request charged its whole batch's compute."""
        (self.success if ok else self.fail).add(seconds)
        if ok:
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)
        if queue_seconds is not None:
            self.queue.add(queue_seconds)
        if compute_seconds is not None:
            self.compute_infer.add(compute_seconds)

    def record_execution(self, run: BatchRun) -> None:
        """Counts a model execution once however many of this model's requests it carried."""
        if any(seen is run for seen in self._recent_runs):
            return
        self._recent_runs.append(run)
        self.execution_count += 1
        self.by_batch_size[run.rows].add(run.compute_seconds)


class ServedModel:
    """``tokenizer``: the text model's; None for the ids model. ``artifact``: the name of the
    ids model, which both models of an artifact share as their family name; ``batcher``: the
    artifact's queue."""

    def __init__(self, name: str, engine: Engine, tokenizer: TextTokenizer | None = None, *,
                 artifact: str | None = None, batcher: DynamicBatcher | None = None,
                 max_input_tokens: int | None = None):
        self.name = name
        # The longest input the OpenAI and TEI routes take, texts or token ids, for both of an
        # artifact's models: its text bound (sentence-transformers' ``max_seq_length`` where the
        # checkpoint sets one), else the artifact's. (v2's ids model checks the artifact's alone.)
        self.max_input_tokens = max_input_tokens or (tokenizer.max_length if tokenizer else engine.max_seq_len)
        self.artifact = artifact or name
        self.version = VERSION
        self.engine = engine
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.statistics = ModelStatistics()
        manifest = engine.artifact.manifest
        self.target_kind = manifest.target.get("kind", "llvm")

    @property
    def takes_text(self) -> bool:
        return self.tokenizer is not None

    def metadata(self) -> pb.ModelMetadataResponse:
        tensor = pb.ModelMetadataResponse.TensorMetadata
        if self.takes_text:
            # A classifier's text model is listed with pairs, what a cross-encoder is for; it
            # also takes single texts, [batch].
            shape = [-1, PAIR_WIDTH] if self.engine.is_classifier else [-1]
            inputs = [tensor(name=TEXT_INPUT, datatype="BYTES", shape=shape)]
        else:
            inputs = [tensor(name=name, datatype="INT64", shape=[-1, -1]) for name in ID_INPUTS]
        return pb.ModelMetadataResponse(
            name=self.name,
            versions=[self.version],
            platform=PLATFORM,
            inputs=inputs,
            outputs=[tensor(name=name, datatype="FP32", shape=list(shape))
                     for name, shape in self.engine.output_shapes.items()],
        )

    def config(self, batching: bool, max_queue_delay_ms: float) -> pb.ModelConfig:
        """Triton's model configuration; dims exclude the batch dimension (max_batch_size > 0)."""
        buckets = self.batcher.edges if self.batcher is not None else []
        if self.takes_text and self.engine.is_classifier:
            inputs = [pb.ModelInput(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[PAIR_WIDTH])]
        elif self.takes_text:
            inputs = [pb.ModelInput(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[1],
                                    reshape=pb.ModelTensorReshape(shape=[]))]
        else:
            inputs = [pb.ModelInput(name=name, data_type=pb.TYPE_INT64, dims=[-1], optional=name != "input_ids")
                      for name in ID_INPUTS]
        manifest = self.engine.artifact.manifest
        config = pb.ModelConfig(
            name=self.name,
            platform=PLATFORM,
            backend="dietserve",
            max_batch_size=self.engine.max_batch,
            input=inputs,
            output=[pb.ModelOutput(name=name, data_type=pb.TYPE_FP32, dims=list(shape[1:]))
                    for name, shape in self.engine.output_shapes.items()],
            instance_group=[pb.ModelInstanceGroup(
                name=self.name, count=1,
                kind=pb.ModelInstanceGroup.KIND_GPU if self.target_kind == "cuda" else pb.ModelInstanceGroup.KIND_CPU,
            )],
            default_model_filename="model.so",
        )
        if batching:
            config.dynamic_batching.max_queue_delay_microseconds = int(max_queue_delay_ms * 1000)
        parameters = {
            "max_sequence_length": str(self.engine.max_seq_len),
            "sequence_length_buckets": ",".join(map(str, buckets)),
            "target": manifest.target.get("kind", ""),
            "dynamic_operators": ",".join(self.engine.dispatch.operators),
            "cache_key": manifest.cache_key,
            "kernel_plans": manifest.kernel_plans or "",
            "layout": manifest.layout,
            "artifact_version": self.version,
        }
        for key, value in parameters.items():
            config.parameters[key].string_value = value
        return config

    def statistics_proto(self) -> pb.ModelStatistics:
        s = self.statistics
        return pb.ModelStatistics(
            name=self.name,
            version=self.version,
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            inference_stats=pb.InferStatistics(
                success=s.success.proto(), fail=s.fail.proto(), queue=s.queue.proto(),
                # Tensor conversion in and out is part of compute_infer; the counts must match,
                # as perf_analyzer checks.
                compute_input=pb.StatisticDuration(count=s.compute_infer.count),
                compute_infer=s.compute_infer.proto(),
                compute_output=pb.StatisticDuration(count=s.compute_infer.count),
            ),
            batch_stats=[pb.InferBatchStatistics(batch_size=size, compute_infer=d.proto())
                         for size, d in sorted(s.by_batch_size.items())],
        )
