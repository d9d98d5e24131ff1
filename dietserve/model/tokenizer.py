"""Text -> token ids with the checkpoint's own ``tokenizer.json`` (no torch, no transformers)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from ..runtime.errors import InputError, InputTooLong

# A server reads at most this many bytes per token of the model's maximum length of each text
# (the rest could only add tokens past the maximum): English averages 4-6 bytes a token, so
# this bounds a request's tokenizing time without changing the answer for ordinary text.
TEXT_BYTES_PER_TOKEN = 64
# What turns text into token ids, copied into an artifact: the tokenizer, the sentence-transformers
# prompts (text prefixes a request may name, ``TextTokenizer.prompts``) and its settings, whose
# ``max_seq_length`` is where sentence-transformers (and TEI) cut a text.
PROMPTS_FILE, SETTINGS_FILE = "config_sentence_transformers.json", "sentence_bert_config.json"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json", PROMPTS_FILE,
                   SETTINGS_FILE)


# A classifier's pair template (``PairTemplate``), written into the artifact by the compile.
PAIR_TEMPLATE_FILE = "pair_template.json"


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable."""


@dataclass(frozen=True)
class PairTemplate:
    """How a reranker that reads a (query, document) pair as one prompt sees it: ``prefix``, then
    ``pair`` with ``{query}`` and ``{document}`` filled in, then ``suffix``, no other special
    tokens. Where the prompt is too long the filled-in part is cut, the prefix and suffix kept
    whole (the answer the model scores follows the suffix), as Qwen3-Reranker's own code cuts it."""

    pair: str
    prefix: str = ""
    suffix: str = ""

    @classmethod
    def from_dict(cls, raw: object, where: str) -> PairTemplate:
        if not isinstance(raw, dict) or not set(raw) <= {"prefix", "pair", "suffix"} or "pair" not in raw:
            raise TokenizerError(f"{where}: a pair template is a JSON object with 'pair' and optional 'prefix' "
                                 f"and 'suffix', got {raw!r:.120}")
        if not all(isinstance(value, str) for value in raw.values()):
            raise TokenizerError(f"{where}: the pair template's prefix, pair and suffix must be strings")
        if any(raw["pair"].count(field) != 1 for field in ("{query}", "{document}")):
            raise TokenizerError(f"{where}: the pair template's 'pair' must hold {{query}} and {{document}} once each, "
                                 f"got {raw['pair']!r:.120}")
        return cls(**raw)

    def to_dict(self) -> dict:
        return {"prefix": self.prefix, "pair": self.pair, "suffix": self.suffix}

    def filled(self, query: str, document: str) -> str:
        """``pair`` with the two texts in (one pass: braces inside the texts stay as they are)."""
        return re.sub(r"\{query\}|\{document\}", lambda field: query if field.group() == "{query}" else document,
                      self.pair)


# Templates by name (``--pair-template NAME``): Qwen3-Reranker's prompt as its model card writes
# it, with its default instruction.
PAIR_TEMPLATES = {"qwen3-reranker": PairTemplate(
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    pair="<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
         "<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")}


def read_pair_template(text: str) -> PairTemplate:
    """A template by name (``PAIR_TEMPLATES``), as a JSON object, or from a JSON file."""
    if text in PAIR_TEMPLATES:
        return PAIR_TEMPLATES[text]
    try:
        raw = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TokenizerError(f"--pair-template {text:.80}: neither a template's name ({', '.join(PAIR_TEMPLATES)}), "
                             f"a JSON object nor a readable JSON file: {err}") from None
    return PairTemplate.from_dict(raw, f"--pair-template {text:.80}")


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int64 [batch, seq]
    attention_mask: np.ndarray  # int64 [batch, seq]
    token_type_ids: np.ndarray  # int64 [batch, seq]


def _text_length(path: Path, max_length: int) -> int:
    """``max_length``, or sentence-transformers' shorter ``max_seq_length`` in ``path``: the model's
    authors' bound (all-MiniLM-L6-v2: 256 of 512 positions), which its users' embeddings obey."""
    if not path.is_file():
        return max_length
    try:
        limit = json.loads(path.read_text()).get("max_seq_length")
    except (json.JSONDecodeError, AttributeError) as err:
        raise TokenizerError(f"{path} is not a JSON object: {err}") from None
    if limit is None:
        return max_length
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise TokenizerError(f"{path}: max_seq_length must be a positive integer, got {limit!r}")
    return min(limit, max_length)


