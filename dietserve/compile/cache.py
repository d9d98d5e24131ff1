"""The compile cache's artifacts (``CACHE/artifacts/NAME-KIND-KEY``): listing and pruning.

Every compile of a changed model, target, plan set or compiler writes a new entry (bert-base's
is 420 MB, MiniLM's 90 MB) and none is ever replaced, so the folder only grows: eleven
bert-base builds filled a CI machine's disk. ``python -m dietserve cache`` lists the entries and
``--prune`` keeps the most recently used few of each model and target kind. An entry is "used"
when it is compiled or found up to date (``compile_artifact`` marks it); a server that was
given an artifact's path loads it without marking, so prune before a server's next start, not
under it (a running server has its files open and keeps serving; a restart would compile again).

Needs no TVM: the cache is read through the manifests' JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..runtime.manifest import MANIFEST_FILE, folder_bytes

ARTIFACTS_DIR = "artifacts"
# A staging folder (``.NAME-...``, see ``compile_artifact``) older than this is a crashed
# compile's leftover; a younger one may be a compile in progress.
STALE_STAGING_SECONDS = 24 * 3600


@dataclass(frozen=True)
class CachedArtifact:
    path: Path
    model: str | None  # the manifest's model_name; None where the manifest is unreadable
    kind: str | None  # the target kind (llvm, cuda); None where unreadable
    last_used: float  # the folder's modification time, set on every compile or cache hit
    size: int  # bytes

    @property
    def readable(self) -> bool:
        return self.model is not None


def mark_used(directory: Path) -> None:
    """Record a use of a cache entry (its folder's mtime), for ``prune``'s recency order."""
    try:
        os.utime(directory)
    except OSError:
        pass  # a read-only cache is never pruned by this process either


def _describe(directory: Path) -> tuple[str | None, str | None]:
    try:
        raw = json.loads((directory / MANIFEST_FILE).read_text())
        return str(raw["model_name"]), str(raw["target"]["kind"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def cached_artifacts(cache_dir: Path) -> list[CachedArtifact]:
    """The cache's artifact folders (staging folders excluded), most recently used first."""
    folder = Path(cache_dir) / ARTIFACTS_DIR
    if not folder.is_dir():
        return []
    entries = []
    for directory in folder.iterdir():
        if directory.name.startswith(".") or not directory.is_dir():
            continue
        model, kind = _describe(directory)
        entries.append(CachedArtifact(directory, model, kind, directory.stat().st_mtime, folder_bytes(directory)))
    return sorted(entries, key=lambda entry: entry.last_used, reverse=True)


def stale_staging(cache_dir: Path, now: float | None = None) -> list[Path]:
    """Staging folders left by compiles that died (older than ``STALE_STAGING_SECONDS``)."""
    folder = Path(cache_dir) / ARTIFACTS_DIR
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    return sorted(d for d in folder.iterdir() if d.name.startswith(".") and d.is_dir()
                  and now - d.stat().st_mtime > STALE_STAGING_SECONDS)


def to_prune(entries: list[CachedArtifact], keep: int) -> list[CachedArtifact]:
    """All but the ``keep`` most recently used of ``entries`` (``cached_artifacts``) for each
    (model, target kind). Entries whose manifest cannot be read are not dietserve's to judge and
    are kept."""
    if keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    groups: dict[tuple[str, str], list[CachedArtifact]] = defaultdict(list)
    for entry in sorted(entries, key=lambda entry: entry.last_used, reverse=True):
        if entry.readable:
            groups[(entry.model, entry.kind)].append(entry)
    return [entry for group in groups.values() for entry in group[keep:]]


def prune(cache_dir: Path, doomed: list[CachedArtifact]) -> tuple[list[Path], int]:
    """Delete ``doomed`` (``to_prune``'s answer) and the stale staging folders; returns them and
    the bytes freed. Each entry is renamed to a staging-like name first, so a compile never
    finds it half gone."""
    removed, freed = [], 0
    for entry in doomed:
        renamed = entry.path.with_name(f".{entry.path.name}-pruned-{os.getpid()}")
        os.replace(entry.path, renamed)
        shutil.rmtree(renamed)
        removed.append(entry.path)
        freed += entry.size
    for leftover in stale_staging(cache_dir):
        freed += folder_bytes(leftover)
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed, freed
