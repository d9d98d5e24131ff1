"""What a build is asked for (``CompileRequest``: model, target, batch and length bounds, plans,
layout, precision) and the checkpoint it resolves to, cut to the sequence length it will serve
(``open_checkpoint``): read by the artifact build, the tuning task and a re-tuning job alike."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.plan.kernel_plan import PRECISIONS
from ..model.checkpoint import Checkpoint
from ..model.heads import parse_pooling_modes
from ..model.hub import hub_id
from ..model.presets import PRESET_DISPLAY_NAMES, resolve_model
from ..model.tokenizer import PairTemplate
from ..runtime.manifest import LAYOUT_PACKED, LAYOUT_PADDED, LAYOUTS, default_layout
from .target import TargetSpec

Progress = Callable[[str], None]
# The longest sequence served where --max-seq-len does not say: a 32,768-position model (Qwen3-
# Embedding) planned for its last position would reserve a padded batch's scores of 64 GiB a
# row, and warm up on a sequence whose attention takes minutes on a CPU.
LONGEST_BY_DEFAULT = 8192
# The padded layout plans its buffers for the largest batch at the longest sequence, a batch's
# attention scores among them ([max_batch, heads, S, S] float32): at 64 rows of 8,192 tokens and
# 12 heads, 206 GB, whose allocation fails at the first call. Where --max-seq-len does not say,
# S is the longest whose scores stay within this.
PADDED_SCORES_BYTES = 4 << 30


@dataclass(frozen=True)
class CompileRequest:
    model: str = "default"  # "default", "bert-base", or a Hugging Face folder
    target: TargetSpec = field(default_factory=TargetSpec)
    max_batch: int = 64
    seed: int = 0  # for the random-weight presets
    plans: tuple[Path, ...] = ()  # kernel plan files or directories (python -m dietserve tune)
    # Without plans: plan every dynamic operator from the target's hardware model (the cold
    # start, ``cold_start.py``), not leave them to the default rule.
    analytic: bool = False
    # Pooling modes in place of the checkpoint's own (--pooling), concatenated in this order.
    pooling: tuple[str, ...] | None = None
    # LAYOUT_PACKED: the encoder on the requests' tokens packed, no padded work (CPU targets);
    # None: the target's default (``default_layout``).
    layout: str | None = None
    # The dense layers' products: "bf16" takes bf16 inputs and weights and sums in fp32, on CPUs
    # with AVX512-BF16 (``kernels/cpu_packed/bf16.py``); everything else stays fp32.
    precision: str = "fp32"
    # The longest sequence served, in tokens, below the checkpoint's last position (--max-seq-len):
    # a long-context model's tables, warm-up and memory bound end there; None: its last position,
    # at most LONGEST_BY_DEFAULT.
    max_seq_len: int | None = None
    # (no, yes): a decoder language model served as a one-label classifier, the logit of yes
    # minus that of no (--classifier-from-tokens; Qwen3-Reranker's)
    classifier_tokens: tuple[str, str] | None = None
    # The prompt a classifier reads each pair through (--pair-template; ``tokenizer.PairTemplate``'s
    # fields): a reranker's, as Qwen3-Reranker's
    pair_template: dict | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1, got {self.max_seq_len}")
        if self.layout is None:
            object.__setattr__(self, "layout", default_layout(self.target.kind))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == LAYOUT_PACKED and self.target.kind != "llvm":
            raise ValueError(f"the packed layout has kernels for CPU (llvm) targets only, not {self.target.kind}")
        if self.pooling is not None:
            parse_pooling_modes(",".join(self.pooling))
        if self.classifier_tokens is not None and (len(self.classifier_tokens) != 2 or self.pooling is not None):
            raise ValueError(f"classifier_tokens must be two tokens (no, yes), without pooling, got "
                             f"{self.classifier_tokens!r}")
        if self.pair_template is not None:
            PairTemplate.from_dict(self.pair_template, "pair_template")

    def build_record(self) -> dict:
        """What the manifest keeps of this request (``Manifest.build``), plans aside: enough for a
        re-tuning job to build the same model again. A folder is kept as an absolute path."""
        named = self.model in PRESET_DISPLAY_NAMES or hub_id(self.model) is not None
        model = self.model if named else str(Path(self.model).resolve())
        spec = self.target
        return {"model": model, "max_batch": self.max_batch, "seed": self.seed,
                "pooling": list(self.pooling) if self.pooling is not None else None, "layout": self.layout,
                "precision": self.precision, "max_seq_len": self.max_seq_len,
                **({"classifier_tokens": list(self.classifier_tokens)} if self.classifier_tokens else {}),
                **({"pair_template": self.pair_template} if self.pair_template else {}),
                "target": {"kind": spec.kind, "mcpu": spec.mcpu, "num_cores": spec.num_cores, "arch": spec.arch}}

    @classmethod
    def from_build_record(cls, record: dict) -> CompileRequest:
        """The request a manifest's build record describes (ValueError: a malformed record)."""
        try:
            pooling = record.get("pooling")
            return cls(model=str(record["model"]), target=TargetSpec(**record["target"]),
                       max_batch=int(record["max_batch"]), seed=int(record["seed"]),
                       pooling=tuple(pooling) if pooling is not None else None,
                       layout=str(record.get("layout", LAYOUT_PADDED)),
                       precision=str(record.get("precision", "fp32")), max_seq_len=record.get("max_seq_len"),
                       classifier_tokens=tuple(record["classifier_tokens"]) if record.get("classifier_tokens")
                       else None, pair_template=record.get("pair_template"))
        except (KeyError, TypeError) as err:
            raise ValueError(f"the manifest's build record {record!r} is malformed: {err!r}") from None


