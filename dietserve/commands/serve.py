"""``serve``: the server over compiled artifacts and version stores (several: one engine and queue
each), a store's versions hot-swapped and re-tuned in the background per model, and by default
the host's own tuning (``auto_tune.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ..host.cpu_turns import CpuTurns
from .common import add_build_flags, add_plans_flag, build_argv, in_child, runtime_only, say

# TVM's pool threads spin 300000 yields after each parallel kernel by default: a re-tuning job's
# timing, in its turn right after a batch (``host/cpu_turns.py``), would share a core with them.
# A few thousand still bridge the gaps between one execution's kernels and between batches under
# load (docs/design/serving.md).
SHORT_SPIN = "3000"


def compiled_in_child(args: argparse.Namespace, environment: dict[str, str]) -> Path:
    """The artifact (a cache entry) ``compile`` makes of the build flags of ``args``, in a child
    process: serving loads TVM's runtime alone (``runtime_only``)."""
    command = ["compile", *build_argv(args)]
    for plans in args.plans or []:
        command += ["--plans", plans]
    return Path(in_child(command, environment))


def short_pool_spin(args: argparse.Namespace, auto_tune: bool, environ) -> None:
    """Where a re-tuning job may time on these CPUs, TVM's pool spins briefly (unless set)."""
    if (args.retune or auto_tune) and not args.retune_rpc_tracker:
        environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", SHORT_SPIN)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import logging

    from ..runtime.manifest import Manifest
    from ..server.config import config_from_args

    logging.basicConfig(level=logging.INFO, format="[dietserve] %(levelname)s %(name)s: %(message)s")
    given, stores = _given_sources(args)
    config = config_from_args(args, given[0] if given else None)  # checks the flags before a long compile
    auto_tune = _auto_tune(args, stores)
    _check_sources(args, given, stores, auto_tune)
    short_pool_spin(args, auto_tune, os.environ)  # before any kernel starts TVM's pool
    compiler_environment = runtime_only(os.environ)  # before anything imports TVM
    start_reason = None
    if auto_tune:
        store, version, start_reason = _open_auto_tuned_store(args, stores, compiler_environment)
        served_stores = [(store, version)]
    else:
        served_stores = [_open_store(root) for root in stores]
    if not given and not served_stores:
        given = [compiled_in_child(args, compiler_environment)]
    directories = given + [store.path(version) for store, version in served_stores]
    config = dataclasses.replace(config, artifact=directories[0])
    names = [config.model_name or Manifest.read(directory).model_name for directory in directories]
    load_engine = _engine_loader(config.threads)
    try:
        from ..server.app import serve
        from ..server.swap import HotSwap
    except ImportError as err:
        raise SystemExit(f"error: the generated protocol code is missing ({err}); run `make protos`") from None
    hot_swaps = [None] * len(given) + [HotSwap(store, version, load_engine, args.watch_seconds, args.swap_min_gain)
                                       for store, version in served_stores]
    sources = _model_sources(names, directories, hot_swaps, load_engine)
    retune = retune_settings(args, start_reason, compiler_environment) if args.retune or start_reason else None
    try:
        return asyncio.run(serve(config, sources, say, retune=retune))
    finally:
        if retune is not None and retune.cpu_turns is not None:
            CpuTurns(retune.cpu_turns).remove()


def _engine_loader(threads: int | None):
    def load_engine(path: Path):
        from ..runtime.artifact import load_artifact
        from ..runtime.engine import Engine

        return Engine(load_artifact(path), threads=threads)

    return load_engine


def _model_sources(names: list[str], directories: list[Path], hot_swaps: list, load_engine) -> list:
    """A ``ModelSource`` per artifact (loaded on the server's worker thread), with its hot swap
    where it comes from a version store; a name two artifacts would share is refused here, before
    anything loads."""
    from ..runtime.embedder import artifact_tokenizer
    from ..server.model import served_names
    from ..server.served_artifact import ModelSource

    try:
        served_names(names)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None

    def loader(directory: Path):
        def load_model():
            say(f"loading {directory}")
            engine = load_engine(directory)
            return engine, artifact_tokenizer(engine)

        return load_model

    return [ModelSource(name, loader(directory), hot_swap)
            for name, directory, hot_swap in zip(names, directories, hot_swaps, strict=True)]


