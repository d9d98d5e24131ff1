"""BERT encoder defined in Relax (``tvm.relax.frontend.nn``), dynamic in batch and sequence.

Attribute names mirror Hugging Face's ``BertModel`` so checkpoint tensors map one to one.
Three layout choices differ from the checkpoint, all for the matmul kernels:
- between attention blocks the hidden state is 2-D, ``[batch * seq, hidden]``, so every dense
  layer is the one dynamic-shape operator ``[T, K] x [K, N]`` (DietCode's dense task) with a
  single symbolic row count, which tiles cleanly (reshapes are free views);
- linear weights are stored transposed, ``[in, out]``, so the output axis is contiguous and
  vectorises (the checkpoint's ``[out, in]`` is transposed once at load time);
- keys are permuted to ``[batch, heads, head_dim, seq]`` before the score matmul, so both
  attention batch-matmuls read their second operand along its contiguous axis;
- the query, key and value projections are one linear layer, ``qkv`` (their weights side by
  side, ``[hidden, 3 * hidden]``, concatenated at load time): one pass over the input and one
  kernel streaming 7 MB of weights instead of three streaming 2.4 MB (the weight stream bounds
  short sequences).

``forward`` runs ``[batch, seq]`` rows, padding masked (``PaddedAttention``); ``forward_packed``
runs the attended tokens of every row one after another, ``[T, hidden]`` with no padded work,
each sequence attending to itself in one kernel (``PackedAttention``); the layers are the same.
The parts both this encoder and ModernBERT's are built from live in ``layers.py``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import DISTILBERT, MODERNBERT, SLIDING_ATTENTION, BertConfig
from .decoders import DecoderEmbeddings, DecoderEncoder
from .heads import ClassifierOptions, PoolingOptions, SentencePooling, SpladeHead, pool
from .layers import (
    MASK_FILL,
    Embedding,
    PackedAttention,
    PaddedAttention,
    TransposedLinear,
    activation,
    bias_by_distance,
)
from .modernbert import ModernBertEmbeddings, ModernBertEncoder, ModernBertPredictionHead
from .rotary_bert import RotaryBertEncoder


class BertEmbeddings(nn.Module):
    """Words, token types and positions summed, then LayerNorm; no position table where the
    layers rotate by position (NomicBERT, GTE) or bias the scores by distance (JinaBERT)."""

    def __init__(self, cfg: BertConfig):
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        # (RoBERTa: rows past its offset)
        self.position_embeddings = None if cfg.rotary or cfg.alibi else Embedding(cfg.max_length, cfg.hidden_size)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: nn.Tensor, token_type_ids: nn.Tensor, position_ids: nn.Tensor) -> nn.Tensor:
        """``[batch, seq]`` ids with ``[seq]`` positions (they broadcast over the batch without
        materialising it), or packed ``[T]`` ids and positions; ``[rows, hidden]`` out."""
        summed = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            summed = summed + self.position_embeddings(position_ids)
        if len(input_ids.shape) == 1:
            return self.LayerNorm(summed)
        batch, seq = input_ids.shape
        return self.LayerNorm(op.reshape(summed, (batch * seq, summed.shape[-1])))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.qkv = TransposedLinear(cfg.hidden_size, 3 * cfg.hidden_size, parts=("query", "key", "value"))

    def forward(self, hidden: nn.Tensor, attention: PaddedAttention | PackedAttention) -> nn.Tensor:
        return attention(self.qkv(hidden), self.num_heads, self.head_dim)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.dense = TransposedLinear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, attended: nn.Tensor, residual: nn.Tensor) -> nn.Tensor:
        return self.LayerNorm(self.dense(attended) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, hidden: nn.Tensor, attention: PaddedAttention | PackedAttention) -> nn.Tensor:
        return self.output(self.self(hidden, attention), hidden)


class BertIntermediate(nn.Module):
    """``act(dense(x))``; JinaBERT's gated form ``act(gate(x)) * up(x)``, its gate and up
    projections one dense layer (the checkpoint's ``mlp.gated_layers``, gate first)."""

    def __init__(self, cfg: BertConfig):
        self.gated = cfg.alibi
        self.dense = TransposedLinear(cfg.hidden_size, cfg.intermediate_size * (2 if self.gated else 1))
        self.hidden_act = cfg.hidden_act

    def forward(self, hidden: nn.Tensor) -> nn.Tensor:
        if not self.gated:
            return activation(self.dense(hidden), self.hidden_act)
        gate, up = op.split(self.dense(hidden), 2, axis=-1)
        return activation(gate, self.hidden_act) * up


class BertOutput(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.dense = TransposedLinear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, intermediate: nn.Tensor, residual: nn.Tensor) -> nn.Tensor:
        return self.LayerNorm(self.dense(intermediate) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, hidden: nn.Tensor, attention: PaddedAttention | PackedAttention) -> nn.Tensor:
        attended = self.attention(hidden, attention)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.layer = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        # MPNet's bias by relative position, shared by every layer: ``relative_bias[h, j - i +
        # max_length - 1]`` for query i and key j (its buckets' values spread over every distance at
        # load); JinaBERT's ALiBi in the same table
        self.relative_bias = None
        if cfg.relative_attention_num_buckets or cfg.alibi:
            self.relative_bias = nn.Parameter((cfg.num_attention_heads, 2 * cfg.max_length - 1), "float32")

    def position_bias(self, position_ids: nn.Tensor) -> nn.Tensor | None:
        """``[1, heads, seq, seq]``: each head's bias for each query and key of ``[seq]``
        positions; None without one."""
        return None if self.relative_bias is None else bias_by_distance(self.relative_bias, position_ids)

    def forward(self, hidden: nn.Tensor, attention: PaddedAttention | PackedAttention) -> nn.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, attention)
        return hidden


