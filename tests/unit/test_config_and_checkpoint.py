"""Config parsing and checkpoint conversion, on small synthetic checkpoints (no TVM build)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dietserve.model.bert import BertModel, PoolingOptions, export_relax, transposed_weight_names
from dietserve.model.checkpoint import Checkpoint, CheckpointError, load_parameters
from dietserve.model.config import BertConfig, ModelConfigError
from dietserve.model.presets import random_hf_weights
from dietserve.model.side_by_side import side_by_side

TINY = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=16, max_position_embeddings=12)


def test_config_reads_checkpoint_options() -> None:
    config = BertConfig.from_dict({"model_type": "bert", "hidden_size": 384, "num_attention_heads": 12,
                                   "hidden_act": "gelu_new", "layer_norm_eps": 1e-5, "unknown_key": 3})
    assert (config.hidden_size, config.head_dim) == (384, 32)
    assert (config.hidden_act, config.layer_norm_eps) == ("gelu_new", 1e-5)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"hidden_act": "mish"}, "hidden_act='mish' is not supported"),
        ({"hidden_size": 100, "num_attention_heads": 12}, "not divisible"),
        ({"model_type": "deberta-v2"}, "model_type='deberta-v2' is not supported; .* bert, roberta, xlm-roberta"),
        ({"model_type": "modernbert", "rope_parameters": {"full_attention": {"rope_type": "yarn"}}},
         "scaled rotary positions"),
        ({"model_type": "modernbert", "classifier_pooling": "max"}, "classifier_pooling='max' is not supported"),
        ({"model_type": "xlm-roberta", "max_position_embeddings": 2}, "leaves no position after the 2"),
        ({"position_embedding_type": "relative_key"}, "only 'absolute'"),
        ({"num_hidden_layers": 0}, "must be positive"),
    ],
)
def test_config_rejects_what_we_cannot_run(raw: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        BertConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta", "camembert"])
def test_roberta_positions_start_past_the_padding_index(model_type: str) -> None:
    """transformers numbers a RoBERTa token's position from ``pad_token_id + 1`` (its default
    pad id 1): a 514-row table holds 512 tokens."""
    config = BertConfig.from_dict({"model_type": model_type, "max_position_embeddings": 514})
    assert (config.pad_token_id, config.position_offset, config.max_length) == (1, 2, 512)
    bert = BertConfig.from_dict({"max_position_embeddings": 512})
    assert (bert.model_type, bert.position_offset, bert.max_length) == ("bert", 0, 512)


def test_distilbert_config_reads_as_berts() -> None:
    """DistilBERT's own key names, its defaults where a key is missing, one token type, its fixed
    LayerNorm epsilon and its classifier head's ReLU."""
    config = BertConfig.from_dict({"model_type": "distilbert", "dim": 64, "n_heads": 4, "hidden_dim": 128,
                                   "activation": "relu", "vocab_size": 100, "hidden_size": 999})
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size, config.hidden_act) == \
        (64, 4, 128, "relu")
    assert (config.num_hidden_layers, config.type_vocab_size, config.layer_norm_eps) == (6, 1, 1e-12)
    assert (config.pooler_activation, BertConfig().pooler_activation) == ("relu", "tanh")
    assert config.position_offset == 0 and config.max_length == 512


def test_mpnet_config_has_relative_buckets_and_roberta_positions() -> None:
    config = BertConfig.from_dict({"model_type": "mpnet", "max_position_embeddings": 514, "pad_token_id": 0})
    assert (config.relative_attention_num_buckets, config.type_vocab_size) == (32, 1)
    assert (config.position_offset, config.max_length) == (2, 512)  # transformers' padding index 1, not the config's


