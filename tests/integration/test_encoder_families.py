"""BERT's relatives, randomly initialised and saved by their own libraries, compile through the
same pipeline and answer as transformers and sentence-transformers do:
- RoBERTa's family (XLM-RoBERTa here, as multilingual-e5, bge-m3 and the bge rerankers are):
  BERT's layers with positions numbered from past the padding index, one token type, the
  classification head under other names; an embedder and a cross-encoder, at every length up to
  the table's last position;
- DistilBERT: BERT's layers under other names, no token types, a ReLU in its classifier's head;
  a sentiment classifier (as distilbert-base-uncased-finetuned-sst-2-english) and an embedder;
- MPNet (as all-mpnet-base-v2): RoBERTa's numbering, no token types, and a learned bias on the
  scores by relative position bucket, in both layouts, at distances past the last bucket's;
- ModernBERT (as gte-modernbert-base and its reranker): rotary positions, pre-LayerNorm layers,
  a gated GELU, no biases, and a sliding window in one layer of two here; an embedder in both
  layouts at texts far longer than the window, and sequence classifiers with either head pooling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.host.cpu import cpu_flags
from dietserve.model.family_tensors import relative_position_buckets
from dietserve.model.presets import default_model_folder
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder, artifact_tokenizer
from dietserve.runtime.engine import Engine

from .reference import as_layout_answers
from .server_process import ServerProcess

MAX_LENGTH = 128  # tokens; the position table holds two more (RoBERTa's padding index is 1)
TEXTS = [
    "A man is eating food.",
    "Ein Mann isst ein Stück Brot.",
    "La fille porte un bébé.",
    "東京は日本の首都です。",
    "How many people live in Berlin? " * 40,  # truncated to the last position the table holds
]
PAIRS = [
    ("How many people live in Berlin?", "Berlin has a population of 3,520,031 registered inhabitants."),
    ("How many people live in Berlin?", "New York City is famous for the Metropolitan Museum of Art."),
    ("Wie viele Menschen leben in Berlin?", "Berlin hat 3.520.031 Einwohner. " * 30),
]


def _tokenizer_folder(folder: Path) -> Path:
    """A SentencePiece-style (Unigram) tokenizer laid out as XLM-RoBERTa's: <s> <pad> </s> <unk>
    at ids 0-3, pairs as ``<s> a </s></s> b </s>``, one token type; trained here, saved by
    transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaTokenizerFast

    corpus = [*TEXTS[:4], *[text for pair in PAIRS for text in pair]]
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer.train_from_iterator(corpus * 4, trainers.UnigramTrainer(vocab_size=400, special_tokens=special,
                                                                      unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    XLMRobertaTokenizerFast(tokenizer_object=tokenizer, model_max_length=MAX_LENGTH).save_pretrained(str(folder))
    return folder


def _config(vocab_size: int, **labels):
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=MAX_LENGTH + 2, type_vocab_size=1,
                            pad_token_id=1, bos_token_id=0, eos_token_id=2, initializer_range=0.1, **labels)


@pytest.fixture(scope="module")
def embedder_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XLMRobertaModel under sentence-transformers' mean pooling and Normalize, saved by
    sentence-transformers."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, XLMRobertaModel

    encoder = _tokenizer_folder(tmp_path_factory.mktemp("xlmr-encoder"))
    torch.manual_seed(11)
    XLMRobertaModel(_config(len(AutoTokenizer.from_pretrained(str(encoder))))).eval().save_pretrained(str(encoder))
    transformer = models.Transformer(str(encoder), max_seq_length=MAX_LENGTH)
    pooling = models.Pooling(transformer.get_embedding_dimension(), "mean")
    folder = tmp_path_factory.mktemp("embedders") / "xlmr-embedder"
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def embedder(embedder_folder: Path, cache_dir: Path) -> Embedder:
    return Embedder(Engine(load_artifact(compile_artifact(CompileRequest(model=str(embedder_folder), max_batch=8),
                                                          cache_dir))))


def test_hidden_states_match_transformers(embedder, embedder_folder) -> None:
    """Every token's state, the longest text's reaching the table's last position."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    tokenizer = AutoTokenizer.from_pretrained(str(embedder_folder))
    expected_ids = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="np")
    encoded = embedder.tokenizer.encode(TEXTS)
    np.testing.assert_array_equal(encoded.input_ids * encoded.attention_mask,
                                  expected_ids["input_ids"] * expected_ids["attention_mask"])
    assert encoded.input_ids.shape[1] == MAX_LENGTH
    reference = XLMRobertaModel.from_pretrained(str(embedder_folder), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(expected_ids["input_ids"]),
                             attention_mask=torch.from_numpy(expected_ids["attention_mask"])).last_hidden_state.numpy()
    ours = embedder.encode(TEXTS).last_hidden_state
    assert np.abs(expected).max() > 0.5
    np.testing.assert_allclose(ours, as_layout_answers(embedder.engine, expected, encoded.attention_mask),
                               rtol=0, atol=1e-4)


def test_embeddings_match_sentence_transformers(embedder, embedder_folder) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedder_folder), device="cpu", local_files_only=True)
    assert reference.max_seq_length == MAX_LENGTH
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    ours = embedder.embed(TEXTS)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)
    assert embedder.engine.max_seq_len == MAX_LENGTH
    manifest = embedder.engine.artifact.manifest
    assert manifest.model_config["model_type"] == "xlm-roberta"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Engine]:
    """An XLMRobertaForSequenceClassification with one label, as the bge rerankers are."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    folder = _tokenizer_folder(tmp_path_factory.mktemp("rerankers") / "xlmr-reranker")
    config = _config(len(AutoTokenizer.from_pretrained(str(folder))), num_labels=1)
    torch.manual_seed(5)
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(str(folder))
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    return folder, Engine(load_artifact(artifact))


def cross_encoder_matches(folder: Path, engine: Engine, model_class) -> None:
    """``PAIRS`` tokenized as the server tokenizes them: ``engine``'s logits against transformers'
    ``model_class`` read from ``folder``, its scores against sentence-transformers' CrossEncoder
    (a sigmoid over the one logit)."""
    import torch
    from sentence_transformers import CrossEncoder

    encoded = artifact_tokenizer(engine).encode(PAIRS)
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    reference = model_class.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask)).logits.numpy()
    assert np.abs(logits).max() > 0.1
    np.testing.assert_allclose(output.logits, logits, rtol=0, atol=1e-4)
    scores = CrossEncoder(str(folder), device="cpu", local_files_only=True, max_length=MAX_LENGTH).predict(PAIRS)
    np.testing.assert_allclose(1 / (1 + np.exp(-output.logits[:, 0])), scores, rtol=0, atol=1e-5)
    assert engine.artifact.manifest.task == "classification"