def _given_sources(args: argparse.Namespace) -> tuple[list[Path], list[Path]]:
    """(artifacts, version stores): the ``--artifact`` and ``--artifact-store`` directories, then
    each subfolder of ``--model-repository`` by name (as Triton's model repository) holding an
    artifact (``manifest.json``, as `dietserve compile` writes) or a store (``versions/``, as
    `dietserve publish` writes). A repository with neither is refused."""
    from ..runtime.versions import VERSIONS_DIR

    artifacts, stores = list(args.artifact or []), list(args.artifact_store or [])
    repository = args.model_repository
    if repository is None:
        return artifacts, stores
    if not repository.is_dir():
        raise SystemExit(f"error: --model-repository {repository} is not a directory")
    found = sorted(path for path in repository.iterdir() if path.is_dir())
    in_artifacts = [path for path in found if (path / "manifest.json").is_file()]
    in_stores = [path for path in found if (path / VERSIONS_DIR).is_dir()]
    if not in_artifacts and not in_stores:
        raise SystemExit(f"error: --model-repository {repository} has no artifact (a subfolder with a "
                         "manifest.json, as `dietserve compile` writes) and no version store (a subfolder with "
                         "versions/, as `dietserve publish` writes)")
    return artifacts + in_artifacts, stores + in_stores


def _check_sources(args: argparse.Namespace, given: list[Path], stores: list[Path], auto_tune: bool) -> None:
    """Refuses flag combinations that cannot hold, before anything is compiled or loaded."""
    if args.swap_min_gain < 0:
        raise SystemExit(f"error: --swap-min-gain must be 0 or more, got {args.swap_min_gain}")
    served = len(given) + len(stores)
    if served > 1 and args.model_name is not None:
        raise SystemExit(f"error: --model-name names the one artifact served; {served} are given, each served "
                         "under its manifest's model_name")
    if served > 1 and args.traffic_file is not None:
        raise SystemExit("error: --traffic-file records one artifact's traffic (for re-tuning it); it cannot be "
                         f"used with {served} artifacts (each store's job gets its model's traffic)")
    if args.retune and not stores and not auto_tune:
        raise SystemExit("error: --retune needs --artifact-store (new versions are published there)")


def _auto_tune(args: argparse.Namespace, stores: list[Path]) -> bool:
    """Whether this server tunes its host (``auto_tune.py``): asked, on a CPU, serving one model
    (the default model's store, or the one store given), and with the tuner's packages installed
    (else said why not)."""
    from .auto_tune import tuner_installed

    if not (args.auto_tune and args.target == "llvm" and args.artifact is None and args.model_repository is None
            and len(stores) <= 1):
        return False
    if not tuner_installed():
        say("not tuning for this host: the tuner's packages are not installed (pip install 'dietserve[tune]', "
            "as make serve does); serving the cold-start kernels")
        return False
    return True


def _open_store(root: Path):
    """(store, the version it serves)."""
    from ..runtime.manifest import ArtifactError
    from ..runtime.versions import VersionStore

    store = VersionStore(root)
    try:
        return store, store.to_serve()
    except ArtifactError as err:
        raise SystemExit(f"error: --artifact-store: {err}") from None


def _open_auto_tuned_store(args: argparse.Namespace, stores: list[Path], compiler_environment: dict[str, str]):
    """(store, version to serve, why to tune at once or None)."""
    from ..runtime.versions import VersionStore
    from .auto_tune import default_store, version_to_serve

    target = json.loads(in_child(["target", *build_argv(args)], compiler_environment))
    store = VersionStore(stores[0] if stores else default_store(args, target))
    version, reason = version_to_serve(store, target, lambda: compiled_in_child(args, compiler_environment), say)
    say(f"serving version {version} of {store.root}" + (f"; {reason}: tuning it in the background" if reason else
                                                         ", tuned for this host"))
    return store, version, reason


