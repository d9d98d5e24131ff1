"""Command line: the composition root. Parses flags once and wires the pieces together.

    python -m dietserve compile --model default --target llvm --out DIR [--plans DIR]
    python -m dietserve tune --model default --trials 64 --db records.jsonl --out DIR
    python -m dietserve explain --artifact DIR --seq 37 [--batch 4] [--plot FILE.png]
    python -m dietserve embed "a sentence" "another sentence" --similarity
    python -m dietserve serve [--artifact DIR | --artifact-store STORE] [--port 8001] [--metrics-port 8002]
    python -m dietserve publish ARTIFACT --store STORE
    python -m dietserve rollback --store STORE
    python -m dietserve retune --store STORE --traffic TRAFFIC.json [--trials 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "dietserve"


def _say(message: str) -> None:
    print(f"[dietserve] {message}", file=sys.stderr, flush=True)


def _add_build_flags(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where compiled artifacts and generated models are kept (default {DEFAULT_CACHE})")


def _request(args: argparse.Namespace):
    from .compile.artifact import CompileRequest
    from .compile.target import TargetSpec

    spec = TargetSpec(kind=args.target, mcpu=args.mcpu, num_cores=args.num_cores, arch=args.arch)
    plans = tuple(getattr(args, "plans", None) or ())
    return CompileRequest(model=args.model, target=spec, max_batch=args.max_batch, seed=args.seed, plans=plans)


def cmd_compile(args: argparse.Namespace) -> int:
    from .compile.artifact import compile_artifact

    out = compile_artifact(_request(args), args.cache_dir, args.out, progress=_say)
    print(out)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .compile.tuning import TuneRequest, read_lengths, tune_model

    lengths = read_lengths(args.lengths) if args.lengths else ()
    request = TuneRequest(compile=_request(args), db=args.db, out=args.out, trials=args.trials,
                          time_budget_s=args.time_budget, lengths=lengths, rpc_tracker=args.rpc_tracker,
                          rpc_key=args.rpc_key)
    print(tune_model(request, args.cache_dir, progress=_say))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain_rows, format_explain, write_explain_plot

    print(format_explain(explain_rows(args.artifact, args.batch, args.seq), args.batch, args.seq))
    if args.plot:
        _say(f"plot: {write_explain_plot(args.artifact, args.plot, batch=args.batch)}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    import numpy as np

    from .runtime.artifact import load_artifact
    from .runtime.embedder import Embedder, cosine_similarities
    from .runtime.engine import Engine

    if args.artifact is not None:
        directory = args.artifact
    else:
        from .compile.artifact import compile_artifact

        directory = compile_artifact(_request(args), args.cache_dir, None, progress=_say)
    embedder = Embedder(Engine(load_artifact(directory), threads=args.threads))
    embeddings = embedder.embed(list(args.texts))
    if args.json:
        print(json.dumps({"texts": args.texts, "embeddings": embeddings.tolist()}))
    elif args.similarity:
        similarity = cosine_similarities(embeddings)
        width = max(len(t) for t in args.texts)
        for text, row in zip(args.texts, similarity, strict=True):
            print(f"{text[:width]:<{width}}  " + "  ".join(f"{value:6.3f}" for value in row))
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        for text, vector in zip(args.texts, embeddings, strict=True):
            print(f"{text!r}: dim={vector.size} norm={np.linalg.norm(vector):.4f} {vector[:6]} ...")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import logging

    from .runtime.manifest import Manifest
    from .server.config import config_from_args

    logging.basicConfig(level=logging.INFO, format="[dietserve] %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args, args.artifact)  # checks the flags before a long compile
    hot_swap = None
    if args.artifact_store is not None:
        from .runtime.versions import VersionStore

        if args.artifact is not None:
            raise SystemExit("error: give --artifact or --artifact-store, not both")
        store = VersionStore(args.artifact_store)
        version = store.to_serve()
        directory = store.path(version)
        config = dataclasses.replace(config, artifact=directory)
    elif args.artifact is not None:
        directory = args.artifact
    else:
        from .compile.artifact import compile_artifact

        directory = compile_artifact(_request(args), args.cache_dir, None, progress=_say)
        config = dataclasses.replace(config, artifact=directory)
    model_name = config.model_name or Manifest.read(directory).model_name

    def load_engine(path):
        from .runtime.artifact import load_artifact
        from .runtime.engine import Engine

        return Engine(load_artifact(path), threads=config.threads)

    def load_model():
        from .model.tokenizer import TextTokenizer

        _say(f"loading {directory}")
        engine = load_engine(directory)
        return engine, TextTokenizer.from_folder(directory, engine.max_seq_len)

    try:
        from .server.app import serve
        from .server.swap import HotSwap
    except ImportError as err:
        raise SystemExit(f"error: the generated protocol code is missing ({err}); run `make protos`") from None
    retune = None
    if args.artifact_store is not None:
        hot_swap = HotSwap(store, version, load_engine, args.watch_seconds)
        if args.retune:
            retune = _retune_settings(args)
    elif args.retune:
        raise SystemExit("error: --retune needs --artifact-store (new versions are published there)")
    return asyncio.run(serve(config, model_name, load_model, _say, hot_swap=hot_swap, retune=retune))


def _build_argv(args: argparse.Namespace) -> list[str]:
    """The build flags of ``args`` again, for a child command that must build the same model."""
    argv = ["--model", str(args.model), "--target", args.target, "--arch", args.arch, "--max-batch",
            str(args.max_batch), "--seed", str(args.seed), "--cache-dir", str(args.cache_dir)]
    if args.mcpu:
        argv += ["--mcpu", args.mcpu]
    if args.num_cores:
        argv += ["--num-cores", str(args.num_cores)]
    return argv


def _retune_settings(args: argparse.Namespace):
    from .server.retune import RetuneSettings

    def command(store: Path, traffic: Path) -> list[str]:
        argv = [sys.executable, "-m", "dietserve", "retune", "--store", str(store), "--traffic", str(traffic),
                "--db", str(args.retune_db or store / "records.jsonl"), "--trials", str(args.retune_trials),
                "--time-budget", str(args.retune_time_budget), "--min-gain", str(args.retune_min_gain),
                *_build_argv(args)]
        if args.retune_rpc_tracker:  # measure on a dedicated device, not beside serving
            argv += ["--rpc-tracker", args.retune_rpc_tracker, "--rpc-key", args.retune_rpc_key]
        return argv

    cpus = frozenset(int(c) for c in args.retune_cpus.split(",")) if args.retune_cpus else frozenset()
    return RetuneSettings(command=command, drift_threshold=args.retune_drift, min_rows=args.retune_min_rows,
                          min_interval_seconds=args.retune_min_interval, check_seconds=args.retune_check_seconds,
                          time_budget_seconds=args.retune_time_budget, cpus=cpus, nice=args.retune_nice)


def cmd_retune(args: argparse.Namespace) -> int:
    import time

    from .compile.tuning import PLANS_DIR, TuneRequest, read_lengths, tune_model
    from .runtime.versions import VersionStore
    from .server.retune import EXIT_NOT_FASTER

    lengths = read_lengths(args.traffic)
    out = args.work or args.store / "retune" / "work"
    request = TuneRequest(compile=_request(args), db=args.db or args.store / "records.jsonl", out=out,
                          trials=args.trials, time_budget_s=args.time_budget, lengths=lengths,
                          rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key)
    started = time.monotonic()
    artifact = tune_model(request, args.cache_dir, progress=_say)
    store = VersionStore(args.store)
    summary = {"seconds": round(time.monotonic() - started, 1), "trials": args.trials,
               "predicted_gain": _predicted_gain(store, out / PLANS_DIR, artifact, args.traffic)}
    gain = summary["predicted_gain"]
    if gain is not None and gain < args.min_gain:
        # Publishing would swap in kernels the job's own measurements say are slower.
        print(f"not published: predicted gain {gain:.2f}x over the served version is below --min-gain "
              f"{args.min_gain:g}; the tuned artifact stays in {artifact}")
        return EXIT_NOT_FASTER
    version = store.publish(artifact, tuned_for=args.traffic, plans=out / PLANS_DIR, retune_summary=summary)
    print(f"published version {version} of {args.store}, tuned for {args.traffic}"
          + (f"; predicted gain {gain:.2f}x over the served version" if gain else ""))
    return 0


def _predicted_gain(store, new_plans: Path, artifact: Path, traffic_file: Path) -> float | None:
    """The plans' own latencies, weighted by the traffic: served version's / the new ones'."""
    from .compile.tuning import predicted_gain
    from .kernels.plan import PLAN_SUFFIX, read_plans
    from .runtime.manifest import ArtifactError, Manifest
    from .runtime.traffic import Traffic, TrafficError
    from .runtime.versions import PLANS_DIR

    try:
        traffic = Traffic.load(traffic_file)
        served = store.path(store.to_serve()) / PLANS_DIR
    except (TrafficError, ArtifactError):
        return None
    if not served.is_dir():
        return None
    calls = {name: int(entry.get("calls", 1)) for name, entry in Manifest.read(artifact).dispatch.items()}
    return predicted_gain(read_plans(sorted(served.glob(f"*{PLAN_SUFFIX}"))),
                          read_plans(sorted(new_plans.glob(f"*{PLAN_SUFFIX}"))), traffic, calls)