def test_cross_encoder_scores_match(cross_encoder) -> None:
    from transformers import XLMRobertaForSequenceClassification

    cross_encoder_matches(*cross_encoder, XLMRobertaForSequenceClassification)


def _distilbert_folder(folder: Path, model_class, **labels) -> Path:
    """A small DistilBERT of ``model_class`` with the default checkpoint's WordPiece vocabulary,
    its tokenizer saved as DistilBERT's (no token_type_ids among its outputs)."""
    import torch
    from transformers import DistilBertConfig, DistilBertTokenizerFast

    config = DistilBertConfig(vocab_size=30522, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=MAX_LENGTH, initializer_range=0.1, **labels)
    torch.manual_seed(3)
    model_class(config).eval().save_pretrained(str(folder))
    DistilBertTokenizerFast.from_pretrained(str(default_model_folder())).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def distilbert_classifier(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Engine]:
    from transformers import DistilBertForSequenceClassification

    labels = {0: "NEGATIVE", 1: "POSITIVE"}
    folder = _distilbert_folder(tmp_path_factory.mktemp("classifiers") / "distilbert-sst2",
                                DistilBertForSequenceClassification, id2label=labels,
                                label2id={name: i for i, name in labels.items()})
    return folder, Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))


@pytest.mark.parametrize("items", [TEXTS, PAIRS], ids=["texts", "pairs"])
def test_distilbert_logits_match_transformers(distilbert_classifier, items) -> None:
    """The server's tokenizing (a pair's second text would be token type 1 by the WordPiece
    post-processor; DistilBERT has none) against the checkpoint's own tokenizer and model."""
    import torch
    from transformers import AutoTokenizer, DistilBertForSequenceClassification

    folder, engine = distilbert_classifier
    assert engine.labels == ("NEGATIVE", "POSITIVE")
    encoded = artifact_tokenizer(engine).encode(items)
    assert not encoded.token_type_ids.any()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = [item if isinstance(item, str) else item[0] for item in items]
    pairs = None if isinstance(items[0], str) else [item[1] for item in items]
    expected_ids = tokenizer(texts, pairs, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    np.testing.assert_array_equal(encoded.input_ids * encoded.attention_mask,
                                  (expected_ids["input_ids"] * expected_ids["attention_mask"]).numpy())
    reference = DistilBertForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(**expected_ids, output_hidden_states=True)
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    assert np.abs(expected.logits.numpy()).max() > 0.1
    np.testing.assert_allclose(output.logits, expected.logits.numpy(), rtol=0, atol=1e-4)
    hidden = as_layout_answers(engine, expected.hidden_states[-1].numpy(), encoded.attention_mask)
    np.testing.assert_allclose(output.last_hidden_state, hidden, rtol=0, atol=1e-4)


def test_distilbert_embeddings_match_sentence_transformers(tmp_path: Path, cache_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer, models
    from transformers import DistilBertModel

    encoder = _distilbert_folder(tmp_path / "encoder", DistilBertModel)
    transformer = models.Transformer(str(encoder), max_seq_length=MAX_LENGTH)
    folder = tmp_path / "embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "mean")],
                        device="cpu").save(str(folder))
    expected = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(TEXTS)
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))
    assert engine.type_vocab_size == 1
    np.testing.assert_allclose(Embedder(engine).embed(TEXTS), expected, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_one_server_serves_each_family(embedder, embedder_folder, cross_encoder, distilbert_classifier,
                                       modernbert_folder, cache_dir) -> None:
    """The three artifacts served by one real server process, each through its HTTP route:
    TEI's /embed, /rerank and /predict, against sentence-transformers and transformers' pipeline."""
    import requests
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import pipeline

    modernbert = compile_artifact(CompileRequest(model=str(modernbert_folder), max_batch=8), cache_dir)
    artifacts = [embedder.engine.artifact.directory, cross_encoder[1].artifact.directory,
                 distilbert_classifier[1].artifact.directory, modernbert]
    server = ServerProcess(None, *[flag for artifact in artifacts for flag in ("--artifact", str(artifact))],
                           model_name=None)
    try:
        def post(route: str, model: str, body: dict):
            answer = requests.post(f"http://{server.http_url}{route}?model={model}", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()

        embedded = np.array(post("/embed", "xlmr-embedder", {"inputs": TEXTS, "truncate": True}))
        expected = SentenceTransformer(str(embedder_folder), device="cpu", local_files_only=True).encode(TEXTS)
        np.testing.assert_allclose(embedded, expected, rtol=0, atol=1e-4)
        embedded = np.array(post("/embed", "modernbert-embedder", {"inputs": TEXTS, "truncate": True}))
        expected = SentenceTransformer(str(modernbert_folder), device="cpu", local_files_only=True).encode(TEXTS)
        np.testing.assert_allclose(embedded, expected, rtol=0, atol=1e-4)

        query, documents = PAIRS[0][0], [document for _, document in PAIRS]
        ranked = post("/rerank", "xlmr-reranker", {"query": query, "texts": documents, "truncate": True})
        scores = CrossEncoder(str(cross_encoder[0]), device="cpu", local_files_only=True,
                              max_length=MAX_LENGTH).predict([(query, document) for document in documents])
        assert [entry["index"] for entry in ranked] == list(np.argsort(-scores))
        np.testing.assert_allclose([entry["score"] for entry in ranked], np.sort(scores)[::-1], rtol=0, atol=1e-5)

        # texts, and pairs (which DistilBERT's WordPiece tokenizer numbers as BERT's: type 1 for the second)
        inputs = [*TEXTS[:4], *[list(pair) for pair in PAIRS[:2]]]
        predicted = post("/predict", "distilbert-sst2", {"inputs": inputs})
        classify = pipeline("text-classification", model=str(distilbert_classifier[0]), device="cpu", top_k=None)
        expected = classify([*TEXTS[:4], *[{"text": a, "text_pair": b} for a, b in PAIRS[:2]]])
        for ours, theirs in zip(predicted, expected, strict=True):
            assert [entry["label"] for entry in ours] == [entry["label"] for entry in theirs]
            np.testing.assert_allclose([entry["score"] for entry in ours], [entry["score"] for entry in theirs],
                                       rtol=0, atol=1e-5)
    finally:
        server.stop()


MPNET_LENGTH = 256  # past 128, the distance from which every farther key shares the last bucket


@pytest.fixture(scope="module")
def mpnet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MPNetModel under mean pooling and Normalize, as all-mpnet-base-v2, saved by
    sentence-transformers."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, MPNetConfig, MPNetModel

    encoder = _tokenizer_folder(tmp_path_factory.mktemp("mpnet-encoder"))
    config = MPNetConfig(vocab_size=len(AutoTokenizer.from_pretrained(str(encoder))), hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=MPNET_LENGTH + 2, initializer_range=0.1)
    torch.manual_seed(13)
    MPNetModel(config).eval().save_pretrained(str(encoder))
    transformer = models.Transformer(str(encoder), max_seq_length=MPNET_LENGTH)
    folder = tmp_path_factory.mktemp("embedders") / "mpnet-embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "mean"),
                                 models.Normalize()], device="cpu").save(str(folder))
    return folder