class BertPooler(nn.Module):
    """Hugging Face's pooler: ``tanh(dense(hidden[:, 0]))``, the [CLS] row whatever the mask
    (DistilBERT's ``pre_classifier``: a ReLU in place of the tanh)."""

    def __init__(self, cfg: BertConfig):
        self.dense = TransposedLinear(cfg.hidden_size, cfg.hidden_size)
        self.activation = cfg.pooler_activation

    def forward(self, hidden: nn.Tensor) -> nn.Tensor:
        batch, _, width = hidden.shape
        first = nn.op.wrap_nested(relax.op.strided_slice(hidden._expr, [1], [0], [1]), "cls_row")
        pooled = self.dense(op.reshape(first, (batch, width)))
        return op.tanh(pooled) if self.activation == "tanh" else op.relu(pooled)


class BertModel(nn.Module):
    """Returns ``(last_hidden_state [b, s, h], sentence_embedding [b, e])``, or with a
    ``classifier`` (a sequence-classification checkpoint) ``(last_hidden_state, logits [b, labels])``."""

    def __init__(self, cfg: BertConfig, pooling: PoolingOptions | None = None,
                 classifier: ClassifierOptions | None = None):
        self.config = cfg
        self.pooling = pooling = pooling or PoolingOptions()
        self.classifier_options = classifier
        if cfg.decoder_layers:
            self.embeddings, self.encoder = DecoderEmbeddings(cfg), DecoderEncoder(cfg)
        elif cfg.post_norm_rotary:
            self.embeddings, self.encoder = BertEmbeddings(cfg), RotaryBertEncoder(cfg)
        elif cfg.rotary:
            self.embeddings, self.encoder = ModernBertEmbeddings(cfg), ModernBertEncoder(cfg)
        else:
            self.embeddings = BertEmbeddings(cfg)
            self.encoder = BertEncoder(cfg)
        if classifier is None and pooling.splade is not None:  # (BERT's, RoBERTa's and DistilBERT's families)
            act = cfg.hidden_act if cfg.model_type in ("bert", DISTILBERT) else "gelu"
            self.splade = SpladeHead(cfg.hidden_size, act, cfg.layer_norm_eps, pooling.splade)
        elif classifier is None:
            self.sentence = SentencePooling(pooling)
        elif cfg.decoder_layers:  # named as in the checkpoint: score.* (no bias)
            self.score = TransposedLinear(cfg.hidden_size, classifier.num_labels)
        elif cfg.model_type == MODERNBERT:  # named as in the checkpoint: head.dense.*, head.norm.*, classifier.*
            self.head = ModernBertPredictionHead(cfg)
            self.classifier = TransposedLinear(cfg.hidden_size, classifier.num_labels)
        else:  # named as in the checkpoint: bert.pooler.dense.*, classifier.*
            self.pooler = BertPooler(cfg)
            self.classifier = TransposedLinear(cfg.hidden_size, classifier.num_labels)

    @property
    def output_names(self) -> tuple[str, str]:
        return output_names(self.classifier_options is not None)

    def output_shapes(self) -> dict[str, list[int]]:
        """Each output's shape, -1 where it follows the input (batch, sequence length)."""
        hidden = self.config.hidden_size
        classifier = self.classifier_options
        width = classifier.num_labels if classifier is not None else self.pooling.embedding_size(hidden)
        return dict(zip(self.output_names, ([-1, -1, hidden], [-1, width]), strict=True))

    def forward(
        self,
        input_ids: nn.Tensor,
        attention_mask: nn.Tensor,
        token_type_ids: nn.Tensor,
        position_ids: nn.Tensor,
    ) -> tuple[nn.Tensor, nn.Tensor]:
        batch, seq = input_ids.shape
        mask = op.astype(attention_mask, "float32")
        mask_bias = op.reshape((1.0 - mask) * MASK_FILL, (batch, 1, 1, seq))
        hidden = self.embeddings(input_ids, token_type_ids, position_ids)
        if self.config.rotary:
            biases = {kind: self.encoder.bias(kind) for kind in self.encoder.kinds}
            attention_of = {kind: PaddedAttention(mask_bias, None if bias is None else bias_by_distance(
                bias, position_ids)) for kind, bias in biases.items()}
            hidden = self.encoder(hidden, attention_of, position_ids, batch)
        else:
            hidden = self.encoder(hidden, PaddedAttention(mask_bias, self.encoder.position_bias(position_ids)))
        return self._heads(op.reshape(hidden, (batch, seq, hidden.shape[-1])), mask, position_ids, input_ids)

    def forward_packed(
        self,
        input_ids: nn.Tensor,
        token_type_ids: nn.Tensor,
        position_ids: nn.Tensor,
        starts: nn.Tensor,
        unpack: nn.Tensor,
        attention_mask: nn.Tensor,
        padded_positions: nn.Tensor,
    ) -> tuple[nn.Tensor, nn.Tensor]:
        """The encoder on packed sequences: ``input_ids``, ``token_type_ids``, ``position_ids``
        ``[T]``, every sequence's tokens one after another, ``starts`` ``[B + 1]`` where each
        begins (the last entry T). The hidden state then goes back to the request's ``[B, S]``
        layout, ``unpack[b, s]`` naming the packed row of each slot (T: padding, a zero row), and
        the heads read it with ``attention_mask`` and ``padded_positions`` as ``forward``'s do."""
        hidden = self.embeddings(input_ids, token_type_ids, position_ids)
        if self.config.rotary:
            # (the windowed layers' kernel skips the key tiles their window masks)
            kernels = {kind: (self.packed_attention, "varlen_attention") for kind in self.encoder.kinds}
            if self.windowed_attention is not None:
                kernels[SLIDING_ATTENTION] = (self.windowed_attention, "varlen_attention_window")
            attention_of = {kind: PackedAttention(starts, kernel, self.encoder.bias(kind), name)
                            for kind, (kernel, name) in kernels.items()}
            hidden = self.encoder(hidden, attention_of, position_ids)
        else:
            hidden = self.encoder(hidden, PackedAttention(starts, self.packed_attention, self.encoder.relative_bias))
        batch, seq = unpack.shape
        width = hidden.shape[-1]
        # (a sparse encoder pools its packed rows: the vocabulary's logits of no padding slot)
        sparse = None if self.pooling.splade is None else self.splade.pool_packed(hidden, starts, batch,
                                                                                 self.splade_pool)
        with_zero_row = op.concat([hidden, op.zeros((1, width), "float32")], dim=0)
        rows = nn.op.wrap_nested(relax.op.take(with_zero_row._expr, op.reshape(unpack, (-1,))._expr, axis=0,
                                               mode="clip"), "unpack")
        padded = op.reshape(rows, (batch, seq, width))
        if sparse is not None:
            return padded, sparse
        ids = None
        options = self.classifier_options
        if options is not None and options.pad_token_id is not None:  # (a decoder's head skips its padding id)
            with_pad = op.concat([input_ids, op.zeros((1,), input_ids.dtype)], dim=0)
            ids = op.reshape(nn.op.wrap_nested(relax.op.take(with_pad._expr, op.reshape(unpack, (-1,))._expr, axis=0,
                                                             mode="clip"), "unpack_ids"), (batch, seq))
        return self._heads(padded, op.astype(attention_mask, "float32"), padded_positions, ids)

    def _heads(self, hidden: nn.Tensor, mask: nn.Tensor, position_ids: nn.Tensor,
               input_ids: nn.Tensor | None) -> tuple[nn.Tensor, nn.Tensor]:
        """The head's output from ``hidden [b, s, h]``, the float ``mask`` and positions; a
        decoder's classifier also reads ``input_ids [b, s]``."""
        options = self.classifier_options
        if options is not None and self.config.decoder_layers:
            if options.pad_token_id is not None:
                mask = mask * op.astype(op.not_equal(input_ids, nn.Tensor.from_const(options.pad_token_id)), "float32")
            return hidden, self.score(pool("lasttoken", hidden, mask, op.astype(position_ids, "float32")))
        if options is not None and self.config.model_type == MODERNBERT:
            return hidden, self.classifier(self.head(hidden, mask))
        if options is not None:
            return hidden, self.classifier(self.pooler(hidden))
        if self.pooling.splade is not None:
            batch, seq, width = hidden.shape
            return hidden, self.splade.pool_padded(op.reshape(hidden, (batch * seq, width)), mask)
        return hidden, self.sentence(hidden, mask, op.astype(position_ids, "float32"))


