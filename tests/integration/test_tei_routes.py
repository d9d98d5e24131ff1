"""TEI's embedding routes, end to end: a real server process and a real TEI client
(huggingface_hub's InferenceClient, which posts to ``/``), checked against transformers (with
the checkpoint's pooling), its tokenizer, and the same server's OpenAI route for the same input.
A second, small checkpoint without a Normalize module, with sentence-transformers prompts, shows
``normalize`` as TEI applies it and ``prompt_name`` as sentence-transformers applies it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import requests
from huggingface_hub import InferenceClient

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.config import BertConfig
from dietserve.model.presets import default_model_folder, materialize_random_bert

from .reference import reference_hidden, reference_model
from .server_process import ServerProcess
from .test_sentence_embedding import _reference_embeddings, sentence_transformers_length

pytestmark = pytest.mark.slow
SENTENCES = ["A man is eating food.", "The new movie is awesome and everyone should see it twice.", "Hi"]
UNICODE = "Héllo wörld, naïve café ☕!"
SAME = 1e-6  # one server, one input: two routes must give the same numbers
REFERENCE_ATOL = 1e-4  # against transformers, as the other wires' tests
RESPONSE_LIMIT = 1_000_000  # --max-response-bytes: a batch of 8 rows of 40 tokens passes, three of them do not


@pytest.fixture(scope="module")
def server(minilm_artifact: Path):
    process = ServerProcess(minilm_artifact, "--max-response-bytes", str(RESPONSE_LIMIT))
    yield process
    process.stop()


def _post(server: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://{server.http_url}{path}", json=body, timeout=60)


def _ok(answer: requests.Response):
    assert answer.status_code == 200, answer.text
    return answer.json()


def _openai(server: ServerProcess, inputs: list) -> np.ndarray:
    return np.array([entry["embedding"] for entry in _ok(_post(server, "/v1/embeddings", {"input": inputs}))["data"]])


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_folder()))


def test_huggingface_hub_client_embeds_as_the_reference_and_as_openai_route(server, minilm_reference):
    client = InferenceClient(model=f"http://{server.http_url}")
    one = client.feature_extraction(SENTENCES[0])
    many = client.feature_extraction(SENTENCES)
    assert one.shape == (1, 384) and many.shape == (3, 384)
    reference, _ = _reference_embeddings(minilm_reference, SENTENCES)
    np.testing.assert_allclose(many, reference, atol=REFERENCE_ATOL)
    np.testing.assert_allclose(many, _openai(server, SENTENCES), atol=SAME)
    np.testing.assert_allclose(one[0], many[0], atol=SAME)
    short = client.feature_extraction(SENTENCES, dimensions=16)
    expected = reference[:, :16] / np.linalg.norm(reference[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=REFERENCE_ATOL)


def test_huggingface_hub_sentence_similarity_is_the_references_cosine(server, minilm_reference):
    client = InferenceClient(model=f"http://{server.http_url}")
    similarity = client.sentence_similarity(SENTENCES[0], other_sentences=SENTENCES[1:])
    reference, _ = _reference_embeddings(minilm_reference, SENTENCES)
    expected = [float(reference[0] @ row / np.linalg.norm(reference[0]) / np.linalg.norm(row)) for row in reference[1:]]
    np.testing.assert_allclose(similarity, expected, atol=REFERENCE_ATOL)
    body = {"inputs": {"source_sentence": SENTENCES[0], "sentences": SENTENCES[1:]}, "parameters": {"truncate": True}}
    np.testing.assert_allclose(_ok(_post(server, "/similarity", body)), similarity, atol=SAME)


def test_embed_invocations_and_token_ids_agree(server):
    expected = _openai(server, SENTENCES)
    for path in ("/embed", "/invocations", "/"):
        np.testing.assert_allclose(_ok(_post(server, path, {"inputs": SENTENCES})), expected, atol=SAME)
    ids = [_tokenizer()(text)["input_ids"] for text in SENTENCES]
    np.testing.assert_allclose(_ok(_post(server, "/embed", {"inputs": ids})), expected, atol=SAME)
    np.testing.assert_allclose(_ok(_post(server, "/embed", {"inputs": ids[1]})), expected[1:2], atol=SAME)
    count = 19  # more than two batches of 8: split, and kept in order
    texts = [f"sentence {i} about {'cats' if i % 3 else 'compilers'}" for i in range(count)]
    np.testing.assert_allclose(_ok(_post(server, "/embed", {"inputs": texts})), _openai(server, texts), atol=SAME)


def test_embed_all_answers_each_texts_own_tokens(server, minilm_reference):
    answer = _ok(_post(server, "/embed_all", {"inputs": SENTENCES}))
    tokenizer = _tokenizer()
    for text, ours in zip(SENTENCES, answer, strict=True):
        encoded = tokenizer([text], return_tensors="np")
        expected = reference_hidden(minilm_reference, encoded["input_ids"], encoded["attention_mask"],
                                    encoded["token_type_ids"])[0]
        assert np.array(ours).shape == expected.shape  # no padding rows
        np.testing.assert_allclose(ours, expected, atol=REFERENCE_ATOL)


def test_embed_all_answers_within_the_reply_limit_as_a_whole(server, minilm_engine):
    text = " ".join(["word"] * 38)  # 40 tokens with [CLS] and [SEP]: 8 rows of them are 491,520 bytes
    hidden = minilm_engine.output_shapes["last_hidden_state"][-1]
    refused = _post(server, "/embed_all", {"inputs": [text] * 24})
    assert refused.status_code == 400
    assert f"would be {24 * 40 * hidden * 4} bytes as float32, over this server's limit of {RESPONSE_LIMIT}" in \
        refused.json()["error"]
    assert [len(rows) for rows in _ok(_post(server, "/embed_all", {"inputs": [text] * 8}))] == [40] * 8


def test_tokenize_and_decode_agree_with_the_checkpoints_tokenizer(server):
    tokenizer = _tokenizer()
    texts = [UNICODE, SENTENCES[1]]
    answer = _ok(_post(server, "/tokenize", {"inputs": texts}))
    for text, tokens in zip(texts, answer, strict=True):
        encoded = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert [token["id"] for token in tokens] == encoded["input_ids"]
        for token, (start, stop), special in zip(tokens, encoded["offset_mapping"], encoded["special_tokens_mask"],
                                                 strict=True):
            assert token["special"] == bool(special)
            if special:
                assert token["start"] is None and token["text"] in tokenizer.all_special_tokens
            else:  # byte offsets into the UTF-8 text, as TEI gives them
                assert (token["start"], token["stop"]) == (len(text[:start].encode()), len(text[:stop].encode()))
                assert token["text"] == text[start:stop]
    bare = _ok(_post(server, "/tokenize", {"inputs": "café", "add_special_tokens": False}))
    assert [token["id"] for token in bare[0]] == tokenizer("café", add_special_tokens=False)["input_ids"]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert _ok(_post(server, "/decode", {"ids": ids})) == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert _ok(_post(server, "/decode", {"ids": ids[0], "skip_special_tokens": False})) == [tokenizer.decode(ids[0])]


def test_info_describes_the_model(server, minilm_engine):
    info = _ok(requests.get(f"http://{server.http_url}/info", timeout=10))
    assert info["model_id"] == "minilm" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["max_input_length"] == sentence_transformers_length()
    assert info["max_batch_tokens"] == 2048 and info["auto_truncate"] is False
    assert requests.get(f"http://{server.http_url}/ping", timeout=10).json() == {"status": "ready"}


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/embed", {"inputs": "hi", "normalize": False}, "normalize=false is not available: 'minilm' normalises"),
    ("/embed", {"inputs": "hi", "prompt_name": "query"}, "'query' is not one of the prompts of 'minilm': none"),
    ("/", {"inputs": "hi", "truncation_direction": "up"}, "truncation_direction must be 'right' or 'left', got 'up'"),
    ("/embed", {"inputs": []}, "inputs must be a string, a list of strings"),
    ("/embed", {"inputs": "hi", "dimensions": 0}, "dimensions must be a positive integer"),
    ("/embed", {"inputs": "hi", "dimensions": 385}, "dimensions is 385, over this model's 384"),
    ("/embed_all", {"input": "hi"}, "the body needs 'inputs'"),
    ("/tokenize", {"inputs": [3]}, "inputs must be a text or a non-empty list of texts"),
    ("/tokenize", {"inputs": ["ok", "a\ud800"]}, "inputs[1] is not UTF-8 text: surrogates not allowed at 1"),
    ("/embed", {"inputs": ["ok", "a\ud800"]}, "element 1 is not UTF-8"),
    ("/decode", {"ids": [[101], [30522]]}, "ids[1][0] is 30522, outside the vocabulary [0, 30522)"),
    ("/decode", {"ids": "101"}, "ids must be a list of token ids"),
    ("/embed", {"inputs": "hi", "model": "nope"}, "unknown model 'nope'"),
    ("/similarity", {"inputs": {"source_sentence": "hi", "sentences": []}}, "with at least one sentence"),
    ("/similarity", {"inputs": {"source_sentence": "hi", "sentences": ["a"]}, "parameters": {"prompt_name": "q"}},
     "'q' is not one of the prompts of 'minilm': none"),
], ids=lambda value: value if isinstance(value, str) and value.startswith("/") else None)
def test_errors_name_what_was_wrong_in_tei_shape_and_the_server_keeps_serving(server, path, body, field):
    answer = _post(server, path, body)
    assert answer.status_code in (400, 404), answer.text
    assert set(answer.json()) == {"error", "error_type"} and field in answer.json()["error"]
    assert answer.json()["error_type"] == "Validation"
    assert len(_ok(_post(server, "/embed", {"inputs": "still serving"}))) == 1


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_text_over_the_maximum_is_refused_unless_truncated_from_the_side_asked(server, minilm_engine, direction):
    from transformers import AutoTokenizer

    long_text = " ".join(f"w{index}" for index in range(minilm_engine.max_seq_len))  # over 512 tokens
    refused = _post(server, "/embed", {"inputs": [SENTENCES[0], long_text], "truncation_direction": direction})
    assert refused.status_code == 413 and "text 1 has" in refused.json()["error"]
    truncated = _ok(_post(server, "/embed", {"inputs": [SENTENCES[0], long_text], "truncate": True,
                                             "truncation_direction": direction}))
    reference = AutoTokenizer.from_pretrained(str(default_model_folder()), truncation_side=direction)
    ids = reference([long_text], truncation=True, max_length=sentence_transformers_length())["input_ids"]
    np.testing.assert_allclose(truncated[1], _ok(_post(server, "/embed", {"inputs": ids}))[0], atol=SAME)


def test_token_ids_obey_the_text_bound_too(server, minilm_engine):
    """Ids past sentence-transformers' bound but within the positions are refused as a text of
    that many tokens is, on TEI's route and OpenAI's; /info reports the same bound."""
    bound = sentence_transformers_length()
    assert bound < minilm_engine.max_seq_len
    ids = [101] + [2000] * bound + [102]
    refused = _post(server, "/embed", {"inputs": [ids]})
    assert refused.status_code == 413 and f"has {bound + 2} tokens, over the model's maximum of {bound}" in refused.text
    openai = requests.post(f"http://{server.http_url}/v1/embeddings", json={"model": "minilm", "input": [ids]},
                           timeout=30)
    assert openai.status_code == 413 and f"maximum of {bound}" in openai.text
    assert len(_ok(_post(server, "/embed", {"inputs": [ids], "truncate": True}))) == 1


# ---------------------------------------------------------------------------- normalize


PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def unnormalised(tmp_path_factory, cache_dir: Path):
    """A small random checkpoint saved by sentence-transformers with two prompts: mean pooling,
    no Normalize module."""
    from sentence_transformers import SentenceTransformer

    config = BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=80, max_position_embeddings=64)
    root = tmp_path_factory.mktemp("tei")
    model = SentenceTransformer(str(materialize_random_bert(config, root / "random", seed=5, std=0.3)), device="cpu")
    model.prompts = PROMPTS
    folder = root / "plain"
    model.save(str(folder))
    assert json.loads((folder / "config_sentence_transformers.json").read_text())["prompts"] == PROMPTS
    process = ServerProcess(compile_artifact(CompileRequest(model=str(folder), max_batch=4), cache_dir),
                            model_name="plain")
    yield folder, process
    process.stop()


def test_normalize_is_applied_as_tei_applies_it(unnormalised):
    folder, server = unnormalised
    tokenizer = _tokenizer()
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="np")
    hidden = reference_hidden(reference_model(folder), encoded["input_ids"], encoded["attention_mask"],
                              encoded["token_type_ids"]).astype(np.float64)
    mask = encoded["attention_mask"][..., None]
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    assert not np.allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-2)  # so normalising shows

    def unit(rows: np.ndarray) -> np.ndarray:
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    np.testing.assert_allclose(_ok(_post(server, "/embed", {"inputs": SENTENCES})), unit(pooled), atol=REFERENCE_ATOL)
    raw = _ok(_post(server, "/embed", {"inputs": SENTENCES, "normalize": False}))
    np.testing.assert_allclose(raw, pooled, atol=REFERENCE_ATOL)
    short = _ok(_post(server, "/embed", {"inputs": SENTENCES, "dimensions": 8}))
    np.testing.assert_allclose(short, unit(pooled[:, :8]), atol=REFERENCE_ATOL)
    np.testing.assert_allclose(_openai(server, SENTENCES), pooled, atol=REFERENCE_ATOL)  # OpenAI's: as the model is


def test_prompt_name_prefixes_texts_as_sentence_transformers_does(unnormalised):
    from sentence_transformers import SentenceTransformer

    folder, server = unnormalised
    reference = SentenceTransformer(str(folder), device="cpu")
    expected = reference.encode(SENTENCES, prompt_name="query", convert_to_numpy=True)
    ours = _ok(_post(server, "/embed", {"inputs": SENTENCES, "prompt_name": "query", "normalize": False}))
    np.testing.assert_allclose(ours, expected, atol=REFERENCE_ATOL)
    assert not np.allclose(ours, _ok(_post(server, "/embed", {"inputs": SENTENCES, "normalize": False})), atol=1e-3)
    tokens = _ok(_post(server, "/tokenize", {"inputs": "Hi", "prompt_name": "passage"}))[0]
    assert [token["id"] for token in tokens] == _tokenizer()("passage: Hi")["input_ids"]
    unknown = _post(server, "/embed", {"inputs": "Hi", "prompt_name": "document"})
    assert unknown.status_code == 400
    assert "'document' is not one of the prompts of 'plain': 'passage', 'query'" in unknown.json()["error"]
    ids = _post(server, "/embed", {"inputs": [101, 7632, 102], "prompt_name": "query"})
    assert ids.status_code == 400 and "token ids are run as given" in ids.json()["error"]
