"""Hugging Face checkpoint folder -> parameters in the layout of our Relax BERT, with what sits
on top of the encoder: a sentence-transformers recipe (modules.json) or, for a
sequence-classification checkpoint (BERT's or RoBERTa's family), its pooler and classifier."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .bert import BertModel, checkpoint_parts, transposed_weight_names
from .config import BertConfig, ModelConfigError
from .family_tensors import as_bert, canonical_name, part_width, splade_decoder, without_bias
from .heads import SPLADE_POOLING, ClassifierOptions, DenseLayer, PoolingOptions, SpladeOptions
from .side_by_side import side_by_side
from .tokenizer import PairTemplate
from .weight_files import WeightFileError, find_weight_files, read_tensors

CLASSIFICATION_ARCHITECTURES = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                                 "XLMRobertaForSequenceClassification", "CamembertForSequenceClassification",
                                 "DistilBertForSequenceClassification", "MPNetForSequenceClassification",
                                 "ModernBertForSequenceClassification", "NomicBertForSequenceClassification",
                                 "GteForSequenceClassification", "NewForSequenceClassification",
                                 "JinaBertForSequenceClassification",
                                 "Qwen3ForSequenceClassification", "Qwen2ForSequenceClassification",
                                 "MistralForSequenceClassification", "LlamaForSequenceClassification")
# sentence-transformers' legacy Pooling flags, in the order it concatenates their modes.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Dense activation classes (torch.nn, built without arguments) -> our names.
_TORCH_ACTIVATIONS = {"Tanh": "tanh", "Identity": "identity", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid"}
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling")
# The families whose masked-language-model head a sparse encoder (SPLADE) can compile with.
SPLADE_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet")


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or tensors, or their shapes do not fit the config."""


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face BERT folder: config, weights file, and its head: the sentence-embedding
    recipe (``pooling``) or, where ``classifier`` is set, a sequence-classification head."""

    folder: Path
    config: BertConfig
    pooling: PoolingOptions = PoolingOptions()
    classifier: ClassifierOptions | None = None

    @property
    def encoder_files(self) -> list[Path]:
        """The files of the encoder's (and a classifier's head's) tensors."""
        return _weight_files(self.folder)

    @property
    def weight_files(self) -> list[Path]:
        """Every file a build reads weights from: the encoder's, then each Dense module's."""
        dense = [] if self.classifier else [self.folder / d.path for d in self.pooling.dense]
        return [*self.encoder_files, *(path for module in dense for path in _weight_files(module))]

    @property
    def task(self) -> str:
        return "classification" if self.classifier is not None else "embedding"

    def model(self) -> BertModel:
        return BertModel(self.config, self.pooling, self.classifier)

    def head_description(self) -> dict:
        """The head as data, for the manifest and the cache key."""
        if self.classifier is not None:
            return {"task": self.task, "classifier": self.classifier.to_dict()}
        return {"task": self.task, "pooling": self.pooling.to_dict()}

    def with_max_length(self, tokens: int) -> Checkpoint:
        """This checkpoint serving sequences of at most ``tokens`` (``--max-seq-len``): its tables
        end there, and longer texts are truncated to it."""
        if not 1 <= tokens <= self.config.max_length:
            raise CheckpointError(f"--max-seq-len {tokens}: {self.folder}'s positions end at {self.config.max_length} "
                                  "tokens (give 1 to that)")
        limit = tokens + self.config.position_offset
        return dataclasses.replace(self, config=dataclasses.replace(self.config, max_position_embeddings=limit))

    def with_pooling_modes(self, modes: tuple[str, ...]) -> Checkpoint:
        """This checkpoint pooled with ``modes`` in place of its own (``--pooling``); ``splade``: its
        masked-language-model head under SpladePooling's defaults (max of ``log1p(relu)``)."""
        if self.classifier is not None:
            raise CheckpointError(f"{self.folder} is a sequence-classification checkpoint: its logits come "
                                  "from its own head, and --pooling applies to sentence-embedding models only")
        if modes == (SPLADE_POOLING,):
            return dataclasses.replace(self, pooling=PoolingOptions(splade=splade_options(self.config, {},
                                                                                          "--pooling splade")))
        if self.pooling.splade is not None:
            raise CheckpointError(f"{self.folder} is a sparse encoder: it pools its vocabulary logits with "
                                  "SpladePooling, and --pooling applies to dense embedding models only")
        pooling = dataclasses.replace(self.pooling, modes=modes)
        _check_dense_inputs(pooling, self.config.hidden_size, f"--pooling {','.join(modes)}")
        return dataclasses.replace(self, pooling=pooling)

    def with_classifier_from_tokens(self, no: str, yes: str) -> Checkpoint:
        """This decoder (a causal language model, as Qwen3-Reranker is) as a one-label classifier
        (``--classifier-from-tokens``): the logit of token ``yes`` minus that of ``no`` at the last
        token, from its ``lm_head`` (or, tied, its word embeddings)."""
        where = f"--classifier-from-tokens {no},{yes}"
        if not self.config.decoder_layers or self.classifier is not None:
            raise CheckpointError(f"{where}: {self.folder} is a {self.config.model_type} "
                                  f"{self.task} checkpoint; a decoder language model (qwen3, qwen2, mistral, llama) "
                                  "scores by its tokens' logits")
        try:
            vocabulary = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as err:  # (a missing or unreadable file: the tokens cannot be looked up)
            raise CheckpointError(f"{where}: {self.folder}/tokenizer.json cannot be read: {err}") from None
        ids = [vocabulary.token_to_id(token) for token in (no, yes)]
        missing = [token for token, token_id in zip((no, yes), ids, strict=True) if token_id is None]
        if missing:
            raise CheckpointError(f"{where}: {missing[0]!r} is not a token of {self.folder}'s vocabulary")
        return dataclasses.replace(self, pooling=PoolingOptions(),
                                   classifier=ClassifierOptions((yes,), from_tokens=(ids[0], ids[1])))

    def with_pair_template(self, template: PairTemplate) -> Checkpoint:
        """This classifier reading each (query, document) pair through ``template``
        (``--pair-template``: a reranker's prompt, as Qwen3-Reranker's)."""
        if self.classifier is None:
            raise CheckpointError(f"--pair-template: {self.folder} is an embedding model; a pair template is the "
                                  "prompt a classifier (a reranker) reads a pair through")
        return dataclasses.replace(self, classifier=dataclasses.replace(self.classifier, pair_template=template))

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"model folder {folder} does not exist")
        try:
            config = BertConfig.from_file(folder / "config.json")
        except ModelConfigError as err:
            raise CheckpointError(str(err)) from err
        _weight_files(folder)
        raw = json.loads((folder / "config.json").read_text())
        architectures = raw.get("architectures") or []
        unknown = [name for name in architectures if name.endswith("ForSequenceClassification")
                   and name not in CLASSIFICATION_ARCHITECTURES]
        if unknown:  # (read as an embedder, its head would be left out unsaid)
            raise CheckpointError(f"{folder}: a {config.model_type} sequence classifier ({unknown[0]}) is not "
                                  f"supported: a {config.model_type} checkpoint compiles as an embedder; sequence "
                                  f"classifiers compile from {', '.join(CLASSIFICATION_ARCHITECTURES)}")
        if set(CLASSIFICATION_ARCHITECTURES) & set(architectures):
            classifier = read_classifier(raw, folder)
            if config.decoder_layers:  # (its head reads the last token that is not padding)
                classifier = dataclasses.replace(classifier, pad_token_id=raw.get("pad_token_id"))
            return cls(folder, config, classifier=classifier)
        return cls(folder, config, read_pooling_options(folder, config))