# The symbolic dims every dynamic operator's shapes are expressions of.
SHAPE_VARS = ("batch", "seq_len")
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# A packed model's besides: its tokens (the dense layers' rows) and its sequences' offsets (B + 1).
PACKED_VARS = ("tokens", "segments")
OUTPUT_NAMES = ("last_hidden_state", "sentence_embedding")
CLASSIFIER_OUTPUT_NAMES = ("last_hidden_state", "logits")


def output_names(classifies: bool) -> tuple[str, str]:
    """The compiled function's two outputs, in order."""
    return CLASSIFIER_OUTPUT_NAMES if classifies else OUTPUT_NAMES


def transposed_weight_names(model: nn.Module) -> set[str]:
    """Names of the parameters stored as ``[in, out]`` (checkpoints hold them ``[out, in]``)."""
    return {name for name, param in model.named_parameters() if getattr(param, "stored_transposed", False)}


def checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter's checkpoint tensors: its own name, or (a layer computing several of the
    checkpoint's side by side, ``TransposedLinear.parts``) theirs, concatenated in order along
    the output axis, the last one in our layout."""
    sources = {}
    for name, param in model.named_parameters():
        module, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        parts = getattr(param, "parts", ())
        sources[name] = tuple(f"{module}.{part}.{leaf}" for part in parts) if parts else (name,)
    return sources


def export_relax(model: BertModel, max_batch: int, packed_attention: tvm.tirx.PrimFunc | None = None,
                 windowed_attention: tvm.tirx.PrimFunc | None = None, splade_pool: tvm.tirx.PrimFunc | None = None,
                 ) -> tuple[tvm.IRModule, list[tuple[str, tuple[int, ...]]]]:
    """Export ``model`` to an IRModule whose ``forward`` is symbolic in batch and seq_len; with
    ``packed_attention`` (the target's kernel, ``kernels/cpu_varlen``) ``forward`` is
    ``BertModel.forward_packed``, symbolic in the tokens and sequences as well (``PACKED_INPUTS``);
    ``windowed_attention``: the kernel of ModernBERT's sliding-window layers, if not that one;
    ``splade_pool``: a packed sparse encoder's pooling (``kernels/cpu_varlen/splade_pool.py``).

    Returns ``(irmodule, parameters)`` with ``parameters`` as ``(name, shape)`` in argument
    order; they follow the inputs as function arguments, so weights stay out of the compiled
    library. The symbolic upper bounds let memory planning allocate statically.
    """
    max_len = model.config.max_length
    bounds = {SHAPE_VARS[0]: max_batch, SHAPE_VARS[1]: max_len}
    padded = nn.spec.Tensor(list(SHAPE_VARS), "int64")
    if packed_attention is None:
        inputs = {"input_ids": padded, "attention_mask": padded, "token_type_ids": padded,
                  "position_ids": nn.spec.Tensor([SHAPE_VARS[1]], "int64")}
        method = "forward"
    else:
        # (read by forward_packed as it is traced)
        model.packed_attention, model.windowed_attention = packed_attention, windowed_attention
        model.splade_pool = splade_pool
        tokens = nn.spec.Tensor([PACKED_VARS[0]], "int64")
        inputs = {"input_ids": tokens, "token_type_ids": tokens, "position_ids": tokens,
                  "starts": nn.spec.Tensor([PACKED_VARS[1]], "int64"), "unpack": padded, "attention_mask": padded,
                  "padded_positions": nn.spec.Tensor([SHAPE_VARS[1]], "int64")}
        method = "forward_packed"
        bounds.update({PACKED_VARS[0]: max_batch * max_len, PACKED_VARS[1]: max_batch + 1})
    mod, params = model.export_tvm(spec={method: {**inputs, "$": {"param_mode": "plain", "effect_mode": "none"}}})
    functions = {gvar: func for gvar, func in mod.functions_items() if gvar.name_hint != method}
    forward = mod[method].with_attr("tir_var_upper_bound", bounds).with_attr("global_symbol", "forward")
    mod = tvm.IRModule({**functions, tvm.ir.GlobalVar("forward"): forward}, attrs=mod.attrs)
    parameters = [(name, tuple(int(d) for d in param.shape)) for name, param in params]
    return mod, parameters
