"""Command line: the composition root. Parses flags once and wires the pieces together.

    python -m dietserve compile --model default --target llvm --out DIR [--plans DIR]
    python -m dietserve tune --model default --trials 64 --db records.jsonl --out DIR
    python -m dietserve explain --artifact DIR --seq 37 [--batch 4] [--plot FILE.png]
    python -m dietserve embed "a sentence" "another sentence" --similarity
    python -m dietserve serve [--artifact DIR | --artifact-store STORE] [--port 8001] [--metrics-port 8002]
    python -m dietserve publish ARTIFACT --store STORE
    python -m dietserve rollback --store STORE
    python -m dietserve retune --store STORE --traffic TRAFFIC.json [--trials 64]
    python -m dietserve cache [--prune] [--keep 2]
    python -m dietserve target [--mcpu NAME] [--num-cores N]   # what a build here targets (JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .host.startup import keep_torch_out

if __name__ == "__main__":
    keep_torch_out()

from .commands.common import DEFAULT_CACHE, add_build_flags, add_plans_flag, compile_request, runtime_only, say
from .commands.serve import add_serve_command
from .commands.store import add_store_commands

SPARSE_TERMS = 8  # embed: the terms of a sparse encoder's text printed, its heaviest


def cmd_compile(args: argparse.Namespace) -> int:
    from .compile.artifact import compile_artifact

    out = compile_artifact(compile_request(args), args.cache_dir, args.out, progress=say)
    print(out)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .compile.tuning import TuneRequest, read_observations, tune_model

    lengths, tokens = read_observations(args.lengths) if args.lengths else ((), ())
    if args.tasks_only:  # for a tuner that measures elsewhere (python -m tuner bundle)
        from .compile.tuning import TASKS_FILE, tuning_tasks

        args.out.mkdir(parents=True, exist_ok=True)
        print(tuning_tasks(compile_request(args), args.cache_dir, lengths, tokens).write(args.out / TASKS_FILE))
        return 0
    request = TuneRequest(compile=compile_request(args), db=args.db, out=args.out, trials=args.trials,
                          time_budget_s=args.time_budget, lengths=lengths, tokens=tokens,
                          rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key)
    print(tune_model(request, args.cache_dir, progress=say))
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    from .compile.target import build_target, target_description

    print(json.dumps(target_description(build_target(compile_request(args).target))))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain_attention, explain_rows, format_explain, write_explain_plot

    print(format_explain(explain_rows(args.artifact, args.batch, args.seq), args.batch, args.seq))
    attention = explain_attention(args.artifact, args.seq)
    if attention:
        print(attention)
    if args.plot:
        say(f"plot: {write_explain_plot(args.artifact, args.plot, batch=args.batch)}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    if args.artifact is not None:  # nothing to compile: TVM's runtime library alone, as serve
        runtime_only(os.environ)
    import numpy as np

    from .runtime.artifact import load_artifact
    from .runtime.embedder import Embedder, cosine_similarities
    from .runtime.engine import Engine

    if args.artifact is not None:
        directory = args.artifact
    else:
        from .compile.artifact import compile_artifact

        directory = compile_artifact(compile_request(args), args.cache_dir, None, progress=say)
    embedder = Embedder(Engine(load_artifact(directory), threads=args.threads))
    embeddings = embedder.embed(list(args.texts))
    if args.json:
        print(json.dumps({"texts": args.texts, "embeddings": embeddings.tolist()}))
    elif args.similarity:
        similarity = cosine_similarities(embeddings)
        width = max(len(t) for t in args.texts)
        for text, row in zip(args.texts, similarity, strict=True):
            print(f"{text[:width]:<{width}}  " + "  ".join(f"{value:6.3f}" for value in row))
    elif embedder.engine.sparse:  # (its weights by vocabulary entry: the terms it weighs most)
        for text, vector in zip(args.texts, embeddings, strict=True):
            top = [int(i) for i in np.argsort(-vector, kind="stable")[:SPARSE_TERMS] if vector[i] > 0]
            terms = ", ".join(f"{embedder.tokenizer.decode([i], False)!r} {vector[i]:.3f}" for i in top)
            print(f"{text!r}: {np.count_nonzero(vector)} of {vector.size} vocabulary weights nonzero; most: {terms}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        for text, vector in zip(args.texts, embeddings, strict=True):
            print(f"{text!r}: dim={vector.size} norm={np.linalg.norm(vector):.4f} {vector[:6]} ...")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    import time

    from .compile.cache import cached_artifacts, prune, to_prune

    entries = cached_artifacts(args.cache_dir)  # walks every entry's files once, for its size
    doomed_entries = to_prune(entries, args.keep)
    doomed = {entry.path for entry in doomed_entries}
    if not entries:
        print(f"{args.cache_dir}: no compiled artifacts")
    for entry in entries:
        mark = "prune" if entry.path in doomed else ("?" if not entry.readable else "keep")
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
        what = f"{entry.model} ({entry.kind})" if entry.readable else "no readable manifest"
        print(f"{mark:>5}  {entry.size / 2**20:8.0f} MiB  {used}  {what}  {entry.path.name}")
    if not args.prune:
        if doomed:
            size = sum(entry.size for entry in entries if entry.path in doomed)
            print(f"--prune would delete {len(doomed)} of them ({size / 2**20:.0f} MiB), keeping the "
                  f"{args.keep} most recently used of each model and target")
        return 0
    removed, freed = prune(args.cache_dir, doomed_entries)
    print(f"deleted {len(removed)} folder(s), {freed / 2**20:.0f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dietserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    compile_parser = commands.add_parser("compile", help="compile a model into an artifact directory")
    add_build_flags(compile_parser)
    compile_parser.add_argument("--out", type=Path, default=None,
                                help="artifact directory to write (default: a cache entry named by content hash)")
    add_plans_flag(compile_parser, files=True)
    compile_parser.set_defaults(run=cmd_compile)

    tune_parser = commands.add_parser(
        "tune", help="tune the model's dynamic operators (DietCode) and compile an artifact linking the kernels")
    add_build_flags(tune_parser)
    tune_parser.add_argument("--trials", type=int, default=64, help="measurements per operator (default 64)")
    tune_parser.add_argument("--time-budget", type=float, default=None, help="seconds for all operators together")
    tune_parser.add_argument("--lengths", type=Path, default=None,
                             help="observed sequence lengths (integers, or JSON {length: count}) to weight "
                                  "shapes by (default: every length 1..max equally)")
    tune_parser.add_argument("--db", type=Path, default=Path("records.jsonl"),
                             help="tuning records (appended; records already there are reused)")
    tune_parser.add_argument("--out", type=Path, required=True,
                             help="output folder: tasks.json, plans/, artifact/")
    tune_parser.add_argument("--rpc-tracker", default=None,
                             help="host:port of a TVM RPC tracker: measure on the devices registered with it "
                                  "(e.g. GPU nodes; default: this machine)")
    tune_parser.add_argument("--rpc-key", default="local", help="device key registered with the tracker")
    tune_parser.add_argument("--tasks-only", action="store_true",
                             help="write OUT/tasks.json and stop (tune it elsewhere: python -m tuner bundle)")
    tune_parser.set_defaults(run=cmd_tune)

    target_parser = commands.add_parser(
        "target", help="print what a build with these flags compiles for (JSON, as manifests record it)")
    add_build_flags(target_parser)
    target_parser.set_defaults(run=cmd_target)

    explain_parser = commands.add_parser("explain", help="which kernel variant each dynamic operator runs at a shape")
    explain_parser.add_argument("--artifact", type=Path, required=True, help="compiled artifact directory")
    explain_parser.add_argument("--seq", type=int, required=True, help="sequence length")
    explain_parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    explain_parser.add_argument("--plot", type=Path, default=None,
                                help="PNG: latency and GFLOP/s over the shape range, per operator and variant")
    explain_parser.set_defaults(run=cmd_explain)

    embed_parser = commands.add_parser("embed", help="print sentence embeddings (compiles on first use)")
    embed_parser.add_argument("texts", nargs="+", help="sentences to embed")
    add_build_flags(embed_parser)
    embed_parser.add_argument("--artifact", type=Path, default=None, help="use this compiled artifact directory")
    embed_parser.add_argument("--similarity", action="store_true", help="print the cosine-similarity matrix")
    embed_parser.add_argument("--json", action="store_true", help="print full vectors as JSON")
    embed_parser.add_argument("--threads", type=int, default=None,
                              help="CPU threads for the kernels (default: every CPU this process may use)")
    embed_parser.set_defaults(run=cmd_embed)

    cache_parser = commands.add_parser(
        "cache", help="list the compile cache's artifacts; --prune deletes all but the most recently used")
    cache_parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                              help=f"the cache to list or prune (default {DEFAULT_CACHE})")
    cache_parser.add_argument("--prune", action="store_true",
                              help="delete the older artifacts of each model and target, and crashed "
                                   "compiles' leftovers")
    cache_parser.add_argument("--keep", type=int, default=2,
                              help="artifacts kept per model and target kind, most recently used first (default 2)")
    cache_parser.set_defaults(run=cmd_cache)

    add_serve_command(commands)
    add_store_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .kernels.plan.task_file import TuningError
    from .runtime.manifest import ArtifactError

    # ValueError covers the checkpoint, config, plan and target errors. Their modules are not
    # imported for the except clause: the model's and the target's import TVM's compiler, and
    # `serve` runs where only TVM's runtime is installed.
    try:
        return args.run(args)
    except (ArtifactError, TuningError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