def open_checkpoint(request: CompileRequest, cache_dir: Path, progress: Progress = lambda _message: None
                    ) -> Checkpoint:
    """The request's checkpoint, pooled as ``--pooling`` says and cut to ``--max-seq-len`` where
    given, else to ``LONGEST_BY_DEFAULT`` tokens and, padded, to what ``PADDED_SCORES_BYTES``
    allows (said through ``progress``, and so is a given length past that)."""
    checkpoint = Checkpoint.open(resolve_model(request.model, cache_dir, request.seed))
    positions = checkpoint.config.max_length
    row_bytes = request.max_batch * checkpoint.config.num_attention_heads * 4  # (a score's, every row and head)
    padded = request.layout == LAYOUT_PADDED
    longest = request.max_seq_len or min(positions, LONGEST_BY_DEFAULT)
    fitting = math.isqrt(PADDED_SCORES_BYTES // row_bytes)  # (the longest whose scores fit)
    bounded = padded and request.max_seq_len is None and fitting < longest
    longest = fitting if bounded else longest
    if padded and longest > fitting:
        progress(f"the padded layout plans {row_bytes * longest * longest / 2**30:.1f} GiB for a batch's attention "
                 f"scores at --max-batch {request.max_batch} and --max-seq-len {longest}: the first call fails "
                 "where that much cannot be allocated (fewer rows, a shorter length"
                 + (", or --layout packed)" if request.target.kind == "llvm" else ")"))
    if longest != positions:
        checkpoint = checkpoint.with_max_length(longest)
        if request.max_seq_len is None:
            bound = (f"; padded, {request.max_batch} rows' attention scores within "
                     f"{PADDED_SCORES_BYTES / 2**30:.0f} GiB" if bounded else "")
            progress(f"serving sequences of up to {longest} of the model's {positions} positions (--max-seq-len "
                     f"to change it{bound})")
    if request.classifier_tokens is not None:
        checkpoint = checkpoint.with_classifier_from_tokens(*request.classifier_tokens)
    elif request.pooling is not None:
        checkpoint = checkpoint.with_pooling_modes(request.pooling)
    if request.pair_template is not None:
        checkpoint = checkpoint.with_pair_template(PairTemplate.from_dict(request.pair_template, "--pair-template"))
    return checkpoint
