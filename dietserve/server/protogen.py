"""Generates the Python protocol code from ``protos/*.proto`` with grpcio-tools.

    python -m dietserve.server.protogen [--protos DIR]

The output, ``dietserve/server/_proto``, is a build product (not committed, never edited).
Each proto file is named to protoc under the virtual path ``dietserve/server/_proto/`` so the
generated gRPC module imports its messages as ``dietserve.server._proto.X_pb2`` rather than as
a top-level module. Output is written to a temporary folder and renamed into place, so a crash
never leaves a half-generated package. The same grpcio-tools version gives the same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent / "_proto"
DEFAULT_PROTOS = Path(__file__).resolve().parents[2] / "protos"
VIRTUAL_ROOT = "dietserve/server/_proto"


class ProtoGenerationError(RuntimeError):
    pass


def generate(protos_dir: Path = DEFAULT_PROTOS, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    from grpc_tools import protoc

    sources = sorted(Path(protos_dir).glob("*.proto"))
    if not sources:
        raise ProtoGenerationError(f"no .proto files in {protos_dir}")
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
    package_dir = Path(package_dir)
    package_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=package_dir.parent, prefix=".proto-") as staging:
        out_root = Path(staging)
        for source in sources:
            args = [
                "grpc_tools.protoc",
                f"-I{VIRTUAL_ROOT}={source.parent}",
                f"-I{include}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}",
                str(source),
            ]
            if protoc.main(args) != 0:
                raise ProtoGenerationError(f"protoc failed on {source}")
        generated = out_root / VIRTUAL_ROOT
        marker = '"""Generated from protos/ by dietserve.server.protogen; do not edit."""\n'
        (generated / "__init__.py").write_text(marker)
        old = package_dir.with_name(package_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if package_dir.exists():
            package_dir.rename(old)
        generated.rename(package_dir)
        shutil.rmtree(old, ignore_errors=True)
    return sorted(package_dir.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dietserve.server.protogen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protos", type=Path, default=DEFAULT_PROTOS, help="folder of .proto files")
    args = parser.parse_args(argv)
    try:
        for path in generate(args.protos):
            print(path)
    except ProtoGenerationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
