"""bf16 builds (``--precision bf16``) against transformers in fp32: the accuracy contract an
embedding user can rely on. Every token's hidden state within cosine 0.9999 of fp32's and every
sentence embedding within 0.99995, on real text and at the standard shapes (random tokens, up to
512), for MiniLM and bert-base; the largest absolute error is printed. The dense layers and
attention's two products multiply bf16 (rounded inputs and weights, fp32 sums); LayerNorm,
softmax, GELU, residuals and pooling stay fp32. Runs on CPUs with AVX512-BF16."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.host.cpu import cpu_flags
from dietserve.kernels.plan.kernel_plan import PlanError, read_plans
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import PLANS_DIR, Manifest

from .reference import padded_batch, reference_hidden
from .test_sentence_embedding import SENTENCES

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("avx512_bf16" not in (cpu_flags() or set()), reason="this CPU has no AVX512-BF16")]
TOKEN_COSINE, SENTENCE_COSINE = 0.9999, 0.99995
STANDARD_SHAPES = [(1, 1), (1, 16), (1, 128), (1, 512), (4, 64), (8, 37)]  # (batch, longest sequence)
PASSAGES = [
    "The packed layout runs each request's tokens one sequence after another, so that no work is "
    "spent on padding, and the attention kernel dispatches on each sequence's own length.",
    "bfloat16 keeps the exponent of a 32-bit float and eight bits of its mantissa; products of two such "
    "values are exact in fp32, and the sums stay in fp32 throughout.",
]


def _bf16(model: str, cache_dir: Path) -> Path:
    return compile_artifact(CompileRequest(model=model, max_batch=8, analytic=True, precision="bf16"), cache_dir)


@pytest.fixture(scope="module")
def minilm_bf16(cache_dir) -> Path:
    return _bf16("default", cache_dir)


@pytest.fixture(scope="module")
def bert_base_bf16(cache_dir) -> Path:
    return _bf16("bert-base", cache_dir)


def _cosines(ours: np.ndarray, theirs: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(each real token's cosine, each sequence's mean-pooled cosine, the largest absolute error)."""
    real = mask.astype(bool)
    a, b = ours[real], theirs[real]
    tokens = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    weights = mask[..., None].astype(np.float32)
    pooled_a, pooled_b = (ours * weights).sum(1), (theirs * weights).sum(1)
    sentences = (pooled_a * pooled_b).sum(-1) / (np.linalg.norm(pooled_a, axis=-1) * np.linalg.norm(pooled_b, axis=-1))
    return tokens, sentences, float(np.abs(a - b).max())


