"""The packed layout (``--layout packed``): a batch's sequences run as one block of their tokens,
no padded work. Each sequence of a packed batch matches transformers on that sequence alone and
our own run of it alone; the request's padded shape comes back, zeros at padding."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.tuning import tuning_tasks
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import LAYOUT_PACKED, PACKED_INPUTS, Manifest

from .reference import reference_hidden
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
TO_TRANSFORMERS = 1e-4
TO_OURS_ALONE = 1e-5
# lengths 1 and the maximum, primes, a batch as full as the artifact takes
MIXES = [[1], [512], [7, 1, 13], [31, 2, 97, 5, 1], [1, 512, 17], [11, 3, 61, 29, 1, 2, 53, 127]]


@pytest.fixture(scope="module")
def packed_artifact(cache_dir) -> Path:
    artifact = compile_artifact(CompileRequest(model="default", max_batch=16, analytic=True, layout=LAYOUT_PACKED),
                                cache_dir)
    manifest = Manifest.read(artifact)
    assert manifest.layout == LAYOUT_PACKED and manifest.inputs == PACKED_INPUTS
    return artifact


@pytest.fixture(scope="module")
def packed_engine(packed_artifact) -> Engine:
    return Engine(load_artifact(packed_artifact))


def _batch(rng: np.random.Generator, lengths: list[int], vocab: int, left: bool = False):
    """Right-padded rows of these lengths (``left``: padded on the left), two segments each."""
    seq = max(lengths)
    ids, mask, types = (np.zeros((len(lengths), seq), np.int64) for _ in range(3))
    for row, length in enumerate(lengths):
        span = slice(seq - length, seq) if left else slice(0, length)
        ids[row, span] = rng.integers(1000, vocab, length)
        ids[row, span.start] = 101  # [CLS]
        mask[row, span] = 1
        types[row, span.start + length // 2:span.stop] = 1
    return ids, mask, types


def test_each_packed_sequence_matches_transformers_and_itself_alone(packed_engine, minilm_reference) -> None:
    rng = np.random.default_rng(0)
    for lengths in MIXES:
        ids, mask, types = _batch(rng, lengths, packed_engine.vocab_size)
        together = packed_engine.run(ids, mask, types)
        assert together.last_hidden_state.shape == (*ids.shape, packed_engine.hidden_size)
        for row, length in enumerate(lengths):
            alone_inputs = (ids[row:row + 1, :length], mask[row:row + 1, :length], types[row:row + 1, :length])
            alone = packed_engine.run(*alone_inputs)
            expected = reference_hidden(minilm_reference, *alone_inputs)[0]
            hidden = together.last_hidden_state[row]
            error = float(np.abs(hidden[:length] - expected).max())
            assert error <= TO_TRANSFORMERS, f"{lengths}, row {row}: {error:.2e} from transformers"
            ours = float(np.abs(hidden[:length] - alone.last_hidden_state[0]).max())
            assert ours <= TO_OURS_ALONE, f"{lengths}, row {row}: {ours:.2e} from its own run alone"
            embedding = float(np.abs(together.sentence_embedding[row] - alone.sentence_embedding[0]).max())
            assert embedding <= TO_OURS_ALONE, f"{lengths}, row {row}: sentence embedding {embedding:.2e} apart"
            assert not hidden[length:].any(), "padding must come back as zeros"


def test_a_left_padded_batch_runs_as_transformers_runs_it(packed_engine, minilm_reference) -> None:
    """Any mask pattern: the attended tokens keep their own positions, as in the padded model."""
    ids, mask, types = _batch(np.random.default_rng(1), [9, 4, 23], packed_engine.vocab_size, left=True)
    hidden = packed_engine.run(ids, mask, types).last_hidden_state
    expected = reference_hidden(minilm_reference, ids, mask, types)
    attended = mask.astype(bool)
    assert float(np.abs(hidden[attended] - expected[attended]).max()) <= TO_TRANSFORMERS
    assert not hidden[~attended].any()


def test_rows_without_tokens_leave_the_others_unchanged(packed_engine) -> None:
    """A row whose mask is all zeros (and a request with no token at all) runs; mean pooling of no
    token is the zero vector, as sentence-transformers' clamped count gives."""
    ids, mask, types = _batch(np.random.default_rng(2), [5, 8], packed_engine.vocab_size)
    with_empty = (np.vstack([ids, ids[:1]]), np.vstack([mask, np.zeros_like(mask[:1])]),
                  np.vstack([types, types[:1]]))
    out, plain = packed_engine.run(*with_empty), packed_engine.run(ids, mask, types)
    assert np.abs(out.last_hidden_state[:2] - plain.last_hidden_state).max() <= TO_OURS_ALONE
    assert not out.sentence_embedding[2].any() and not out.last_hidden_state[2].any()
    nothing = packed_engine.run(ids, np.zeros_like(mask), types)
    assert not nothing.sentence_embedding.any() and not nothing.last_hidden_state.any()


TEXTS = ["A man is eating food.", "Hi", "The new movie is awesome and everyone should see it twice.",
         "Packed batches run every text at its own length.", "x", "A cat sat on the mat, and then it slept.",
         "Where is the nearest train station?", "ok", "Indexing documents is the commonest embedding workload.",
         "Sequence lengths change with every request.", "Two texts", "A", "The quick brown fox jumps over it.",
         "Dynamic shapes, tuned kernels.", "Padding is wasted work.", "the last one of sixteen texts"]


def _embeddings(client: triton_grpc.InferenceServerClient, texts: list[str]) -> np.ndarray:
    tensor = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    result = client.infer("packed-text", [tensor], outputs=[triton_grpc.InferRequestedOutput("sentence_embedding")])
    return result.as_numpy("sentence_embedding")


def test_a_request_of_sixteen_texts_returns_what_sixteen_single_requests_return(packed_artifact) -> None:
    """Through a real server: one request of 16 texts (one execution, no padded work), and the
    same texts as 16 requests sent at once (merged by the token budget, two executions of it)."""
    server = ServerProcess(packed_artifact, "--max-batch-tokens", "64", "--max-queue-delay-ms", "20",
                           model_name="packed")
    try:
        with triton_grpc.InferenceServerClient(server.grpc_url) as client:
            together = _embeddings(client, TEXTS)
            with ThreadPoolExecutor(len(TEXTS)) as pool:
                alone = np.vstack(list(pool.map(lambda text: _embeddings(client, [text]), TEXTS)))
    finally:
        server.stop()
    assert together.shape == (len(TEXTS), 384)
    assert float(np.abs(together - alone).max()) <= TO_OURS_ALONE


def test_the_dense_layers_are_tuned_over_the_tokens_of_an_execution(cache_dir) -> None:
    """A packed model's dense tasks vary its tokens, weighted by the tokens per execution the
    traffic recorded (an execution past the longest length counts as the last interval's);
    its sequence lengths weigh nothing there."""
    request = CompileRequest(model="default", max_batch=16, layout=LAYOUT_PACKED)
    tasks = tuning_tasks(request, cache_dir, lengths=(3, 3, 7), tokens=(40, 40, 900)).tasks
    dense = [task for task in tasks if task.vary["var"] == "tokens"]
    assert len(dense) == 4 and all(not task.fixed for task in dense)  # qkv, attention out, intermediate, out
    for task in dense:
        weights = dict(zip(task.vary["values"], task.weights, strict=True))
        assert weights[40] == 2 and weights[512] == 1 and sum(weights.values()) == 3
    assert not any(task.vary["var"] == "seq_len" for task in tasks)  # attention is one kernel, not tuned here