def read_classifier(raw: dict, folder: Path) -> ClassifierOptions:
    """The labels of a sequence-classification config (``id2label``, ``num_labels``)."""
    id2label = raw.get("id2label") or {}
    count = int(raw.get("num_labels") or len(id2label) or 2)  # transformers' default is 2
    try:
        labels = {int(key): str(value) for key, value in id2label.items()}
    except ValueError:
        raise CheckpointError(f"{folder}/config.json: id2label keys must be integers, got {list(id2label)}") from None
    if labels and sorted(labels) != list(range(count)):
        raise CheckpointError(f"{folder}/config.json: id2label has ids {sorted(labels)}, "
                              f"expected 0..{count - 1} for {count} labels")
    return ClassifierOptions(tuple(labels.get(i, f"LABEL_{i}") for i in range(count)))


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None


def read_pooling_options(folder: Path, config: BertConfig) -> PoolingOptions:
    """The sentence-embedding recipe modules.json lists (Transformer, Pooling, Dense...,
    Normalize, in that order; or a sparse encoder's MLMTransformer then SpladePooling); without
    modules.json, a masked mean."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingOptions()
    entries = _read_json(modules_file)
    kinds = [_module_kind(entry, modules_file) for entry in entries]
    if "SpladePooling" in kinds or "MLMTransformer" in kinds:
        return _splade_options(folder, entries, kinds, config)
    hidden_size = config.hidden_size
    modes, dense, normalize = None, [], False
    for index, (entry, kind) in enumerate(zip(entries, kinds, strict=True)):
        path = str(entry.get("path", ""))
        where = f"{modules_file}: the {kind} module ({path or 'the root folder'})"
        if (kind == "Transformer") != (index == 0) or (kind == "Transformer" and path):
            raise CheckpointError(f"{where}: dietserve reads a Transformer module first, in the root folder, "
                                  "and nowhere else")
        if kind != "Transformer" and (normalize or (kind != "Pooling" and modes is None)):
            raise CheckpointError(f"{where} comes after Normalize or before Pooling; dietserve runs "
                                  "Pooling, then Dense modules, then Normalize")
        if kind == "Pooling":
            if modes is not None:
                raise CheckpointError(f"{where}: a second Pooling module is not supported")
            modes = _pooling_modes(_read_json(folder / path / "config.json"), hidden_size, where)
        elif kind == "Dense":
            dense.append(_dense_layer(folder, path, where))
        elif kind == "Normalize":
            normalize = True
    if modes is None:
        raise CheckpointError(f"{modules_file} lists no Pooling module: there is no sentence embedding to compute")
    pooling = PoolingOptions(modes, tuple(dense), normalize)
    _check_dense_inputs(pooling, hidden_size, str(modules_file))
    return pooling


def _splade_options(folder: Path, entries: list, kinds: list[str], config: BertConfig) -> PoolingOptions:
    """A sparse encoder (sentence-transformers' SparseEncoder): the transformer's fill-mask logits
    (sentence-transformers 5's MLMTransformer, or a Transformer of ``transformer_task``
    fill-mask) in the root folder, then SpladePooling, nothing else."""
    modules_file = folder / "modules.json"
    if kinds == ["Transformer", "SpladePooling"]:
        settings = folder / "sentence_bert_config.json"
        task = (_read_json(settings) if settings.is_file() else {}).get("transformer_task")
        if task != "fill-mask":
            raise CheckpointError(f"{modules_file}: SpladePooling pools a masked-language model's logits, and the "
                                  f"Transformer module's transformer_task is {task!r}, not 'fill-mask'")
    elif kinds != ["MLMTransformer", "SpladePooling"]:
        raise CheckpointError(f"{modules_file} lists {', '.join(kinds)}: dietserve compiles a sparse encoder of a "
                              "fill-mask Transformer (or MLMTransformer), then SpladePooling, and no other module")
    if entries[0].get("path", ""):
        raise CheckpointError(f"{modules_file}: dietserve reads the transformer in the root folder, not in "
                              f"{entries[0]['path']!r}")
    settings = _read_json(folder / str(entries[1].get("path", "")) / "config.json")
    encoder_file = folder / "config_sentence_transformers.json"
    encoder = _read_json(encoder_file) if encoder_file.is_file() else {}
    settings = {**settings, "max_active_dims": encoder.get("max_active_dims")}
    return PoolingOptions(splade=splade_options(config, settings, f"{modules_file}: the SpladePooling module"))


def splade_options(config: BertConfig, settings: dict, where: str) -> SpladeOptions:
    """SpladePooling's ``settings`` (its config.json, and the SparseEncoder's ``max_active_dims``)
    for a checkpoint of ``config``, checked."""
    if config.model_type not in SPLADE_FAMILIES:
        raise CheckpointError(f"{where}: a {config.model_type} sparse encoder is not supported; its "
                              f"masked-language-model head compiles for {', '.join(SPLADE_FAMILIES)}")
    try:
        return SpladeOptions(config.vocab_size, settings.get("pooling_strategy", "max"),
                             settings.get("activation_function", "relu"), settings.get("max_active_dims"))
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None


def _module_kind(entry: dict, modules_file: Path) -> str:
    """``sentence_transformers.models.Pooling`` (or the module's newer path) -> ``Pooling``."""
    kind = str(entry.get("type", ""))
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith("sentence_transformers.") or name not in _ST_MODULES:
        raise CheckpointError(f"{modules_file}: module type {kind!r} is not supported; dietserve compiles "
                              f"sentence-transformers' {', '.join(_ST_MODULES)} modules")
    return name


def _pooling_modes(config: dict, hidden_size: int, where: str) -> tuple[str, ...]:
    if config.get("include_prompt", True) is False:
        raise CheckpointError(f"{where}: include_prompt=false (pooling that skips an instruction prompt) "
                              "is not supported")
    width = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden_size))
    if width != hidden_size:
        raise CheckpointError(f"{where} pools {width}-wide token embeddings; the encoder's are {hidden_size}")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)) or ("mean",)
    try:
        return PoolingOptions(modes).modes
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None


