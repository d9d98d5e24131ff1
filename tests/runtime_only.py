"""TVM's runtime alone: the installed ``tvm`` package without its compiler, as a GPU host or a
server image without the compiler has it (``libtvm_runtime.so`` loads and runs an exported
library; ``TVM_USE_RUNTIME_LIB=1`` makes ``import tvm`` load nothing else)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

COMPILER_LIBRARY = "libtvm_compiler.so"
COMPILER_FOLDERS = frozenset({"src", "include", "3rdparty", "__pycache__"})


def installed_tvm_package() -> Path:
    import tvm

    return Path(tvm.__file__).resolve().parent


def is_runtime_file(relative: Path) -> bool:
    """Whether a path inside the ``tvm`` package belongs to the runtime-only copy."""
    parts = Path(relative).parts
    return not any(part in COMPILER_FOLDERS for part in parts) and parts[-1:] != (COMPILER_LIBRARY,)


def copy_runtime_package(site: Path) -> Path:
    """Copy the installed ``tvm`` package, less its compiler, to ``site/tvm``; returns ``site``
    (put it first on ``PYTHONPATH``)."""
    package = installed_tvm_package()

    def ignore(folder: str, names: list[str]) -> list[str]:
        relative = Path(folder).relative_to(package)
        return [name for name in names if not is_runtime_file(relative / name)]

    shutil.copytree(package, site / "tvm", ignore=ignore)
    return site


def runtime_only_env(site: Path) -> dict[str, str]:
    """The environment of a child process whose ``import tvm`` finds the copy in ``site``."""
    path = [str(site), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), TVM_USE_RUNTIME_LIB="1")