def test_modernbert_config_reads_either_format() -> None:
    """Hub configs written before transformers 5 name the layer pattern and the rotary bases by
    ``global_attn_every_n_layers``, ``global_rope_theta``, ``local_rope_theta``; transformers' own
    config saves ``layer_types`` and ``rope_parameters``. Both read the same."""
    from transformers import ModernBertConfig

    older = {"model_type": "modernbert", "num_hidden_layers": 22, "global_attn_every_n_layers": 3,
             "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128,
             "hidden_activation": "gelu", "norm_eps": 1e-5, "norm_bias": False, "attention_bias": False,
             "mlp_bias": False, "max_position_embeddings": 8192, "vocab_size": 50368, "intermediate_size": 1152}
    ours = BertConfig.from_dict(older)
    theirs = BertConfig.from_dict(json.loads(ModernBertConfig().to_json_string()))
    assert ours == theirs
    assert ours.layer_types[:4] == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    assert dict(ours.rope_thetas) == {"full_attention": 160000.0, "sliding_attention": 10000.0}
    assert (ours.sliding_window, ours.max_length, ours.position_offset, ours.type_vocab_size) == (64, 8192, 0, 1)
    assert ours.rotary and ours.score_bias and not (ours.norm_bias or ours.linear_bias)
    # (the other families' configs, hence their manifests and cache keys, read as before)
    assert set(BertConfig().to_dict()) == {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size", "hidden_act", "max_position_embeddings",
                                           "type_vocab_size", "layer_norm_eps", "pad_token_id", "model_type",
                                           "relative_attention_num_buckets"}


# nomic-embed-text-v1.5's config.json as on the Hub: the original GPT-2-style keys (the options
# that do not change the arithmetic left out)
NOMIC_EMBED_V15 = {"model_type": "nomic_bert", "activation_function": "swiglu", "n_embd": 768, "n_head": 12,
                   "n_inner": 3072, "n_layer": 12, "n_positions": 8192, "max_trained_positions": 2048,
                   "layer_norm_epsilon": 1e-12, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False,
                   "qkv_proj_bias": False, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
                   "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "type_vocab_size": 2,
                   "vocab_size": 30528, "pad_vocab_size_multiple": 64, "causal": False}


def test_nomic_bert_config_reads_either_format() -> None:
    """The original keys read as transformers' NomicBertConfig with the same sizes; with a rotary
    scaling factor (dynamic NTK past the trained length) the positions end at the trained length."""
    from transformers import NomicBertConfig

    ours = BertConfig.from_dict(NOMIC_EMBED_V15)
    assert ours == BertConfig.from_dict(json.loads(NomicBertConfig(max_position_embeddings=8192).to_json_string()))
    assert (ours.hidden_act, ours.max_length, dict(ours.rope_thetas), ours.type_vocab_size) == (
        "silu", 8192, {"full_attention": 1000.0}, 2)
    assert ours.rotary and not ours.score_bias and not ours.linear_bias and ours.norm_bias
    scaled = BertConfig.from_dict({**NOMIC_EMBED_V15, "rotary_scaling_factor": 2.0})
    assert scaled.max_length == 2048


def test_gte_config_reads_either_format() -> None:
    """gte-multilingual-base's original config (model_type ``new``) reads as transformers'
    GteConfig; gte-base-en-v1.5's lack of token types reads as one type."""
    from transformers import GteConfig

    original = {"model_type": "new", "architectures": ["NewModel"], "hidden_size": 768, "num_hidden_layers": 12,
                "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
                "max_position_embeddings": 8192, "type_vocab_size": 1, "layer_norm_eps": 1e-12,
                "vocab_size": 250048, "pad_token_id": 1, "position_embedding_type": "rope", "rope_theta": 160000,
                "rope_scaling": None, "layer_norm_type": "layer_norm", "logn_attention_scale": False,
                "logn_attention_clip1": False, "pack_qkv": True, "unpad_inputs": True}
    ours = BertConfig.from_dict(original)
    assert ours == BertConfig.from_dict(json.loads(GteConfig().to_json_string()))
    assert (ours.model_type, ours.hidden_act, dict(ours.rope_thetas), ours.max_length) == (
        "gte", "gelu", {"full_attention": 160000.0}, 8192)
    assert ours.post_norm_rotary and ours.linear_bias and not ours.score_bias
    assert BertConfig.from_dict({**original, "type_vocab_size": 0}).type_vocab_size == 1
    english = BertConfig.from_dict({**original, "rope_scaling": {"type": "ntk", "factor": 2.0}, "rope_theta": 500000})
    assert (english.rope_ntk_factor, dict(english.rope_thetas)) == (2.0, {"full_attention": 500000.0})
    assert "rope_ntk_factor" not in ours.to_dict() and english.to_dict()["rope_ntk_factor"] == 2.0


