"""The compile, promote and switch Jobs' shell scripts, run for real against a scratch /data:
`current` ends up a relative symlink to the new version, switched by rename, and a wrong
artifact or version is refused without touching it. `python -m dietserve compile` and `date`
are stand-ins; sh, ln, mv, cp and the promote check's Python are the real ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from dietserve.runtime.manifest import Manifest

from .inventory import K8S, container_argv, container_env, dietserve_invocations, find, load_documents, rendered

# `python -m dietserve compile ... --out DIR` writes a manifest; any other python runs for real.
FAKE_PYTHON = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "dietserve" ]; then
  while [ "$#" -gt 0 ]; do
    if [ "$1" = "--out" ]; then mkdir -p "$2" && echo '{{"cuda_arch": "sm_90"}}' > "$2/manifest.json"; fi
    shift
  done
  exit 0
fi
exec {sys.executable} "$@"
"""
FAKE_DATE = '#!/bin/sh\necho "$FAKE_DATE"\n'


def job_container(name: str) -> dict:
    job = load_documents(K8S / "jobs" / name)[0]
    return job["spec"]["template"]["spec"]["containers"][0]


def run_job(name: str, scratch: Path, date: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    container = job_container(name)
    assert container["command"] == ["/bin/sh", "-c"]
    script = container["args"][0].replace("/data/", f"{scratch}/data/")
    bin_dir = scratch / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("python", FAKE_PYTHON), ("date", FAKE_DATE)):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    environment = {**os.environ, **container_env(container), **(env or {}), "FAKE_DATE": date,
                   "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["/bin/sh", "-c", script], env=environment, capture_output=True, text=True, timeout=60)


def current(scratch: Path, flavour: str) -> str:
    link = scratch / "data" / "artifacts" / flavour / "current"
    assert link.is_symlink()
    return os.readlink(link)


def test_compile_job_points_current_at_each_new_version(tmp_path: Path) -> None:
    job, flavour = "compile-artifact-cuda.yaml", "cuda-sm_90"
    for version in ("20260301T020000Z", "20260308T020000Z"):
        result = run_job(job, tmp_path, version)
        assert result.returncode == 0, result.stderr
        assert current(tmp_path, flavour) == version, "a relative link: the volume mounts anywhere"
        assert (tmp_path / "data" / "artifacts" / flavour / "current" / "manifest.json").is_file()
    assert sorted(p.name for p in (tmp_path / "data" / "artifacts" / flavour).iterdir()) == [
        "20260301T020000Z", "20260308T020000Z", "current"], "no current.new left behind"


def _tuned_artifact(scratch: Path, arch: str) -> Path:
    artifact = scratch / "data" / "tuned" / "artifact"
    artifact.mkdir(parents=True)
    (artifact / "manifest.json").write_text(json.dumps({"cuda_arch": arch}))
    (artifact / "model.so").write_text("tuned kernels")
    return artifact


def test_promote_job_serves_a_frozen_copy_of_the_tuned_artifact(tmp_path: Path) -> None:
    artifact = _tuned_artifact(tmp_path, "sm_90")
    result = run_job("promote-tuned-artifact.yaml", tmp_path, "20260308T040000Z")
    assert result.returncode == 0, result.stderr
    assert current(tmp_path, "cuda-sm_90") == "tuned-20260308T040000Z"
    (artifact / "model.so").write_text("the next tune run")
    promoted = tmp_path / "data" / "artifacts" / "cuda-sm_90" / "current" / "model.so"
    assert promoted.read_text() == "tuned kernels"


def test_promote_job_refuses_an_artifact_for_another_gpu(tmp_path: Path) -> None:
    _tuned_artifact(tmp_path, "sm_75")
    result = run_job("promote-tuned-artifact.yaml", tmp_path, "20260308T040000Z")
    assert result.returncode != 0 and "is for sm_75, not sm_90" in result.stderr
    assert not (tmp_path / "data" / "artifacts" / "cuda-sm_90" / "current").exists()


def test_promote_check_reads_a_field_the_manifest_has() -> None:
    script = job_container("promote-tuned-artifact.yaml")["args"][0]
    assert '["cuda_arch"]' in script and "cuda_arch" in {f.name for f in fields(Manifest)}


def test_switch_job_lists_versions_refuses_a_missing_one_and_switches_to_a_real_one(tmp_path: Path) -> None:
    assert run_job("compile-artifact-cuda.yaml", tmp_path, "20260301T020000Z").returncode == 0
    assert run_job("compile-artifact-cuda.yaml", tmp_path, "20260308T020000Z").returncode == 0
    refused = run_job("switch-artifact.yaml", tmp_path, "unused")  # as shipped: version CHOOSE
    assert refused.returncode != 0 and "20260301T020000Z" in refused.stdout
    assert current(tmp_path, "cuda-sm_90") == "20260308T020000Z"
    switched = run_job("switch-artifact.yaml", tmp_path, "unused", {"DIETSERVE_VERSION": "20260301T020000Z"})
    assert switched.returncode == 0, switched.stderr
    assert current(tmp_path, "cuda-sm_90") == "20260301T020000Z"


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_compile_job_writes_the_artifact_its_overlay_serves() -> None:
    """The GPU overlay serves what the compile Job writes (the CPU overlay compiles for itself)."""
    job, overlay = "compile-artifact-cuda.yaml", "overlay-gpu"
    container = job_container(job)
    flavour = re.search(r"^flavour=(\S+)$", container["args"][0], re.MULTILINE).group(1)
    server = find(rendered(overlay), "Deployment", "dietserve-server")["spec"]["template"]["spec"]["containers"][0]
    assert container_env(server)["DIETSERVE_ARTIFACT"] == f"/data/artifacts/{flavour}/current"
    (compile_argv,) = dietserve_invocations(container_argv(container))
    assert _flag(compile_argv, "--target") == "cuda" and flavour == f"cuda-{_flag(compile_argv, '--arch')}"


@pytest.mark.parametrize("job", ["promote-tuned-artifact.yaml", "switch-artifact.yaml"])
def test_promote_and_switch_jobs_act_on_the_gpu_overlays_artifacts(job: str) -> None:
    container = job_container(job)
    script = expand_env(container["args"][0], container_env(container))
    flavour = re.search(r"^flavour=\"?([^\"\s]+)\"?$", script, re.MULTILINE).group(1)
    server = find(rendered("overlay-gpu"), "Deployment", "dietserve-server")["spec"]["template"]["spec"]
    assert container_env(server["containers"][0])["DIETSERVE_ARTIFACT"] == f"/data/artifacts/{flavour}/current"


def expand_env(script: str, env: dict[str, str]) -> str:
    """The shell's own $NAME expansion, for the variables the Job's env sets."""
    return re.sub(r"\$([A-Z_][A-Z0-9_]*)", lambda m: env.get(m.group(1), m.group(0)), script)