def _embedder_matches(folder: Path, model_class, length: int, layout: str, cache_dir: Path,
                      reference_folder: Path | None = None):
    """``folder``'s embedder compiled in ``layout`` against transformers' ``model_class`` (every
    attended token's state, the texts tokenized alike up to ``length``) and sentence-transformers
    (the sentence embedding), both reading ``reference_folder`` (default ``folder``); returns
    transformers' model."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    request = CompileRequest(model=str(folder), max_batch=8, layout=layout)
    embedder = Embedder(Engine(load_artifact(compile_artifact(request, cache_dir))))
    assert embedder.engine.max_seq_len == length and embedder.engine.packed == (layout == "packed")
    encoded = embedder.tokenizer.encode(TEXTS)
    assert encoded.input_ids.shape[1] == length
    folder = reference_folder or folder
    reference = model_class.from_pretrained(str(folder), attn_implementation="eager").eval()
    expected_ids = AutoTokenizer.from_pretrained(str(folder))(
        TEXTS, padding=True, truncation=True, max_length=length, return_tensors="pt")
    np.testing.assert_array_equal(encoded.input_ids * encoded.attention_mask,
                                  (expected_ids["input_ids"] * expected_ids["attention_mask"]).numpy())
    with torch.no_grad():
        expected = reference(input_ids=expected_ids["input_ids"],
                             attention_mask=expected_ids["attention_mask"]).last_hidden_state.numpy()
    output = embedder.encode(TEXTS)
    # (padding's rows are compared nowhere: no output reads them, and transformers numbers MPNet's
    # positions there, as RoBERTa's, by the padding index)
    mask = encoded.attention_mask[..., None]
    assert np.abs(expected).max() > 0.5
    np.testing.assert_allclose(output.last_hidden_state * mask, expected * mask, rtol=0, atol=1e-4)
    sentence = SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(TEXTS)
    np.testing.assert_allclose(output.sentence_embedding, sentence, rtol=0, atol=1e-5)
    return reference


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_mpnet_matches_transformers_and_sentence_transformers(mpnet_folder, cache_dir, layout) -> None:
    from transformers import MPNetModel

    _embedder_matches(mpnet_folder, MPNetModel, MPNET_LENGTH, layout, cache_dir)


def test_mpnet_buckets_are_transformers() -> None:
    """Every distance a 1,024-token sequence reaches falls in transformers' bucket."""
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    distances = np.arange(-1023, 1024)
    expected = MPNetEncoder.relative_position_bucket(torch.from_numpy(distances), num_buckets=32).numpy()
    np.testing.assert_array_equal(relative_position_buckets(distances, 32), expected)