def test_the_plain_decoders_configs_read_as_transformers_defaults_them() -> None:
    """Qwen2's, Mistral's and Llama's configs at transformers' defaults read as the same model
    whether or not the defaults are written out; gte-Qwen2-1.5B-instruct's config (the Hub's: its
    own modeling code named, no ``is_causal``) is refused until ``is_causal`` says which."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    for theirs in (Qwen2Config(), MistralConfig(), LlamaConfig()):
        written = BertConfig.from_dict(json.loads(theirs.to_json_string()))
        assert written == BertConfig.from_dict({"model_type": theirs.model_type})
        assert (written.hidden_size, written.num_hidden_layers, written.kv_heads, written.vocab_size) == (
            theirs.hidden_size, theirs.num_hidden_layers, theirs.num_key_value_heads, theirs.vocab_size)
        assert written.causal and written.head_dim == theirs.hidden_size // theirs.num_attention_heads
    assert BertConfig.from_dict({"model_type": "mistral"}).sliding_window == 4095  # (MistralConfig's 4,096)
    gte_qwen2 = {"architectures": ["Qwen2Model"], "auto_map": {
        "AutoModel": "Alibaba-NLP/gte-Qwen2-1.5B-instruct--modeling_qwen.Qwen2Model"}, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960,
        "max_position_embeddings": 131072, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12,
        "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151646}
    with pytest.raises(ModelConfigError, match="add \"is_causal\": false or true"):
        BertConfig.from_dict(gte_qwen2)
    ours = BertConfig.from_dict({**gte_qwen2, "is_causal": False})
    assert (ours.bidirectional, ours.causal, ours.kv_heads, ours.head_dim, ours.linear_bias) == (
        True, False, 2, 128, True)
    assert dict(ours.rope_thetas) == {"full_attention": 1000000.0} and ours.layer_norm_eps == 1e-6


def test_modernbert_rotary_tables_are_transformers() -> None:
    """cos and sin at every position of both layer kinds against transformers' rotary embedding."""
    import torch
    from transformers import ModernBertConfig
    from transformers.models.modernbert.modeling_modernbert import ModernBertRotaryEmbedding

    from dietserve.model.modernbert import rotary_tables

    config = ModernBertConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=8192)
    rotary = ModernBertRotaryEmbedding(config)
    positions = torch.arange(8192)[None]
    for kind, theta in BertConfig.from_dict(json.loads(config.to_json_string())).rope_thetas:
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
        ours = rotary_tables(theta, 64, 8192)
        np.testing.assert_allclose(ours[0], cos[0].numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(ours[1], sin[0].numpy(), rtol=0, atol=2e-6)


def _write_checkpoint(folder: Path, weights: dict[str, np.ndarray], config: BertConfig = TINY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", **config.to_dict()}))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_linear_weights_are_transposed_and_prefixes_stripped(tmp_path: Path) -> None:
    hf = random_hf_weights(TINY, seed=3)
    prefixed = {f"bert.{name}": tensor for name, tensor in hf.items()}
    prefixed["bert.embeddings.LayerNorm.gamma"] = prefixed.pop("bert.embeddings.LayerNorm.weight")
    checkpoint = Checkpoint.open(_write_checkpoint(tmp_path / "ck", prefixed))
    model = BertModel(TINY, PoolingOptions())
    _, expected = export_relax(model, max_batch=2)
    params = load_parameters(checkpoint, model, expected)
    qkv = "encoder.layer.0.attention.self.qkv.weight"
    assert qkv in transposed_weight_names(model)
    layer = "encoder.layer.0.attention.self"
    np.testing.assert_array_equal(  # the query, key and value projections side by side, [in, 3 * out]
        params[qkv], np.concatenate([hf[f"{layer}.{part}.weight"].T for part in ("query", "key", "value")], axis=1))
    np.testing.assert_array_equal(
        params[f"{layer}.qkv.bias"], np.concatenate([hf[f"{layer}.{part}.bias"] for part in ("query", "key", "value")]))
    np.testing.assert_array_equal(params["embeddings.LayerNorm.weight"], hf["embeddings.LayerNorm.weight"])


@pytest.mark.parametrize(
    "key, replacement, message",
    [
        ("encoder.layer.0.output.dense.bias", None, "no tensor 'encoder.layer.0.output.dense.bias'"),
        ("embeddings.word_embeddings.weight", np.zeros((49, 8), np.float32),
         r"'embeddings.word_embeddings.weight' has shape \(49, 8\)"),
        ("encoder.layer.0.attention.self.key.weight", np.zeros((8, 7), np.float32),
         r"attention.self.key.weight.*do not stack side by side"),
    ],
    ids=["missing tensor", "wrong shape", "query, key and value that do not stack"],
)
def test_bad_checkpoint_tensor_is_named(tmp_path: Path, key: str, replacement, message: str) -> None:
    """``replacement`` None: the tensor is left out."""
    hf = random_hf_weights(TINY, seed=3)
    if replacement is None:
        del hf[key]
    else:
        hf[key] = replacement
    checkpoint = Checkpoint.open(_write_checkpoint(tmp_path / "ck", hf))
    model = BertModel(TINY, PoolingOptions())
    _, expected = export_relax(model, max_batch=2)
    with pytest.raises(CheckpointError, match=message):
        load_parameters(checkpoint, model, expected)


def test_side_by_side_transposes_then_concatenates() -> None:
    rng = np.random.default_rng(0)
    query, key = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    fused = side_by_side([query, key], transposed=True)
    assert fused.dtype == np.float32 and fused.flags.c_contiguous
    np.testing.assert_array_equal(fused, np.hstack([query.T, key.T]).astype(np.float32))
    np.testing.assert_array_equal(side_by_side([query], transposed=False), query.astype(np.float32))


def test_folder_without_weights_is_explained(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint.open(tmp_path)


def test_sentence_transformers_normalize_module_is_detected(tmp_path: Path) -> None:
    folder = _write_checkpoint(tmp_path / "st", random_hf_weights(TINY, seed=1))
    assert not Checkpoint.open(folder).pooling.normalize
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps(modules))
    assert Checkpoint.open(folder).pooling.normalize


def test_random_weights_are_seeded() -> None:
    a, b, c = (random_hf_weights(TINY, seed) for seed in (5, 5, 6))
    name = "encoder.layer.0.intermediate.dense.weight"
    np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a[name], c[name])
    assert a[name].shape == (16, 8)  # stored [out, in] as Hugging Face does


def test_a_capped_length_keeps_the_first_positions_past_the_offset(tmp_path: Path) -> None:
    """``--max-seq-len``: RoBERTa's table rows for positions 0..N-1 are those past its padding
    index; a cap beyond the model's last position is refused."""
    config = dataclasses.replace(TINY, model_type="roberta", pad_token_id=1)
    hf = random_hf_weights(config, seed=3)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save_file(hf, str(folder / "model.safetensors"))
    checkpoint = Checkpoint.open(folder).with_max_length(5)
    assert checkpoint.config.max_length == 5
    model = BertModel(checkpoint.config, PoolingOptions())
    params = load_parameters(checkpoint, model, export_relax(model, max_batch=2)[1])
    np.testing.assert_array_equal(params["embeddings.position_embeddings.weight"],
                                  hf["embeddings.position_embeddings.weight"][2:7])
    with pytest.raises(CheckpointError, match=f"positions end at {TINY.max_position_embeddings - 2} tokens"):
        Checkpoint.open(folder).with_max_length(TINY.max_position_embeddings - 1)