def _dense_layer(folder: Path, path: str, where: str) -> DenseLayer:
    config = _read_json(folder / path / "config.json")
    if config.get("use_residual"):
        raise CheckpointError(f"{where}: use_residual=true is not supported")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise CheckpointError(f"{where}: {key}={config[key]!r} is not supported (only sentence_embedding)")
    function = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = _TORCH_ACTIVATIONS.get(function.rsplit(".", 1)[-1]) if function.startswith("torch.") else None
    if activation is None:
        raise CheckpointError(f"{where}: activation_function {function!r} is not supported; expected torch.nn's "
                              f"{', '.join(_TORCH_ACTIVATIONS)}")
    _weight_files(folder / path, where)
    return DenseLayer(int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                      activation, path)


def _check_dense_inputs(pooling: PoolingOptions, hidden_size: int, where: str) -> None:
    width = len(pooling.modes) * hidden_size
    for layer in pooling.dense:
        if layer.in_features != width:
            raise CheckpointError(f"{where}: the Dense module in {layer.path!r} takes {layer.in_features} features, "
                                  f"its input has {width}")
        width = layer.out_features


def load_parameters(
    checkpoint: Checkpoint, model: BertModel, expected: list[tuple[str, tuple[int, ...]]]
) -> dict[str, np.ndarray]:
    """Read the checkpoint's tensors, rename, transpose linear weights, concatenate the ones a
    layer computes side by side (the query, key and value projections) and check every shape."""
    stored = _tensors(checkpoint.encoder_files)
    raw = as_bert(checkpoint.config, {canonical_name(name): tensor for name, tensor in stored.items()})
    raw.update(_dense_tensors(checkpoint))
    splade = checkpoint.pooling.splade if checkpoint.classifier is None else None
    if splade is not None and "splade.transform.dense.weight" not in raw:
        raise CheckpointError(f"{checkpoint.folder}'s weights have no masked-language-model head (a *ForMaskedLM "
                              "checkpoint's cls.predictions, lm_head or vocab_*), which a sparse encoder needs")
    if splade is not None:
        raw.update(splade_decoder(raw, splade.decoder_columns))
    tokens = checkpoint.classifier.from_tokens if checkpoint.classifier is not None else None
    if tokens is not None:  # (a tied head is the word embeddings)
        head = raw.get("lm_head.weight", raw.get("embeddings.embed_tokens.weight"))
        raw["score.weight"] = (head[tokens[1]] - head[tokens[0]])[None]
    transposed = transposed_weight_names(model)
    sources = checkpoint_parts(model)
    params: dict[str, np.ndarray] = {}
    for name, shape in expected:
        for part in sources[name]:
            if part not in raw and without_bias(checkpoint.config, part):
                raw[part] = np.zeros(part_width(checkpoint.config, part, shape[-1], len(sources[name])), np.float32)
            if part not in raw:
                raise CheckpointError(f"{checkpoint.folder}'s weights have no tensor {part!r}")
        try:
            tensor = side_by_side([raw[part] for part in sources[name]], name in transposed)
        except ValueError as err:
            raise CheckpointError(f"{name!r} from {list(sources[name])}: {err}") from None
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}"
            )
        params[name] = tensor
    return params


def _dense_tensors(checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    """Each Dense module's ``linear.*`` under its parameter names in our model."""
    tensors = {}
    for index, module in enumerate(checkpoint.pooling.dense if checkpoint.classifier is None else ()):
        for name, tensor in _tensors(_weight_files(checkpoint.folder / module.path)).items():
            tensors[f"sentence.dense.{index}.{name.removeprefix('linear.')}"] = tensor
    return tensors


def _weight_files(folder: Path, where: str | None = None) -> list[Path]:
    try:
        return find_weight_files(folder)
    except WeightFileError as err:
        raise CheckpointError(f"{where}: {err}" if where else str(err)) from None


def _tensors(paths: list[Path]) -> dict[str, np.ndarray]:
    try:
        return read_tensors(paths)
    except WeightFileError as err:
        raise CheckpointError(str(err)) from None