MODERNBERT_LENGTH = 256
MODERNBERT_WINDOW = 16  # local_attention: keys within 8 of the query, so texts here reach past it


def _modernbert_config(tokenizer_folder: Path, **head):
    from transformers import AutoTokenizer, ModernBertConfig

    return ModernBertConfig(vocab_size=len(AutoTokenizer.from_pretrained(str(tokenizer_folder))), hidden_size=64,
                            num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                            max_position_embeddings=MODERNBERT_LENGTH, global_attn_every_n_layers=2,
                            local_attention=MODERNBERT_WINDOW, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            cls_token_id=0, sep_token_id=2, initializer_range=0.1, **head)


@pytest.fixture(scope="module")
def modernbert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ModernBertModel (full attention in layers 0 and 2, a sliding window in layer 1, rotary
    positions, no biases) under mean pooling and Normalize, saved by sentence-transformers."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import ModernBertModel

    encoder = _tokenizer_folder(tmp_path_factory.mktemp("modernbert-encoder"))
    torch.manual_seed(17)
    ModernBertModel(_modernbert_config(encoder)).eval().save_pretrained(str(encoder))
    transformer = models.Transformer(str(encoder), max_seq_length=MODERNBERT_LENGTH)
    folder = tmp_path_factory.mktemp("embedders") / "modernbert-embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "mean"),
                                 models.Normalize()], device="cpu").save(str(folder))
    return folder


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_modernbert_matches_transformers_and_sentence_transformers(modernbert_folder, cache_dir, layout) -> None:
    from transformers import ModernBertModel

    reference = _embedder_matches(modernbert_folder, ModernBertModel, MODERNBERT_LENGTH, layout, cache_dir)
    assert reference.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_modernbert_classifier_matches_transformers(tmp_path: Path, cache_dir: Path, pooling: str) -> None:
    """A cross-encoder (as gte-reranker-modernbert-base): its head reads the attended tokens'
    mean or the first token, then a dense layer, GELU and LayerNorm, before the output layer."""
    import torch
    from transformers import ModernBertForSequenceClassification

    folder = _tokenizer_folder(tmp_path / "reranker")
    torch.manual_seed(19)
    config = _modernbert_config(folder, num_labels=1, classifier_pooling=pooling)
    ModernBertForSequenceClassification(config).eval().save_pretrained(str(folder))
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))
    encoded = artifact_tokenizer(engine).encode(PAIRS)
    reference = ModernBertForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask)).logits.numpy()
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    assert np.abs(logits).max() > 0.1 and engine.artifact.manifest.task == "classification"
    np.testing.assert_allclose(output.logits, logits, rtol=0, atol=1e-4)


