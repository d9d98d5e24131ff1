"""What every command shares: the build flags, the compile request they make, the progress line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "dietserve"


def say(message: str) -> None:
    print(f"[dietserve] {message}", file=sys.stderr, flush=True)


def add_build_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (all-MiniLM-L6-v2), 'bert-base' (seeded random weights) "
                             "or a Hugging Face folder with config.json and model.safetensors")
    parser.add_argument("--target", choices=("llvm", "cuda"), default="llvm",
                        help="llvm: this CPU (default); cuda: an NVIDIA GPU, compiled with nvcc")
    parser.add_argument("--mcpu", default=None,
                        help="LLVM CPU name to compile for (default: detect this machine's, e.g. znver3)")
    parser.add_argument("--num-cores", type=int, default=None, help="CPU threads the schedules assume")
    parser.add_argument("--arch", default="sm_90", help="CUDA architecture for --target cuda (e.g. sm_90, sm_75)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch the artifact accepts")
    parser.add_argument("--seed", type=int, default=0, help="weight seed for the bert-base preset")
    parser.add_argument("--pooling", type=_pooling_modes, default=None, metavar="MODE[,MODE...]",
                        help="sentence-embedding pooling in place of the checkpoint's own (1_Pooling): "
                             "cls, max, mean, mean_sqrt_len_tokens, weightedmean or lasttoken; several "
                             "separated by commas are concatenated in that order")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where compiled artifacts and generated models are kept (default {DEFAULT_CACHE})")


def _pooling_modes(text: str) -> tuple[str, ...]:
    from ..model.heads import parse_pooling_modes

    try:
        return parse_pooling_modes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def compile_request(args: argparse.Namespace):
    from ..compile.artifact import CompileRequest
    from ..compile.target import TargetSpec

    spec = TargetSpec(kind=args.target, mcpu=args.mcpu, num_cores=args.num_cores, arch=args.arch)
    plans = tuple(getattr(args, "plans", None) or ())
    return CompileRequest(model=args.model, target=spec, max_batch=args.max_batch, seed=args.seed, plans=plans,
                          pooling=args.pooling)


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
    return argv