def retune_settings(args: argparse.Namespace, start_reason: str | None = None,
                    environment: dict[str, str] | None = None):
    """The re-tuning job and when it runs: on drift (``--retune``), and at once given ``start_reason``."""
    from ..server.retune import RetuneSettings

    def command(store: Path, traffic: Path) -> list[str]:
        argv = [sys.executable, "-m", "dietserve", "retune", "--store", str(store), "--traffic", str(traffic),
                "--db", str(args.retune_db or store / "records.jsonl"), "--trials", str(args.retune_trials),
                "--time-budget", str(args.retune_time_budget), "--min-gain", str(args.retune_min_gain),
                *build_argv(args)]
        if args.retune_rpc_tracker:  # measure on a dedicated device, not beside serving
            argv += ["--rpc-tracker", args.retune_rpc_tracker, "--rpc-key", args.retune_rpc_key]
        else:
            argv += ["--cpu-turns", str(cpu_turns)]
        return argv

    # This server's own (flock is per machine: replicas on a shared store must not take turns)
    cpu_turns = None if args.retune_rpc_tracker else Path(tempfile.gettempdir()) / f"dietserve-{os.getpid()}.cpu-turns"

    cpus = frozenset(int(c) for c in args.retune_cpus.split(",")) if args.retune_cpus else frozenset()
    return RetuneSettings(command=command, drift_threshold=args.retune_drift if args.retune else math.inf,
                          min_rows=args.retune_min_rows, min_interval_seconds=args.retune_min_interval,
                          check_seconds=args.retune_check_seconds, time_budget_seconds=args.retune_time_budget,
                          cpus=cpus, nice=args.retune_nice, start_reason=start_reason, cpu_turns=cpu_turns,
                          environment=environment)


def add_serve_command(commands) -> None:
    from ..server.config import add_server_flags

    serve_parser = commands.add_parser(
        "serve", help="serve the model over the KServe v2 / Triton gRPC protocol (compiles on first use)")
    add_build_flags(serve_parser)
    add_plans_flag(serve_parser, files=False)
    serve_parser.add_argument("--artifact", type=Path, action="append", default=None,
                              help="serve this compiled artifact directory; repeat it to serve several (an embedder "
                                   "and a reranker), each under its manifest's model name")
    serve_parser.add_argument("--model-repository", type=Path, default=None,
                              help="serve every artifact and version store in this directory's subfolders (as "
                                   "Triton's model repository), beside any --artifact and --artifact-store")
    serve_parser.add_argument("--artifact-store", type=Path, action="append", default=None,
                              help="serve the current version of this version store and swap in newer ones "
                                   "after checking them (see `publish`, `rollback`); repeat it (or put stores in "
                                   "--model-repository) to serve several, each swapped and re-tuned on its own")
    serve_parser.add_argument("--watch-seconds", type=float, default=5.0,
                              help="how often the version store is checked for a new version (default 5)")
    serve_parser.add_argument("--swap-min-gain", type=float, default=0.9,
                              help="refuse a newer version measured below this fraction of the served version's "
                                   "speed, timed side by side on the traffic's heaviest shapes before swapping "
                                   "(default 0.9; 0: swap without timing). Rollbacks are not timed")
    serve_parser.add_argument("--auto-tune", action=argparse.BooleanOptionalAction, default=True,
                              help="on a CPU without --artifact: serve from a version store (--artifact-store, "
                                   "default one per model and host under --cache-dir) and, when no version there "
                                   "was tuned for this host, serve the cold start (--plans) at once and tune in "
                                   "the background (the re-tuning job: --retune-* flags), then swap them in "
                                   "(default on; needs the tuner's packages)")
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
