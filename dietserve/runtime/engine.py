"""The inference engine: validated inputs in, one VM call, encoder outputs out.

Knows nothing about transports. Calls are serialised: a VM instance is not re-entrant.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import numpy as np
import tvm

from ..host.cpu import configure_cpu_threads, target_cores
from .artifact import LoadedArtifact
from .errors import InputError
from .manifest import CLASSIFICATION_TASK, LAYOUT_PACKED
from .memory import PoolBound
from .variant_by_shape import KernelDispatch

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderOutput:
    last_hidden_state: np.ndarray  # float32 [batch, seq, hidden]
    sentence_embedding: np.ndarray | None  # float32 [batch, embedding size]; None from a classifier
    logits: np.ndarray | None = None  # float32 [batch, num_labels]: a classification artifact's

    def named(self) -> dict[str, np.ndarray]:
        """The outputs this model produced, by name (an embedding model's or a classifier's)."""
        return {name: value for name in ("last_hidden_state", "sentence_embedding", "logits")
                if (value := getattr(self, name)) is not None}

    def rows(self, start: int, stop: int, seq_len: int) -> EncoderOutput:
        """Rows ``start:stop`` of a batch's outputs, the hidden states cut to ``seq_len``."""
        def cut(array: np.ndarray | None) -> np.ndarray | None:
            return None if array is None else array[start:stop]

        return EncoderOutput(self.last_hidden_state[start:stop, :seq_len], cut(self.sentence_embedding),
                             cut(self.logits))


TVM_ALIGNMENT = 64  # bytes: TVM takes host memory it did not allocate only at this alignment


