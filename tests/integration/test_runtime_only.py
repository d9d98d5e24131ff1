"""The serving side on TVM's runtime alone (no compiler library, as on a GPU host or in the
server image): the engine, the server's modules and a real server process load a compiled
artifact and answer, and nothing of the compiler or the tuner is imported on the way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from dietserve.runtime.tvm_runtime_only import COMPILER_LIBRARY, installed_tvm_package

from .reference import padded_batch, reference_hidden
from .server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.slow

# What a serving process must not import beyond what ``import tvm`` itself loads: TVM's compiler
# side and our compile, kernel-building and tuning layers.
COMPILER_MODULES = ("tvm.relax", "tvm.s_tir", "tvm.te", "tvm.topi", "tvm.tirx", "tvm.target", "tvm.driver",
                    "tvm.script", "dietserve.compile", "dietserve.kernels.apply", "dietserve.kernels.cpu_padded.kernel",
                    "tuner")

IMPORTS_AND_RUN = """
import json, sys
from pathlib import Path
import numpy as np
import tvm
loaded_by_tvm = set(sys.modules)
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
import dietserve.__main__, dietserve.commands.serve, dietserve.server.app, dietserve.server.retune
engine = Engine(load_artifact(Path(sys.argv[1])))
ids = np.array([[101, 2023, 2003, 1037, 3231, 102]], dtype=np.int64)
hidden = engine.run(ids, np.ones_like(ids), np.zeros_like(ids)).last_hidden_state
loaded = sorted(name for name in set(sys.modules) - loaded_by_tvm if name.startswith(tuple(json.loads(sys.argv[2]))))
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "compiler_modules": loaded,
                  "hidden": hidden[0].tolist()}))
"""


def runtime_only_env(site: Path) -> dict[str, str]:
    """A child process's environment whose ``import tvm`` finds the runtime-only copy in ``site``
    and loads the runtime library alone."""
    path = [str(site), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), TVM_USE_RUNTIME_LIB="1")


@pytest.fixture(scope="module")
def runtime_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed ``tvm`` package, hard-linked into a folder, stripped by the command the server
    images run; returns the folder to put first on ``PYTHONPATH``."""
    site = tmp_path_factory.mktemp("tvm-runtime-only")
    shutil.copytree(installed_tvm_package(), site / "tvm", copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "dietserve.runtime.tvm_runtime_only", "--strip", "--package",
                           str(site / "tvm")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not list((site / "tvm").rglob(COMPILER_LIBRARY)) and not (site / "tvm" / "3rdparty").exists()
    assert (site / "tvm" / "lib" / "libtvm_runtime.so").is_file()
    return site


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)  # stripping the copy unlinks its names only
    except OSError:
        shutil.copy2(source, destination)


def test_the_engine_runs_without_the_compiler(runtime_site: Path, minilm_artifact: Path, minilm_reference) -> None:
    done = subprocess.run([sys.executable, "-c", IMPORTS_AND_RUN, str(minilm_artifact), json.dumps(COMPILER_MODULES)],
                          cwd=REPO_ROOT, env=runtime_only_env(runtime_site), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["runtime_only"], "the child loaded TVM's compiler library"
    assert report["compiler_modules"] == []
    ids = np.array([[101, 2023, 2003, 1037, 3231, 102]], dtype=np.int64)
    expected = reference_hidden(minilm_reference, ids, np.ones_like(ids), np.zeros_like(ids))[0]
    assert np.abs(np.array(report["hidden"]) - expected).max() <= 1e-4


def test_the_server_answers_without_the_compiler(runtime_site: Path, minilm_artifact: Path, minilm_reference,
                                                 minilm_engine) -> None:
    server = ServerProcess(minilm_artifact, env=runtime_only_env(runtime_site))
    try:
        ids, mask, types = padded_batch(np.random.default_rng(5), 2, 37, minilm_engine.vocab_size)
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", types)):
            tensor = triton.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        with triton.InferenceServerClient(server.grpc_url) as client:
            answer = client.infer(server.model_name, inputs).as_numpy("last_hidden_state")
    finally:
        server.stop()
    real = mask.astype(bool)
    assert np.abs(answer - reference_hidden(minilm_reference, ids, mask, types))[real].max() <= 1e-4


def test_a_server_from_the_full_install_loads_the_runtime_library_alone(minilm_artifact: Path) -> None:
    """Installed with the compiler (as by ``make serve``), ``serve`` still maps only TVM's runtime
    library: it compiles in a child process, as the re-tuning job builds in its own."""
    server = ServerProcess(minilm_artifact)
    try:
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=30) as answer:
            assert answer.status == 200
    finally:
        server.stop()
    libraries = {Path(line.split()[-1]).name for line in maps.splitlines() if ".so" in line}
    assert "libtvm_runtime.so" in libraries
    assert COMPILER_LIBRARY not in libraries
