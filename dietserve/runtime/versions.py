"""Artifact versions for hot swaps: the one place that reads and writes a version store.

    STORE/versions/000001/      an artifact directory (manifest.json, model.so, ...)
    STORE/versions/000002/
    STORE/versions/000002/tuned_for.json   the traffic its kernels were tuned for (optional)
    STORE/versions/000002/plans/, retune.json   its kernel plans, the re-tune's prediction (optional)
    STORE/versions/000003/REJECTED   present: a server refused it (the file says why)
    STORE/versions/000001/KEPT       present: a job that tuned this host found nothing faster than
                                this version (the file says why), so it counts as tuned
    STORE/current               the number of the version a server verified and serves
    STORE/publish.lock, STORE/retune.lock   held while a server publishes its first version, while
                                a re-tuning job runs (``StoreLock``: servers sharing the store)

A version appears whole or not at all: it is copied into a hidden temporary directory of the
store and renamed to the next number. ``current`` is replaced atomically. A server serves
``current`` (or, when there is none, the newest version not rejected), and adopts a newer
version only after checking it against the one it serves; a rollback points ``current`` back
and rejects the versions after it. The newest ``keep`` versions are kept.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..host.atomic_io import write_text_atomic
from .manifest import MANIFEST_FILE, PLANS_TUNED, ArtifactError, Manifest

VERSIONS_DIR = "versions"
CURRENT_FILE = "current"
REJECTED_FILE = "REJECTED"
KEPT_FILE = "KEPT"
TUNED_FOR_FILE = "tuned_for.json"  # the traffic (runtime/traffic.py) a version's kernels were tuned for
PLANS_DIR = "plans"  # the kernel plans linked into it, when it came from tuning
RETUNE_FILE = "retune.json"  # what the re-tuning job that made it predicted: {"predicted_gain": x, ...}
DEFAULT_KEEP = 5
PUBLISH_LOCK = "publish.lock"  # a server compiling and publishing the store's first version for its host
RETUNE_LOCK = "retune.lock"  # a server's re-tuning job is running on this store


class StoreLock:
    """An exclusive lock on a store, between the servers (replicas on several nodes) sharing it:
    POSIX record locks on a file in the store, which NFS and the other shared volumes honour, and
    which the kernel drops when the holder dies. Held by a process: two holders in one process
    do not exclude each other (a server's own models share a ``retune.JobSlot`` instead)."""

    def __init__(self, path: Path):
        self.path, self._fd = Path(path), None

    def acquire(self, wait: bool) -> bool:
        """Takes the lock; False if another process holds it and ``wait`` is off."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            if wait:
                raise
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the process's locks on the file
            self._fd = None

    def __enter__(self) -> StoreLock:
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class VersionStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.versions_dir = self.root / VERSIONS_DIR

    def path(self, version: int) -> Path:
        return self.versions_dir / f"{version:06d}"

    def lock(self, name: str) -> StoreLock:
        """``PUBLISH_LOCK`` or ``RETUNE_LOCK``: see ``StoreLock``."""
        return StoreLock(self.root / name)

    def tuned(self, version: int) -> bool:
        """Whether the version came from tuning: its manifest says its plans were measured (a
        cold start's were not); one whose manifest does not say (from before manifests said, or
        unreadable here) keeps plans only when tuned. A version a tuning job could not beat
        (``keep_as_tuned``) counts too: tuning the host again at each start would find the same."""
        if (self.path(version) / KEPT_FILE).is_file():
            return True
        try:
            source = Manifest.read(self.path(version)).kernel_plans
        except ArtifactError:
            source = None
        return source == PLANS_TUNED if source is not None else (self.path(version) / PLANS_DIR).is_dir()

    def versions(self) -> list[int]:
        """Every complete version, oldest first (temporary directories are not versions)."""
        if not self.versions_dir.is_dir():
            return []
        return sorted(int(entry.name) for entry in self.versions_dir.iterdir()
                      if entry.name.isdigit() and (entry / MANIFEST_FILE).is_file())

    def rejected(self, version: int) -> str | None:
        marker = self.path(version) / REJECTED_FILE
        return marker.read_text() if marker.is_file() else None

    def current(self) -> int | None:
        """The version a server verified last (``current``), if it still exists."""
        try:
            version = int((self.root / CURRENT_FILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return version if version in self.versions() else None

    def to_serve(self) -> int:
        """``current``, else the newest version not rejected."""
        current = self.current()
        if current is not None:
            return current
        candidates = [v for v in self.versions() if self.rejected(v) is None]
        if not candidates:
            raise ArtifactError(f"version store {self.root} holds no usable version")
        return candidates[-1]

    def newer_candidate(self, than: int) -> int | None:
        """The newest version after ``than`` that is not rejected."""
        candidates = [v for v in self.versions() if v > than and self.rejected(v) is None]
        return candidates[-1] if candidates else None

    def set_current(self, version: int) -> None:
        write_text_atomic(self.root / CURRENT_FILE, f"{version}\n")

    def reject(self, version: int, reason: str) -> None:
        write_text_atomic(self.path(version) / REJECTED_FILE, reason.rstrip() + "\n")

    def keep_as_tuned(self, version: int, reason: str) -> None:
        write_text_atomic(self.path(version) / KEPT_FILE, reason.rstrip() + "\n")

    def tuned_for(self, version: int) -> Path | None:
        path = self.path(version) / TUNED_FOR_FILE
        return path if path.is_file() else None

    def retune_summary(self, version: int) -> dict:
        path = self.path(version) / RETUNE_FILE
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return summary if isinstance(summary, dict) else {}

    def publish(self, artifact: Path, keep: int = DEFAULT_KEEP, tuned_for: Path | None = None,
                plans: Path | None = None, retune_summary: dict | None = None) -> int:
        """Copies ``artifact`` in as the next version, with the traffic file its kernels were
        tuned for, their plans and the re-tuning job's summary where given; returns its number."""
        if not (Path(artifact) / MANIFEST_FILE).is_file():
            raise ArtifactError(f"{artifact} is not an artifact: {MANIFEST_FILE} is missing")
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.versions_dir))
        try:
            shutil.copytree(artifact, staging, dirs_exist_ok=True)
            (staging / REJECTED_FILE).unlink(missing_ok=True)
            (staging / KEPT_FILE).unlink(missing_ok=True)
            if tuned_for is not None:
                shutil.copyfile(tuned_for, staging / TUNED_FOR_FILE)
            if plans is not None:
                shutil.copytree(plans, staging / PLANS_DIR, dirs_exist_ok=True)
            if retune_summary is not None:
                (staging / RETUNE_FILE).write_text(json.dumps(retune_summary))
            while True:
                version = max(self.versions(), default=0) + 1
                try:
                    os.rename(staging, self.path(version))  # fails if another publisher took the number
                    break
                except OSError:
                    if not self.path(version).exists():
                        raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.prune(keep)
        return version

    def rollback(self) -> int:
        """Points ``current`` at the version before it and rejects the versions after that one."""
        serving = self.to_serve()
        older = [v for v in self.versions() if v < serving and self.rejected(v) is None]
        if not older:
            raise ArtifactError(f"version store {self.root}: nothing to roll back to before version {serving}")
        target = older[-1]
        for version in self.versions():
            if version > target:
                self.reject(version, f"rolled back to version {target}")
        self.set_current(target)
        return target

    def prune(self, keep: int) -> None:
        """Deletes all but the newest ``keep`` versions, never the current one."""
        current = self.current()
        for version in self.versions()[:-keep]:
            if version != current:
                shutil.rmtree(self.path(version), ignore_errors=True)