@pytest.mark.skipif("avx512_bf16" not in (cpu_flags() or set()), reason="this CPU has no AVX512-BF16")
def test_modernbert_bf16_keeps_the_accuracy_contract(tmp_path: Path, cache_dir: Path) -> None:
    """A bf16 build (heads of 64, as ModernBERT-base's, so attention runs on bf16 pairs; its
    windowed layers skip the key blocks outside the window) against transformers in fp32, at
    lengths up to 512 (random tokens): every token within cosine 0.9999, every mean-pooled
    sentence within 0.99995, as ``test_bf16_model.py`` holds MiniLM and bert-base."""
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    from .test_bf16_model import check_random_tokens

    folder = tmp_path / "modernbert-bf16"
    config = ModernBertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=3, num_attention_heads=2,
                              intermediate_size=192, max_position_embeddings=512, global_attn_every_n_layers=2,
                              local_attention=32, pad_token_id=0)
    torch.manual_seed(23)
    reference = ModernBertModel(config).eval()
    reference.save_pretrained(str(folder))
    request = CompileRequest(model=str(folder), max_batch=8, analytic=True, precision="bf16")
    engine = Engine(load_artifact(compile_artifact(request, cache_dir)))
    assert engine.artifact.manifest.precision == "bf16"
    check_random_tokens(engine, reference, seed=5)