def _check_standard_shapes(engine: Engine, reference, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for batch, seq in STANDARD_SHAPES:
        ids, mask, types = padded_batch(rng, batch, seq, engine.vocab_size)
        hidden = engine.run(ids, mask, types).last_hidden_state
        tokens, sentences, error = _cosines(hidden, reference_hidden(reference, ids, mask, types), mask)
        print(f"{batch}x{seq}: token cosine >= {tokens.min():.6f} (mean {tokens.mean():.6f}), sentence "
              f"{sentences.min():.7f}, "
              f"max abs error {error:.4f}")
        assert tokens.min() >= TOKEN_COSINE, (batch, seq, tokens.min())
        assert sentences.min() >= SENTENCE_COSINE, (batch, seq, sentences.min())


def check_random_tokens(engine: Engine, reference, seed: int) -> None:
    """The contract on random tokens at lengths up to 512, the rows after a batch's first shorter,
    against ``reference`` (a transformers model in fp32 taking ids and a mask): for the families
    whose tokenizer the standard shapes do not fit (``test_encoder_families``, ``test_decoder_embedders``)."""
    import torch

    rng = np.random.default_rng(seed)
    for batch, seq in [(1, 1), (1, 128), (1, 512), (4, 64), (8, 37)]:
        ids = rng.integers(1000, 30000, (batch, seq)).astype(np.int64)
        mask = np.ones_like(ids)
        mask[1:, seq // 2 + 1:] = 0
        with torch.no_grad():
            expected = reference(input_ids=torch.from_numpy(ids),
                                 attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
        hidden = engine.run(ids, mask, np.zeros_like(ids)).last_hidden_state
        tokens, sentences, error = _cosines(hidden, expected, mask)
        assert tokens.min() >= TOKEN_COSINE and sentences.min() >= SENTENCE_COSINE, (batch, seq, tokens.min(), error)


def test_minilm_bf16_embeds_real_text_as_fp32_does(minilm_bf16, minilm_reference) -> None:
    import torch

    engine = Engine(load_artifact(minilm_bf16))
    embedder = Embedder(engine)
    texts = SENTENCES + PASSAGES
    encoded = embedder.tokenizer.encode(texts)
    ids, mask = encoded.input_ids, encoded.attention_mask
    hidden = engine.run(ids, mask, np.zeros_like(ids)).last_hidden_state
    with torch.no_grad():
        expected = minilm_reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
                                    ).last_hidden_state.numpy()
    tokens, sentences, error = _cosines(hidden, expected, mask)
    print(f"real text: token cosine >= {tokens.min():.6f}, sentence {sentences.min():.7f}, max abs error {error:.4f}")
    assert tokens.min() >= TOKEN_COSINE and sentences.min() >= SENTENCE_COSINE
    # the served embeddings (pooled, normalised by the embedder) agree as closely
    pooled = (expected * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    assert ((embedder.embed(texts) * pooled).sum(1) >= SENTENCE_COSINE).all()


def test_minilm_bf16_at_the_standard_shapes(minilm_bf16, minilm_reference) -> None:
    _check_standard_shapes(Engine(load_artifact(minilm_bf16)), minilm_reference, seed=0)


def test_bert_base_bf16_at_the_standard_shapes(bert_base_bf16, bert_base_reference) -> None:
    _check_standard_shapes(Engine(load_artifact(bert_base_bf16)), bert_base_reference, seed=1)


def test_a_bf16_artifact_records_its_precision_and_refuses_fp32_plans(minilm_bf16, cache_dir, tmp_path) -> None:
    manifest = Manifest.read(minilm_bf16)
    assert manifest.precision == "bf16" and manifest.build["precision"] == "bf16"
    dense = [entry for entry in manifest.dispatch.values() if entry["packed_panel"]]
    assert dense and all(entry["precision"] == "bf16" for entry in dense)
    plans = read_plans([minilm_bf16 / PLANS_DIR])
    assert plans and all(plan.precision == "bf16" for plan in plans)
    fp32_plan = dataclasses.replace(plans[0], precision="fp32").write(tmp_path / "fp32.plan.json")
    with pytest.raises(PlanError, match="tuned for fp32 products, this build is bf16"):
        compile_artifact(CompileRequest(model="default", max_batch=8, plans=(fp32_plan,), precision="bf16"),
                         cache_dir)
    with pytest.raises(ValueError, match="planned kernels"):
        compile_artifact(CompileRequest(model="default", precision="bf16"), cache_dir)


def test_tune_writes_bf16_plans_and_builds_them(cache_dir, tmp_path) -> None:
    """``dietserve tune --precision bf16``: the task file says bf16, the tuner process times bf16
    kernels (the attention's tiles too), every plan it writes is the bf16 build's, and the tuned
    artifact links them."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tuned"
    done = subprocess.run([sys.executable, "-m", "dietserve", "tune", "--model", "default", "--precision", "bf16",
                           "--trials", "3", "--max-batch", "4", "--db", str(tmp_path / "records.jsonl"),
                           "--out", str(out), "--cache-dir", str(cache_dir)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "tasks.json").read_text())["precision"] == "bf16"
    plans = read_plans([out / "plans"])
    assert plans and all(plan.precision == "bf16" for plan in plans)
    attention = next((out / "plans").glob("*.attention.json"))
    assert json.loads(attention.read_text())["precision"] == "bf16"
    manifest = Manifest.read(out / "artifact")
    assert manifest.precision == "bf16" and manifest.kernel_plans == "tuned"


def test_a_served_bf16_version_is_retuned_as_it_was_built(minilm_bf16, minilm_reference, cache_dir, tmp_path) -> None:
    """The re-tuning job (a bf16 server's first start runs it, and so does drifted traffic) builds
    the served version's model from its manifest: it tunes bf16 plans and publishes a bf16 tuned
    version, which keeps the contract, and which the server's check before a swap accepts beside
    the cold version (their kernels round some values the other way)."""
    import subprocess
    import sys

    from dietserve.runtime.traffic import Traffic
    from dietserve.runtime.versions import VersionStore
    from dietserve.server.swap import compare

    store = VersionStore(tmp_path / "store")
    store.publish(minilm_bf16)
    traffic = Traffic(half_life_seconds=3600.0, as_of=0.0)
    for length in (5, 40, 130):
        traffic.record(1, length, now=0.0)
    traffic.save(tmp_path / "traffic.json")
    done = subprocess.run([sys.executable, "-m", "dietserve", "retune", "--store", str(store.root),
                           "--traffic", str(tmp_path / "traffic.json"), "--trials", "1", "--min-gain", "0",
                           "--cache-dir", str(cache_dir)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.versions() == [1, 2]  # published (a server then verifies and swaps it in)
    tuned = store.path(2)
    manifest = Manifest.read(tuned)
    assert manifest.precision == "bf16" and manifest.kernel_plans == "tuned"
    assert all(plan.precision == "bf16" for plan in read_plans([tuned / PLANS_DIR]))
    engine = Engine(load_artifact(tuned))
    ids, mask, types = padded_batch(np.random.default_rng(2), 2, 128, engine.vocab_size)
    tokens, sentences, _ = _cosines(engine.run(ids, mask, types).last_hidden_state,
                                    reference_hidden(minilm_reference, ids, mask, types), mask)
    assert tokens.min() >= TOKEN_COSINE and sentences.min() >= SENTENCE_COSINE
    cold, rng = Engine(load_artifact(store.path(1))), np.random.default_rng(3)
    for shape in [(1, 16), (4, 64), (1, 512), (8, 128)]:  # the swap's sample shapes, and heavier traffic's
        assert compare(cold, engine, rng.integers(1000, 20000, size=shape)) is None
