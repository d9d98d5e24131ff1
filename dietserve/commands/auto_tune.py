"""``serve --auto-tune`` (the default on a CPU): the server makes its host's tuned version itself.

The versions live in a store (``--artifact-store``, else one per model and host under the cache).
At start the server serves the version that fits this host: compiled for its CPU (the LLVM name
and core count a build here would target) by this TVM. None fits (a first start, a new host, a new
TVM): the cold-start artifact is compiled (or taken from the cache) and published, and served at
once: its kernels planned from the hardware model (``--plans analytic``), or the default rule's
(``--plans none``). A version whose manifest does not say its plans were measured was not tuned:
the re-tuning job then starts at once, for every length alike, and the hot swap checks and swaps
in what it publishes. A restart finds the tuned version current and tunes nothing. A store serves
one kind of host: versions that do not fit the host that opens it are rejected there.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from ..runtime.manifest import ArtifactError, Manifest
from ..runtime.versions import PUBLISH_LOCK, VersionStore

# What the tuning job needs beyond the server's own packages (the ``tune`` extra).
TUNER_MODULES = ("xgboost", "scipy")
NOT_TUNED = "no tuned version for this host"


def tuner_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in TUNER_MODULES)


def default_store(args: argparse.Namespace, target: dict) -> Path:
    """One store per model and host: hosts sharing a cache folder never swap each other's versions."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(args.model)).strip("_") or "model"
    host = "-".join(str(target.get(key, "")) for key in ("kind", "mcpu", "num-cores") if target.get(key))
    return Path(args.cache_dir) / "stores" / f"{model}-{host}"


def unfit_for_host(manifest: Manifest, target: dict, tvm_version: str) -> str | None:
    """Why a version does not fit this host (None: it does): another CPU or core count than a
    build here targets, or another TVM."""
    for key in ("kind", "mcpu", "num-cores"):
        if str(manifest.target.get(key)) != str(target.get(key)):
            return f"built for {key} {manifest.target.get(key)}, this host's is {target.get(key)}"
    if manifest.tvm_version != tvm_version:
        return f"built with TVM {manifest.tvm_version}, this is TVM {tvm_version}"
    return None


def version_to_serve(store: VersionStore, target: dict, compile_cold: Callable[[], Path],
                     say: Callable[[str], None]) -> tuple[int, str | None]:
    """(the version to serve, why the host is to be tuned; None: that version is tuned for it).
    The store's own choice if it fits the host, else its newest fitting version, else the
    cold-start artifact compiled and published. Replicas sharing the store take turns (its publish
    lock): the first publishes, the others find that version and serve it."""
    with store.lock(PUBLISH_LOCK):
        return _version_to_serve(store, target, compile_cold, say)


def _version_to_serve(store: VersionStore, target: dict, compile_cold: Callable[[], Path],
                      say: Callable[[str], None]) -> tuple[int, str | None]:
    tvm_version = metadata.version("apache-tvm")  # as tvm.__version__ says it, without importing TVM
    try:
        preferred = [store.to_serve()]
    except ArtifactError:
        preferred = []
    candidates = preferred + [v for v in reversed(store.versions()) if store.rejected(v) is None]
    for version in dict.fromkeys(candidates):
        try:
            reason = unfit_for_host(Manifest.read(store.path(version)), target, tvm_version)
        except ArtifactError as err:
            reason = str(err)
        if reason is None:
            return version, None if store.tuned(version) else NOT_TUNED
        say(f"version {version} of {store.root} does not fit this host: {reason}")
        # Rejected, so that the hot swap never takes it for a newer version (a store serves one host).
        store.reject(version, f"does not fit the host that opened the store: {reason}")
    version = store.publish(compile_cold())
    store.set_current(version)
    say(f"published the cold-start artifact as version {version} of {store.root}")
    return version, NOT_TUNED
