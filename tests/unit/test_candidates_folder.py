"""The builders' library folder (``tuner/measure/runner.candidates_folder``): a tuner killed
outright leaves its folder behind, and the next one removes it, not a running tuner's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tuner.measure.runner import CANDIDATES_PREFIX, candidates_folder


def test_the_folders_of_processes_no_longer_running_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid now names no process (none started since in this test's moments)
    dead = tmp_path / f"{CANDIDATES_PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{CANDIDATES_PREFIX}{os.getppid()}-def"  # pytest's parent: running
    unnamed = tmp_path / f"{CANDIDATES_PREFIX}xyz"  # an older tuner's name: no owner to check
    other = tmp_path / "something-else-1-x"
    for folder in (dead, alive, unnamed, other):
        folder.mkdir()
        (folder / "candidate-0.so").write_bytes(b"\0" * 16)
    made = candidates_folder(str(tmp_path))
    try:
        assert not dead.exists()
        assert alive.exists() and unnamed.exists() and other.exists()
        assert Path(made.name).parent == tmp_path
        assert Path(made.name).name.startswith(f"{CANDIDATES_PREFIX}{os.getpid()}-")
        assert candidates_folder(str(tmp_path)).name != made.name  # ours is not removed: we run
        assert Path(made.name).exists()
    finally:
        made.cleanup()
