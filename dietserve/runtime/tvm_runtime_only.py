"""TVM's runtime alone: the files of the installed ``tvm`` package that serving needs, and the
ones only its compiler does (``libtvm_compiler.so``, 259 MB of the 305 MB package, and the
compiler's sources, headers and third-party code).

Serving (the engine, the server, the command line's ``serve``) imports nothing of TVM's
compiler, and with ``TVM_USE_RUNTIME_LIB=1`` ``import tvm`` loads ``libtvm_runtime.so`` alone
(tests/integration/test_runtime_only.py runs both on a copy stripped by this module). The
server images strip their installed TVM so:

    python -m dietserve.runtime.tvm_runtime_only --strip
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from .manifest import folder_bytes

COMPILER_LIBRARY = "libtvm_compiler.so"
COMPILER_FOLDERS = frozenset({"src", "include", "3rdparty"})
# The FFI wheel for a GPU host's python3 (its image runs 3.12); pinned as pyproject.toml pins it.
TVM_FFI_WHEEL = "apache-tvm-ffi==0.1.14.post0"
HOST_PYTHON = "3.12"


def installed_tvm_package() -> Path:
    """The ``tvm`` package's folder, found without importing it (which loads the compiler)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no tvm package is installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def is_runtime_file(relative: Path) -> bool:
    """Whether a path inside the ``tvm`` package is kept in a runtime-only install."""
    parts = Path(relative).parts
    return not any(part in COMPILER_FOLDERS for part in parts) and parts[-1:] != (COMPILER_LIBRARY,)


def strip_compiler(package: Path) -> int:
    """Delete the compiler's files from an installed ``tvm`` package; returns the bytes freed.
    Each compiler folder goes whole (its files are not visited one by one)."""
    def runtime(path: Path) -> bool:
        return is_runtime_file(path.relative_to(package))

    doomed = [path for path in package.rglob("*") if not runtime(path) and runtime(path.parent)]
    freed = 0
    for path in doomed:
        freed += folder_bytes(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return freed


def write_runtime_package(folder: Path) -> None:
    """``folder/tvm-runtime.tgz`` (this ``tvm`` package, runtime files only) and ``folder/whl/``
    (the FFI wheel for the host's Python, downloaded): what a host without TVM needs to load and
    run compiled libraries (``pip install --target`` the wheel, untar beside it, and import with
    ``TVM_USE_RUNTIME_LIB=1``)."""
    package = installed_tvm_package()

    def keep(info: tarfile.TarInfo):
        relative = Path(info.name).relative_to("tvm")
        return info if is_runtime_file(relative) and "__pycache__" not in relative.parts else None

    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "tvm-runtime.tgz", "w:gz") as archive:
        archive.add(package, arcname="tvm", filter=keep)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", HOST_PYTHON, "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "-d", str(folder / "whl"), TVM_FFI_WHEEL], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strip", action="store_true", help="delete the compiler's files from the tvm package")
    parser.add_argument("--package", type=Path, default=None,
                        help="the tvm package folder (default: the installed one)")
    args = parser.parse_args(argv)
    package = args.package or installed_tvm_package()
    if not args.strip:
        kept = [p for p in package.rglob("*") if p.is_file() and is_runtime_file(p.relative_to(package))]
        print(f"{package}: {len(kept)} runtime files; --strip deletes the rest")
        return 0
    freed = strip_compiler(package)
    print(f"{package}: the compiler's files deleted ({freed / 2**20:.0f} MiB); "
          "import it with TVM_USE_RUNTIME_LIB=1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
