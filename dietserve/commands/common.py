"""What every command shares: the build flags, the compile request they make, the progress line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ..kernels.plan.kernel_plan import PRECISIONS
from ..runtime.manifest import LAYOUTS, PLAN_MODES, PLANS_ANALYTIC

DEFAULT_CACHE = Path.home() / ".cache" / "dietserve"


def say(message: str) -> None:
    print(f"[dietserve] {message}", file=sys.stderr, flush=True)


def add_build_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (all-MiniLM-L6-v2), 'bert-base' (seeded random weights), a Hugging Face "
                             "folder with config.json and model.safetensors, or a Hub id (org/name[@revision])")
    parser.add_argument("--target", choices=("llvm", "cuda"), default="llvm",
                        help="llvm: this CPU (default); cuda: an NVIDIA GPU, compiled with nvcc")
    parser.add_argument("--mcpu", default=None,
                        help="LLVM CPU name to compile for (default: detect this machine's, e.g. znver3)")
    parser.add_argument("--num-cores", type=int, default=None, help="CPU threads the schedules assume")
    parser.add_argument("--arch", default="sm_90", help="CUDA architecture for --target cuda (e.g. sm_90, sm_75)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch the artifact accepts")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="TOKENS",
                        help="longest sequence served (default: the model's last position, at most 8192); longer "
                             "texts are truncated. Bounds a long-context model's start-up and memory")
    parser.add_argument("--seed", type=int, default=0, help="weight seed for the bert-base preset")
    parser.add_argument("--pooling", type=_pooling_modes, default=None, metavar="MODE[,MODE...]",
                        help="sentence-embedding pooling in place of the checkpoint's own (1_Pooling): "
                             "cls, max, mean, mean_sqrt_len_tokens, weightedmean or lasttoken; several "
                             "separated by commas are concatenated in that order; or splade: a *ForMaskedLM "
                             "checkpoint as a sparse encoder (SpladePooling, max of log1p(relu))")
    parser.add_argument("--classifier-from-tokens", type=_token_pair, default=None, metavar="NO,YES",
                        help="a decoder language model (qwen3, qwen2, mistral, llama) as a one-label classifier for "
                             "/rerank: the logit of token YES minus that of NO at the last token (Qwen3-Reranker: "
                             "no,yes); its prompt is the client's to write")
    parser.add_argument("--pair-template", type=_pair_template, default=None, metavar="NAME|FILE",
                        help="the prompt a reranker reads each (query, document) pair through: qwen3-reranker "
                             "(Qwen3-Reranker's, with its default instruction), or a JSON file of 'prefix', 'pair' "
                             "(with {query} and {document}) and 'suffix'")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="packed: a request's tokens packed one sequence after another, no padded work (llvm "
                             "only; its default); padded: texts padded to the longest, padding masked (cuda's)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="the dense layers' products: fp32 (default), or bf16 (bf16 inputs and weights, fp32 "
                             "sums; CPUs with AVX512-BF16, e.g. AMD Zen 4, Intel Sapphire Rapids); the rest stays fp32")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where compiled artifacts and generated models are kept (default {DEFAULT_CACHE})")


def _pooling_modes(text: str) -> tuple[str, ...]:
    from ..model.heads import parse_pooling_modes

    try:
        return parse_pooling_modes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _token_pair(text: str) -> tuple[str, str]:
    parts = text.split(",")
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give two tokens, NO,YES (Qwen3-Reranker: no,yes)")
    return parts[0], parts[1]


def _pair_template(text: str) -> dict:
    from ..model.tokenizer import TokenizerError, read_pair_template

    try:
        return read_pair_template(text).to_dict()
    except TokenizerError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def compile_request(args: argparse.Namespace):
    from ..compile.artifact import CompileRequest
    from ..compile.target import TargetSpec

    spec = TargetSpec(kind=args.target, mcpu=args.mcpu, num_cores=args.num_cores, arch=args.arch)
    given = list(getattr(args, "plans", None) or [PLANS_ANALYTIC])
    modes = [plan for plan in given if plan in PLAN_MODES]
    if modes and len(given) > 1:
        raise SystemExit(f"--plans {' '.join(given)}: give either {' or '.join(PLAN_MODES)} once, or plan files "
                         f"and folders")
    plans = () if modes else tuple(Path(plan) for plan in given)
    return CompileRequest(model=args.model, target=spec, max_batch=args.max_batch, seed=args.seed, plans=plans,
                          analytic=modes == [PLANS_ANALYTIC], pooling=args.pooling,
                          layout=getattr(args, "layout", None), precision=getattr(args, "precision", "fp32"),
                          max_seq_len=getattr(args, "max_seq_len", None),
                          classifier_tokens=getattr(args, "classifier_from_tokens", None),
                          pair_template=getattr(args, "pair_template", None))


def add_plans_flag(parser: argparse.ArgumentParser, files: bool) -> None:
    """``--plans``: what chooses the dynamic operators' kernels in a model compiled here."""
    choices = " or ".join(PLAN_MODES) + (", or plan files and folders (repeatable; from `tune`)" if files else "")
    parser.add_argument("--plans", action="append", metavar="analytic|none" + ("|PATH" if files else ""),
                        type=str if files else _plan_mode,
                        help=f"{choices}. analytic (the default): planned from this CPU's hardware model, "
                             f"measuring nothing; none: the default schedule rule")


def _plan_mode(text: str) -> str:
    if text not in PLAN_MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: give {' or '.join(PLAN_MODES)}")
    return text


def build_argv(args: argparse.Namespace) -> list[str]:
    """The build flags of ``args`` again, for a child command that must build the same model."""
    argv = ["--model", str(args.model), "--target", args.target, "--arch", args.arch, "--max-batch",
            str(args.max_batch), "--seed", str(args.seed), "--cache-dir", str(args.cache_dir)]
    if args.mcpu:
        argv += ["--mcpu", args.mcpu]
    if args.num_cores:
        argv += ["--num-cores", str(args.num_cores)]
    if args.pooling:
        argv += ["--pooling", ",".join(args.pooling)]
    if getattr(args, "max_seq_len", None):
        argv += ["--max-seq-len", str(args.max_seq_len)]
    if getattr(args, "classifier_from_tokens", None):
        argv += ["--classifier-from-tokens", ",".join(args.classifier_from_tokens)]
    if getattr(args, "pair_template", None):
        argv += ["--pair-template", json.dumps(args.pair_template)]
    if getattr(args, "layout", None):
        argv += ["--layout", args.layout]
    if getattr(args, "precision", None):
        argv += ["--precision", args.precision]
    return argv


def runtime_only(environ) -> dict[str, str]:
    """This process loads TVM's runtime library alone, never its compiler (the larger part of
    what ``import tvm`` maps): what needs the compiler runs in a child process (``in_child``).
    Returns the environment those children run with: ``environ`` as it was."""
    compiler_environment = dict(environ)
    environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # (read when TVM is first imported)
    return compiler_environment


def in_child(command: list[str], environment: dict[str, str]) -> str:
    """The last line ``python -m dietserve COMMAND...`` prints; what it says on stderr (progress,
    errors) goes to this process's."""
    done = subprocess.run([sys.executable, "-m", "dietserve", *command], stdout=subprocess.PIPE, text=True,
                          env=environment, check=False)
    if done.returncode != 0:  # (its error said above; its status kept: 2 for a user's error)
        print(f"error: `python -m dietserve {command[0]}` failed (exit {done.returncode})", file=sys.stderr)
        raise SystemExit(done.returncode)
    return done.stdout.strip().splitlines()[-1]