def _host_tensor(array: np.ndarray) -> tvm.runtime.Tensor:
    """``array`` as a TVM tensor on the host: a copy into 64-byte-aligned numpy memory, shared
    with TVM through DLPack. (``tvm.runtime.tensor`` makes the same copy through TVM's allocator,
    several times slower: with four inputs a call, a visible share of a short run's fixed cost.)"""
    storage = np.empty(array.nbytes + TVM_ALIGNMENT, np.uint8)
    start = -storage.ctypes.data % TVM_ALIGNMENT
    aligned = storage[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    aligned[...] = array
    return tvm.runtime.from_dlpack(aligned)


def _host_numpy(tensor: tvm.runtime.Tensor) -> np.ndarray:
    """A numpy copy of host ``tensor`` (the VM's buffer goes back to its pool), through DLPack,
    which for a short sequence's output is several times cheaper than ``Tensor.numpy``."""
    return np.from_dlpack(tensor).copy()


def _as_ids(name: str, value: object, shape: tuple[int, int] | None) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != 2:
        raise InputError(f"{name} must be 2-D [batch, seq], got shape {list(array.shape)}")
    if shape is not None and array.shape != shape:
        raise InputError(f"{name} has shape {list(array.shape)} but input_ids has {list(shape)}")
    return np.ascontiguousarray(array, dtype=np.int64)


def packed_inputs(ids: np.ndarray, mask: np.ndarray, types: np.ndarray, positions: np.ndarray) -> tuple:
    """A packed artifact's inputs (``Manifest.inputs``) for a ``[batch, seq]`` request: the
    attended tokens of each row one after another, with their own positions, so a mask of any
    pattern (right or left padding) runs as the padded model does, on the attended tokens
    alone. A request with none at all runs one padding token, whose outputs nothing reads."""
    batch, seq = ids.shape
    keep = mask.astype(bool)
    rows, columns = np.nonzero(keep)  # row-major: each row's tokens in order
    tokens = len(rows)
    starts = np.zeros(batch + 1, np.int64)
    np.cumsum(keep.sum(axis=1), out=starts[1:])
    unpack = np.full((batch, seq), max(tokens, 1), np.int64)  # past the tokens: the zero row
    unpack[rows, columns] = np.arange(tokens)
    if tokens == 0:  # one more sequence, of one padding token: the kernels see no empty input
        rows, columns = np.zeros(1, np.intp), np.zeros(1, np.intp)
        starts = np.append(starts, 1)
    return (ids[rows, columns], types[rows, columns], positions[columns], starts, unpack, mask, positions)


class Engine:
    """``threads``: CPU threads for an llvm artifact's kernels (default: every CPU this
    process may use)."""

    def __init__(self, artifact: LoadedArtifact, threads: int | None = None):
        self.artifact = artifact
        on_cpu = artifact.manifest.target.get("kind") == "llvm"
        self.threads = configure_cpu_threads(threads) if on_cpu else None
        cores = target_cores(artifact.manifest.target) or 0
        if cores and self.threads > cores:
            # (its packed kernels' tasks are taken by that many workers: kernels/cpu_packed/claimed_tasks.py)
            LOG.warning("the artifact was compiled for %d cores (--num-cores) and runs on %d threads: its dense "
                        "kernels use %d of them; compile it with --num-cores %d", cores, self.threads, cores,
                        self.threads)
        # TVM's CPU thread pool is per calling thread: a thread that runs the VM without
        # configuring its own pool gets TVM's default (half the cores on x86). Each calling
        # thread configures once, on its first call.
        self._configured = threading.local()
        self._configured.done = True
        manifest = artifact.manifest
        self.max_batch = manifest.max_batch
        self.max_seq_len = manifest.max_seq_len
        self.vocab_size = int(manifest.model_config["vocab_size"])
        self.type_vocab_size = int(manifest.model_config["type_vocab_size"])
        self.hidden_size = int(manifest.model_config["hidden_size"])
        self._describe_outputs(manifest)
        self.dispatch = KernelDispatch(manifest.dispatch)
        self._forward = artifact.vm["forward"]
        self.packed = manifest.layout == LAYOUT_PACKED
        self._positions = np.arange(self.max_seq_len, dtype=np.int64)
        # Inputs in and outputs out: on the host through DLPack, else copies to and from the device.
        if on_cpu:
            self._to_device, self._to_numpy = _host_tensor, _host_numpy
        else:
            self._to_device = lambda array: tvm.runtime.tensor(array, artifact.device)
            self._to_numpy = tvm.runtime.Tensor.numpy
        self._lock = threading.Lock()
        self.pool_bound: PoolBound | None = None

    def _describe_outputs(self, manifest) -> None:
        """What the artifact returns: ``task`` (embedding or classification), ``output_shapes``
        (name -> shape, -1 where it follows the request), the sentence embedding's width (None
        for a classifier), whether it is ``sparse`` (a SPLADE encoder's weights of the
        vocabulary) and the classifier's ``labels`` (logit i is ``labels[i]``; empty for an
        embedding model)."""
        self.task = manifest.task
        splade = (manifest.pooling or {}).get("splade")
        self.sparse = bool(splade)
        self.max_active_dims = splade.get("max_active_dims") if splade else None
        self.output_shapes = {name: tuple(int(d) for d in shape) for name, shape in manifest.output_shapes.items()}
        embedding = self.output_shapes.get("sentence_embedding")
        self.embedding_size = embedding[1] if embedding else None
        id2label = (manifest.classifier or {}).get("id2label", {})
        self.labels = tuple(id2label[str(i)] for i in range(len(id2label)))

    @property
    def is_classifier(self) -> bool:
        return self.task == CLASSIFICATION_TASK

    def bound_memory(self, limit_bytes: int) -> None:
        """Releases the VM's pooled buffers whenever resident memory passes ``limit_bytes`` after
        an execution (see ``memory.py``); CPU artifacts only, where the pool is host memory."""
        if self.threads is not None:
            self.pool_bound = PoolBound(limit_bytes)

    def check_shape(self, batch: int, seq: int) -> None:
        """Refuses an input_ids shape the artifact cannot run (before any data is decoded)."""
        if batch == 0 or seq == 0:
            raise InputError(f"input_ids is empty (shape {[batch, seq]})")
        if batch > self.max_batch:
            raise InputError(f"batch of {batch} exceeds the artifact's maximum of {self.max_batch}")
        if seq > self.max_seq_len:
            raise InputError(f"sequence length {seq} exceeds the model's maximum of {self.max_seq_len}")

    def validate(
        self,
        input_ids: object,
        attention_mask: object | None = None,
        token_type_ids: object | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = _as_ids("input_ids", input_ids, None)
        self.check_shape(*ids.shape)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
            raise InputError(f"input_ids holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        if attention_mask is None:
            mask = np.ones_like(ids)
        else:
            mask = _as_ids("attention_mask", attention_mask, ids.shape)
            if mask.min() < 0 or mask.max() > 1:
                raise InputError("attention_mask may hold only 0 and 1")
        if token_type_ids is None:
            types = np.zeros_like(ids)
        else:
            types = _as_ids("token_type_ids", token_type_ids, ids.shape)
            if types.min() < 0 or types.max() >= self.type_vocab_size:
                raise InputError(f"token_type_ids must lie in [0, {self.type_vocab_size})")
        return ids, mask, types

    def run(
        self,
        input_ids: object,
        attention_mask: object | None = None,
        token_type_ids: object | None = None,
    ) -> EncoderOutput:
        return self.execute(*self.validate(input_ids, attention_mask, token_type_ids))

    def execute(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> EncoderOutput:
        """Runs arrays that :meth:`validate` returned (int64, contiguous, same shape)."""
        if self.threads is not None and not getattr(self._configured, "done", False):
            configure_cpu_threads(self.threads)
            self._configured.done = True
        positions = self._positions[: ids.shape[1]]
        arrays = packed_inputs(ids, mask, types, positions) if self.packed else (ids, mask, types, positions)
        inputs = [self._to_device(array) for array in arrays]
        with self._lock:
            hidden, head = self._forward(*inputs, *self.artifact.params)
            if self.task == CLASSIFICATION_TASK:
                output = EncoderOutput(self._to_numpy(hidden), None, logits=self._to_numpy(head))
            else:
                output = EncoderOutput(self._to_numpy(hidden), self._to_numpy(head))
            del hidden, head  # back to the pool before it is measured
            if self.pool_bound is not None:
                self.pool_bound.check()
        if self.max_active_dims is None:
            return output
        return dataclasses.replace(output, sentence_embedding=keep_largest(output.sentence_embedding,
                                                                           self.max_active_dims))


def keep_largest(rows: np.ndarray, count: int) -> np.ndarray:
    """Each row's ``count`` largest values, the rest zero, as sentence-transformers'
    ``max_active_dims`` keeps a sparse encoder's weights (which are never negative)."""
    if count >= rows.shape[1]:
        return rows
    kept = np.zeros_like(rows)
    largest = np.argpartition(rows, -count, axis=1)[:, -count:]
    np.put_along_axis(kept, largest, np.take_along_axis(rows, largest, axis=1), axis=1)
    return kept
