"""A decoder's sequence classifiers: a one-label ``Qwen3ForSequenceClassification`` (Qwen3-Reranker
converted to one, as sentence-transformers' CrossEncoder reads it) scoring each pair's last token
that is not its padding, and a ``Qwen3ForCausalLM`` made one by ``--classifier-from-tokens``
(Qwen3-Reranker's own checkpoints: the softmax of two tokens' logits), reading its pairs through
a prompt (``--pair-template``), against transformers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.checkpoint import Checkpoint, CheckpointError
from dietserve.model.tokenizer import PairTemplate, TokenizerError, read_pair_template
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import artifact_tokenizer
from dietserve.runtime.engine import Engine
from dietserve.runtime.errors import InputError, InputTooLong

from .test_decoder_embedders import _qwen3_config
from .test_encoder_families import PAIRS, _tokenizer_folder, cross_encoder_matches


def _qwen3_reranker(folder: Path, cache_dir: Path, layout: str, **config) -> Engine:
    """A Qwen3ForSequenceClassification with one label (Qwen3-Reranker converted to one, as
    sentence-transformers' CrossEncoder reads it), its norms varied, compiled in ``layout``."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    _tokenizer_folder(folder)
    torch.manual_seed(47)
    model = Qwen3ForSequenceClassification(_qwen3_config(folder, num_labels=1, **config)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8, layout=layout),
                                                 cache_dir)))


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_qwen3_reranker_matches_transformers_and_cross_encoder(tmp_path: Path, cache_dir: Path,
                                                                 layout: str) -> None:
    """The score of each pair's last token, as transformers' and CrossEncoder's."""
    from transformers import Qwen3ForSequenceClassification

    folder = tmp_path / "qwen3-reranker"
    cross_encoder_matches(folder, _qwen3_reranker(folder, cache_dir, layout), Qwen3ForSequenceClassification)


def test_a_qwen3_reranker_skips_a_last_token_that_is_its_padding(tmp_path: Path, cache_dir: Path) -> None:
    """Where the padding token ends each text (here ``</s>``, as Qwen3's ``<|endoftext|>`` can),
    the head reads the token before it, as transformers' rule does (one pair at a time there:
    its rule reads padding slots as text where the tokenizer pads with another token)."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    folder = tmp_path / "qwen3-reranker"
    engine = _qwen3_reranker(folder, cache_dir, "packed", pad_token_id=2)
    encoded = artifact_tokenizer(engine).encode(PAIRS)
    assert (encoded.input_ids[np.arange(len(PAIRS)), encoded.attention_mask.sum(axis=1) - 1] == 2).all()
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    reference = Qwen3ForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    expected = []
    with torch.no_grad():
        for ids, mask in zip(encoded.input_ids, encoded.attention_mask, strict=True):
            expected.append(reference(input_ids=torch.from_numpy(ids[mask == 1][None])).logits[0].numpy())
        last = reference(input_ids=torch.from_numpy(encoded.input_ids[:1, :encoded.attention_mask[0].sum()]),
                         output_hidden_states=True).hidden_states[-1][0, -1]
    np.testing.assert_allclose(output.logits, expected, rtol=0, atol=1e-4)
    assert abs(float(reference.score(last)[0]) - expected[0][0]) > 1e-3  # (the last token's score differs)


@pytest.mark.parametrize("tied", [False, True])
def test_a_causal_lm_scores_by_its_yes_and_no_tokens(tmp_path: Path, cache_dir: Path, tied: bool) -> None:
    """``--classifier-from-tokens no,yes`` (Qwen3-Reranker's own checkpoints: a Qwen3ForCausalLM
    whose answer token is scored): the sigmoid of the one logit against the softmax over the two
    tokens' logits at each pair's last token in transformers, from ``lm_head`` or, tied, the
    word embeddings."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    folder = _tokenizer_folder(tmp_path / "qwen3-reranker-lm")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    no, yes = tokenizer.convert_ids_to_tokens([7, 11])
    torch.manual_seed(59)
    Qwen3ForCausalLM(_qwen3_config(folder, tie_word_embeddings=tied)).eval().save_pretrained(str(folder))
    request = CompileRequest(model=str(folder), max_batch=8, classifier_tokens=(no, yes))
    engine = Engine(load_artifact(compile_artifact(request, cache_dir)))
    assert list(engine.labels) == [yes] and engine.artifact.manifest.build["classifier_tokens"] == [no, yes]
    encoded = artifact_tokenizer(engine).encode(PAIRS)
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    reference = Qwen3ForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask)).logits
    last = logits[torch.arange(len(PAIRS)), torch.from_numpy(encoded.attention_mask.sum(axis=1) - 1)]
    expected = torch.softmax(last[:, [7, 11]], dim=-1)[:, 1].numpy()
    assert expected.std() > 1e-3
    np.testing.assert_allclose(1 / (1 + np.exp(-output.logits[:, 0])), expected, rtol=0, atol=1e-5)


