"""The version-store commands: ``retune`` (tune for a traffic mix, publish if faster), ``publish``
and ``rollback``; the store itself is ``runtime/versions.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_build_flags, compile_request, say


def cmd_retune(args: argparse.Namespace) -> int:
    import time

    from ..compile.tuning import PLANS_DIR, TuneRequest, read_observations, tune_model
    from ..runtime.versions import VersionStore
    from ..server.retune import EXIT_NOT_FASTER

    lengths, tokens = read_observations(args.traffic)
    out = args.work or args.store / "retune" / "work"
    request = TuneRequest(compile=_served_build(args), db=args.db or args.store / "records.jsonl", out=out,
                          trials=args.trials, time_budget_s=args.time_budget, lengths=lengths,
                          tokens=tokens, rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key,
                          cpu_turns=args.cpu_turns)
    started = time.monotonic()
    artifact = tune_model(request, args.cache_dir, progress=say)
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


def _served_build(args: argparse.Namespace):
    """The compile request of the store's served version, from its manifest's build record (the
    build flags for a version without one): a server re-tuning several models runs one job per
    store, each building its own model."""
    from ..compile.artifact import CompileRequest
    from ..runtime.manifest import ArtifactError, Manifest
    from ..runtime.versions import VersionStore

    store = VersionStore(args.store)
    try:
        record = Manifest.read(store.path(store.to_serve())).build
    except ArtifactError as err:
        raise SystemExit(f"error: {args.store} has no version to re-tune: {err}") from None
    if record is None:
        return compile_request(args)
    try:
        request = CompileRequest.from_build_record(record)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    say(f"re-tuning {request.model} as the served version was built (max batch {request.max_batch})")
    return request


def _predicted_gain(store, new_plans: Path, artifact: Path, traffic_file: Path) -> float | None:
    """The plans' own latencies, weighted by the traffic: served version's / the new ones'."""
    from ..compile.tuning import predicted_gain
    from ..kernels.plan.kernel_plan import PLAN_SUFFIX, read_plans
    from ..runtime.manifest import ArtifactError, Manifest
    from ..runtime.traffic import Traffic, TrafficError
    from ..runtime.versions import PLANS_DIR

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
    from ..runtime.versions import VersionStore

    version = VersionStore(args.store).publish(args.artifact, keep=args.keep, tuned_for=args.tuned_for,
                                               plans=args.plans)
    print(f"published {args.artifact} as version {version} of {args.store}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from ..runtime.versions import VersionStore

    store = VersionStore(args.store)
    serving = store.to_serve()
    target = store.rollback()
    print(f"{args.store}: version {serving} and later rejected; servers return to version {target}")
    return 0


def add_store_commands(commands) -> None:
    retune_parser = commands.add_parser(
        "retune", help="tune for a recorded traffic mix and publish the result as a store's next version (the "
                       "model built as the served version was, from its manifest)")
    add_build_flags(retune_parser)  # for a served version whose manifest has no build record
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
    retune_parser.add_argument("--cpu-turns", type=Path, metavar="LOCK_FILE",
                               help="time candidates in turns with a server's batches through this lock file "
                                    "(the server that runs the job passes it)")
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