def _prompts(path: Path) -> dict[str, str]:
    """sentence-transformers' ``prompts`` (name -> prefix) from ``path``, if the model has any."""
    if not path.is_file():
        return {}
    try:
        prompts = json.loads(path.read_text()).get("prompts") or {}
    except (json.JSONDecodeError, AttributeError) as err:
        raise TokenizerError(f"{path} is not a JSON object: {err}") from None
    if not isinstance(prompts, dict) or not all(isinstance(text, str) for text in prompts.values()):
        raise TokenizerError(f"{path}: 'prompts' must map names to texts, got {prompts!r:.80}")
    return prompts


class TextTokenizer:
    """Pads a batch to its longest member. A text (or pair) over ``max_length`` tokens is
    truncated to ``max_length`` (as the checkpoint's tokenizer truncates: special tokens kept)
    when the caller asks for it, and refused with :class:`InputTooLong` otherwise."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, prompts: dict[str, str] | None = None,
                 token_types: bool = True, pair_template: PairTemplate | None = None):
        self.max_length = max_length
        self.pair_template = pair_template
        # False: the model has one token type, whatever its tokenizer numbers a pair's second
        # text (DistilBERT's numbers it 1, as BERT's does); every id is 0.
        self.token_types = token_types
        self.prompts = dict(prompts or {})  # name -> text prepended to a text the request names it for
        # A copy per truncation, each configured once: toggling one tokenizer's truncation per
        # call would race between the server's decoding threads.
        self._whole = Tokenizer.from_str(tokenizer.to_str())
        self._whole.no_truncation()
        self._whole.no_padding()
        self._truncating = self._truncated_copy("right")  # keeps a text's first tokens
        pad_ids = [tokenizer.token_to_id(token) for token in ("[PAD]", "<pad>")]  # BERT's, RoBERTa's
        self._pad_id = next((token_id for token_id in pad_ids if token_id is not None), 0)
        self._prompt_parts = None  # (prefix, suffix) encoded, with a pair template
        if pair_template is not None:
            self._prompt_parts = tuple(self._whole.encode(part, add_special_tokens=False)
                                       for part in (pair_template.prefix, pair_template.suffix))
            fixed = sum(len(part.ids) for part in self._prompt_parts)
            if fixed >= max_length:
                raise TokenizerError(f"the pair template's prefix and suffix take {fixed} tokens, leaving none of the "
                                     f"{max_length} a text may have for the pair")

    def _truncated_copy(self, direction: str) -> Tokenizer:
        copy = Tokenizer.from_str(self._whole.to_str())
        copy.enable_truncation(self.max_length, direction=direction)
        return copy

    @cached_property
    def _keeping_last(self) -> Tokenizer:
        """Made on first use (a copy is megabytes); two threads making it at once make two."""
        return self._truncated_copy("left")

    @property
    def byte_limit(self) -> int:
        """The most bytes of one text a server tokenizes (see TEXT_BYTES_PER_TOKEN)."""
        return self.max_length * TEXT_BYTES_PER_TOKEN

    @classmethod
    def from_folder(cls, folder: Path, max_length: int, token_types: bool = True) -> TextTokenizer:
        """``tokenizer.json`` when present; otherwise a WordPiece tokenizer from ``vocab.txt``
        (older BERT checkpoints), lower-casing as ``tokenizer_config.json`` says. Texts are cut at
        ``max_length`` tokens, or at sentence-transformers' ``max_seq_length`` where that is shorter."""
        folder = Path(folder)
        prompts = _prompts(folder / PROMPTS_FILE)
        max_length = _text_length(folder / SETTINGS_FILE, max_length)
        template_file = folder / PAIR_TEMPLATE_FILE
        template = PairTemplate.from_dict(json.loads(template_file.read_text()), str(template_file)) if (
            template_file.is_file()) else None
        if (folder / "tokenizer.json").is_file():
            return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), max_length, prompts, token_types, template)
        if (folder / "vocab.txt").is_file():
            from tokenizers import BertWordPieceTokenizer

            settings_file = folder / "tokenizer_config.json"
            settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
            wordpiece = BertWordPieceTokenizer(
                str(folder / "vocab.txt"),
                lowercase=bool(settings.get("do_lower_case", True)),
                strip_accents=settings.get("strip_accents"),
                handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
            )
            return cls(wordpiece._tokenizer, max_length, prompts, token_types)
        raise TokenizerError(f"{folder} has neither tokenizer.json nor vocab.txt")

    def encode(self, texts: Sequence[str | tuple[str, str]], truncate: bool = True, clipped: Collection[int] = (),
               first: int = 0, keep_last: bool = False) -> Encoded:
        """Each item a text, or a (text, text_pair) pair encoded as the checkpoint's tokenizer
        encodes pairs (``[CLS] a [SEP] b [SEP]``, token_type_ids 0 then 1; truncated
        ``longest_first``, as sentence-transformers' CrossEncoder does). ``clipped``: indices of
        items the caller cut to :attr:`byte_limit` bytes (a pair: either text) before tokenizing.
        Without ``truncate`` they are refused even if the part read fits, since the whole text was
        not counted. ``first``: the index of ``texts[0]`` in the caller's request, for messages.
        ``keep_last``: truncation keeps a text's last tokens (its special tokens still added)."""
        if not texts:
            raise TokenizerError("no texts to encode")
        items = list(texts)
        if self.pair_template is not None:
            return self._padded(self._prompted(items, truncate, clipped, first, keep_last))
        batch = self._whole.encode_batch(items)
        too_long = [i for i, encoding in enumerate(batch) if len(encoding.ids) > self.max_length or i in clipped]
        if too_long and not truncate:
            index = too_long[0]
            what = "pair" if isinstance(items[index], tuple) else "text"
            raise InputTooLong(self._too_long(f"{what} {first + index}", len(batch[index].ids), index in clipped))
        if too_long:
            truncating = self._keeping_last if keep_last else self._truncating
            for index, encoding in zip(too_long, truncating.encode_batch([items[i] for i in too_long]), strict=True):
                batch[index] = encoding
        return self._padded(batch)

    def _prompted(self, items: list, truncate: bool, clipped: Collection[int], first: int,
                  keep_last: bool) -> list[Encoding]:
        """Each pair through ``pair_template``: the filled-in part cut to what the prefix and
        suffix leave (its end, or its start with ``keep_last``), refused without ``truncate``."""
        template = self.pair_template
        lone = next((index for index, item in enumerate(items) if not isinstance(item, tuple)), None)
        if lone is not None:
            raise InputError(f"text {first + lone}: this model scores (query, document) pairs through its pair "
                             "template; send a pair")
        prefix, suffix = self._prompt_parts
        room = self.max_length - len(prefix.ids) - len(suffix.ids)
        bodies = self._whole.encode_batch([template.filled(*item) for item in items], add_special_tokens=False)
        for index, body in enumerate(bodies):
            if len(body.ids) > room or index in clipped:
                if not truncate:
                    raise InputTooLong(self._too_long(f"pair {first + index}", len(body.ids) + self.max_length - room,
                                                      index in clipped))
                body.truncate(room, direction="left" if keep_last else "right")
        return [Encoding.merge([prefix, body, suffix], growing_offsets=False) for body in bodies]

    def tokens(self, text: str, add_special_tokens: bool = True) -> list[dict]:
        """``text``'s tokens as text embeddings inference's ``/tokenize`` lists them: id, text,
        special, and start and stop as byte offsets into the UTF-8 text (None for special
        tokens, whose text is the token itself). Not truncated."""
        encoding = self._whole.encode(text, add_special_tokens=add_special_tokens)
        byte_at = np.cumsum([0] + [len(char.encode("utf-8", "surrogatepass")) for char in text]).tolist()
        tokens = []
        for token_id, (start, stop), special, token in zip(encoding.ids, encoding.offsets,
                                                           encoding.special_tokens_mask, encoding.tokens, strict=True):
            if special:
                tokens.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
            else:
                tokens.append({"id": token_id, "text": text[start:stop], "special": False, "start": byte_at[start],
                               "stop": byte_at[stop]})
        return tokens

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, what: str = "ids") -> str:
        """Token ids -> text; an id outside the vocabulary is refused (the tokenizer would drop it),
        naming ``what`` held it."""
        vocabulary = self._whole.get_vocab_size()
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocabulary:
                raise InputError(f"{what}[{position}] is {token_id}, outside the vocabulary [0, {vocabulary})")
        return self._whole.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _too_long(self, what: str, tokens: int, clipped: bool) -> str:
        hint = f"shorten it, or send truncate=true to use its first {self.max_length} tokens"
        if not clipped:
            return f"{what} has {tokens} tokens, over the model's maximum of {self.max_length}; {hint}"
        return (f"{what} is longer than the {self.byte_limit} bytes the server reads of a text "
                f"({TEXT_BYTES_PER_TOKEN} per token of the model's maximum of {self.max_length}); those bytes alone "
                f"hold {tokens} tokens; {hint}")

    def _padded(self, batch: list) -> Encoded:
        seq = max(len(encoding.ids) for encoding in batch)
        ids = np.full((len(batch), seq), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), seq), dtype=np.int64)
        types = np.zeros((len(batch), seq), dtype=np.int64)
        for row, encoding in enumerate(batch):
            length = len(encoding.ids)
            ids[row, :length] = encoding.ids
            mask[row, :length] = encoding.attention_mask
            if self.token_types:
                types[row, :length] = encoding.type_ids
        return Encoded(ids, mask, types)