def test_classifier_tokens_are_refused_where_they_cannot_score(tmp_path: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from dietserve.model.presets import default_model_folder

    folder = _tokenizer_folder(tmp_path / "qwen3-lm")
    torch.manual_seed(61)
    Qwen3ForCausalLM(_qwen3_config(folder)).save_pretrained(str(folder))
    with pytest.raises(CheckpointError, match="'nope' is not a token of"):
        Checkpoint.open(folder).with_classifier_from_tokens("nope", "</s>")
    with pytest.raises(CheckpointError, match="a bert embedding checkpoint; a decoder language model"):
        Checkpoint.open(default_model_folder()).with_classifier_from_tokens("no", "yes")


def test_a_reranker_reads_each_pair_through_its_prompt(tmp_path: Path, cache_dir: Path) -> None:
    """``--pair-template``: each pair read as the prefix, the filled-in pair and the suffix, the
    filled-in part cut where the whole is too long (the suffix, which the scored answer follows,
    kept), against transformers on prompts built as Qwen3-Reranker's own code builds them."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    folder = _tokenizer_folder(tmp_path / "prompted-lm")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    no, yes = tokenizer.convert_ids_to_tokens([7, 11])
    torch.manual_seed(67)
    Qwen3ForCausalLM(_qwen3_config(folder)).eval().save_pretrained(str(folder))
    # (no space at a part's ends: transformers' XLM-R tokenizer class, this test's, strips it; Qwen's keeps it)
    template = {"prefix": "<s>Judge the Document.", "pair": "Query: {query} Document: {document}", "suffix": "Answer:"}
    request = CompileRequest(model=str(folder), max_batch=8, classifier_tokens=(no, yes), pair_template=template)
    engine = Engine(load_artifact(compile_artifact(request, cache_dir)))
    pairs = [*PAIRS, ("How many people live in {Berlin}?", "Berlin has a population of 3,520,031. " * 30)]
    prefix, suffix = (tokenizer.encode(template[part], add_special_tokens=False) for part in ("prefix", "suffix"))
    bodies = tokenizer([f"Query: {query} Document: {document}" for query, document in pairs], add_special_tokens=False,
                       truncation=True, max_length=engine.max_seq_len - len(prefix) - len(suffix))["input_ids"]
    expected_ids = [prefix + body + suffix for body in bodies]
    assert len(expected_ids[-1]) == engine.max_seq_len and prefix[0] == 0  # (cut; "<s>" read as its token)
    encoded = artifact_tokenizer(engine).encode(pairs)
    assert [row[mask == 1].tolist() for row, mask in zip(encoded.input_ids, encoded.attention_mask, strict=True)] == (
        expected_ids)
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    reference = Qwen3ForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = [torch.softmax(reference(input_ids=torch.tensor([ids])).logits[0, -1, [7, 11]], dim=-1)[1].item()
                    for ids in expected_ids]
    np.testing.assert_allclose(1 / (1 + np.exp(-output.logits[:, 0])), expected, rtol=0, atol=1e-5)
    with pytest.raises(InputError, match="text 0: this model scores .* pairs through its pair template"):
        artifact_tokenizer(engine).encode(["a lone text"])
    with pytest.raises(InputTooLong, match="pair 1 has"):
        artifact_tokenizer(engine).encode([pairs[0], pairs[-1]], truncate=False)


def test_a_pair_template_is_checked_and_fills_in_one_pass() -> None:
    from dietserve.model.presets import default_model_folder

    template = PairTemplate.from_dict({"pair": "{document} | {query}"}, "here")
    assert template.filled("q {document}", "d {query}") == "d {query} | q {document}"
    for raw, message in (({"pair": "{query} only"}, "{document} once each"), ({"pair": "{query}{document}", "x": ""},
                                                                             "a JSON object with 'pair'"),
                         ({"pair": "{query}{document}", "prefix": 1}, "must be strings")):
        with pytest.raises(TokenizerError, match=re.escape(message)):
            PairTemplate.from_dict(raw, "here")
    assert read_pair_template("qwen3-reranker").suffix.endswith("</think>\n\n")
    assert read_pair_template('{"pair": "{query}: {document}"}').pair == "{query}: {document}"
    with pytest.raises(CheckpointError, match="an embedding model; a pair template"):
        Checkpoint.open(default_model_folder()).with_pair_template(template)
    from tokenizers import Tokenizer

    from dietserve.model.tokenizer import TextTokenizer

    words = Tokenizer.from_file(str(default_model_folder() / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="prefix and suffix take 6 tokens, leaving none of the 6"):
        TextTokenizer(words, 6, pair_template=PairTemplate("{query}{document}", "one two three", "four five six"))