def cmd_publish(args: argparse.Namespace) -> int:
    from .runtime.versions import VersionStore

    version = VersionStore(args.store).publish(args.artifact, keep=args.keep, tuned_for=args.tuned_for,
                                               plans=args.plans)
    print(f"published {args.artifact} as version {version} of {args.store}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from .runtime.versions import VersionStore

    store = VersionStore(args.store)
    serving = store.to_serve()
    target = store.rollback()
    print(f"{args.store}: version {serving} and later rejected; servers return to version {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dietserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    compile_parser = commands.add_parser("compile", help="compile a model into an artifact directory")
    _add_build_flags(compile_parser)
    compile_parser.add_argument("--out", type=Path, default=None,
                                help="artifact directory to write (default: a cache entry named by content hash)")
    compile_parser.add_argument("--plans", type=Path, action="append",
                                help="kernel plan file or directory to link in (repeatable; from `tune`)")
    compile_parser.set_defaults(run=cmd_compile)

    tune_parser = commands.add_parser(
        "tune", help="tune the model's dynamic operators (DietCode) and compile an artifact linking the kernels")
    _add_build_flags(tune_parser)
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
    tune_parser.set_defaults(run=cmd_tune)

    explain_parser = commands.add_parser("explain", help="which kernel variant each dynamic operator runs at a shape")
    explain_parser.add_argument("--artifact", type=Path, required=True, help="compiled artifact directory")
    explain_parser.add_argument("--seq", type=int, required=True, help="sequence length")
    explain_parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    explain_parser.add_argument("--plot", type=Path, default=None,
                                help="PNG: latency and GFLOP/s over the shape range, per operator and variant")
    explain_parser.set_defaults(run=cmd_explain)

    embed_parser = commands.add_parser("embed", help="print sentence embeddings (compiles on first use)")
    embed_parser.add_argument("texts", nargs="+", help="sentences to embed")
    _add_build_flags(embed_parser)
    embed_parser.add_argument("--artifact", type=Path, default=None, help="use this compiled artifact directory")
    embed_parser.add_argument("--similarity", action="store_true", help="print the cosine-similarity matrix")
    embed_parser.add_argument("--json", action="store_true", help="print full vectors as JSON")
    embed_parser.add_argument("--threads", type=int, default=None,
                              help="CPU threads for the kernels (default: every CPU this process may use)")
    embed_parser.set_defaults(run=cmd_embed)

    from .server.config import add_server_flags

    serve_parser = commands.add_parser(
        "serve", help="serve the model over the KServe v2 / Triton gRPC protocol (compiles on first use)")
    _add_build_flags(serve_parser)
    serve_parser.add_argument("--artifact", type=Path, default=None, help="serve this compiled artifact directory")
    serve_parser.add_argument("--artifact-store", type=Path, default=None,
                              help="serve the current version of this version store and swap in newer ones "
                                   "after checking them (see `publish`, `rollback`)")
    serve_parser.add_argument("--watch-seconds", type=float, default=5.0,
                              help="how often the version store is checked for a new version (default 5)")
    retune_group = serve_parser.add_argument_group("re-tuning (with --artifact-store)")
    retune_group.add_argument("--retune", action="store_true",
                              help="re-tune in a background process when the traffic drifts from the mix the "
                                   "served kernels were tuned for (give the build flags the versions were built with)")
    retune_group.add_argument("--retune-drift", type=float, default=0.3,
                              help="total variation distance between the mixes that starts a run (default 0.3)")
    retune_group.add_argument("--retune-min-rows", type=int, default=200,
                              help="recorded rows needed before drift counts (default 200)")
    retune_group.add_argument("--retune-min-interval", type=float, default=3600.0,
                              help="seconds between the starts of two runs (default 3600)")
    retune_group.add_argument("--retune-check-seconds", type=float, default=30.0,
                              help="how often drift is checked (default 30)")
    retune_group.add_argument("--retune-trials", type=int, default=64, help="measurements per operator (default 64)")
    retune_group.add_argument("--retune-time-budget", type=float, default=3600.0,
                              help="seconds a run may tune for (default 3600)")
    retune_group.add_argument("--retune-min-gain", type=float, default=1.0,
                              help="publish a run's version only if it predicts at least this gain over the "
                                   "served one (default 1.0: never one it predicts slower; 0: always)")
    retune_group.add_argument("--retune-cpus", default=None,
                              help="comma-separated CPU numbers the job may use (default: all)")
    retune_group.add_argument("--retune-nice", type=int, default=10, help="the job's niceness (default 10)")
    retune_group.add_argument("--retune-rpc-tracker", default=None,
                              help="host:port of a TVM RPC tracker: the job measures on its devices (a dedicated "
                                   "GPU) instead of this machine")
    retune_group.add_argument("--retune-rpc-key", default="local", help="device key registered with the tracker")
    retune_group.add_argument("--retune-db", type=Path, default=None,
                              help="tuning records, reused across runs (default STORE/records.jsonl)")
    add_server_flags(serve_parser)
    serve_parser.set_defaults(run=cmd_serve)

    retune_parser = commands.add_parser(
        "retune", help="tune for a recorded traffic mix and publish the result as a store's next version")
    _add_build_flags(retune_parser)
    retune_parser.add_argument("--store", type=Path, required=True, help="version store directory")
    retune_parser.add_argument("--traffic", type=Path, required=True,
                               help="traffic file (serve --traffic-file) or lengths file to tune for")
    retune_parser.add_argument("--db", type=Path, default=None,
                               help="tuning records, reused (default STORE/records.jsonl)")
    retune_parser.add_argument("--trials", type=int, default=64, help="measurements per operator (default 64)")
    retune_parser.add_argument("--time-budget", type=float, default=None, help="seconds for all operators")
    retune_parser.add_argument("--min-gain", type=float, default=1.0,
                               help="publish only if the plans' predicted gain over the served version's, weighted "
                                    "by the traffic, is at least this (default 1.0); otherwise exit 3 and publish "
                                    "nothing. A run with nothing to compare against always publishes")
    retune_parser.add_argument("--rpc-tracker", default=None, help="host:port of a TVM RPC tracker to measure on")
    retune_parser.add_argument("--rpc-key", default="local", help="device key registered with the tracker")
    retune_parser.add_argument("--work", type=Path, default=None,
                               help="folder for tasks and plans (default STORE/retune/work)")
    retune_parser.set_defaults(run=cmd_retune)

    publish_parser = commands.add_parser("publish", help="add an artifact to a version store as its next version")
    publish_parser.add_argument("artifact", type=Path, help="compiled artifact directory")
    publish_parser.add_argument("--store", type=Path, required=True, help="version store directory")
    publish_parser.add_argument("--keep", type=int, default=5, help="versions to keep (default 5)")
    publish_parser.add_argument("--tuned-for", type=Path, default=None,
                                help="the traffic file (or lengths) its kernels were tuned for: drift is measured "
                                     "against it")
    publish_parser.add_argument("--plans", type=Path, default=None,
                                help="its kernel plans (`tune`'s OUT/plans): a later re-tune predicts its gain "
                                     "against them")
    publish_parser.set_defaults(run=cmd_publish)

    rollback_parser = commands.add_parser(
        "rollback", help="point a version store back at the version before the served one; servers follow")
    rollback_parser.add_argument("--store", type=Path, required=True, help="version store directory")
    rollback_parser.set_defaults(run=cmd_rollback)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .compile.target import TargetError
    from .kernels.plan import PlanError
    from .kernels.tasks import TuningError
    from .model.checkpoint import CheckpointError
    from .runtime.manifest import ArtifactError
    from .server.config import ConfigError

    try:
        return args.run(args)
    except (ArtifactError, CheckpointError, ConfigError, PlanError, TargetError, TuningError, ValueError,
            OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
