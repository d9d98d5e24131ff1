"""The README's "Deploy on Kubernetes" section says what the files do: the images it builds are the ones the
manifests run, the command lines it quotes are the ones the containers run, the paths and
resource names it gives exist."""

from __future__ import annotations

import re
import tomllib

import pytest

from .inventory import (
    REPO,
    container_argv,
    deploy_section,
    every_applied_resource,
    find,
    image_name,
    pod_spec,
    readme_image_builds,
    readme_image_tags,
    rendered,
)

README = deploy_section()
# Which image each workload must run, by the Dockerfile that builds it.
EXPECTED_DOCKERFILE = {
    ("overlay-gpu", "dietserve-server"): "server.Dockerfile",
    ("overlay-cpu", "dietserve-server"): "server-cpu.Dockerfile",
    ("overlay-gpu", "dietserve-rpc-tracker"): "tuner.Dockerfile",
    ("overlay-gpu", "dietserve-rpc-server"): "tuner.Dockerfile",
    ("overlay-gpu", "dietserve-tune"): "tuner.Dockerfile",
    ("deploy/k8s/examples/kserve-inferenceservice.yaml", "dietserve-minilm"): "server.Dockerfile",
}


def _gpu_container(kind: str, name: str) -> dict:
    return pod_spec(find(rendered("overlay-gpu"), kind, name))["containers"][0]


def test_readme_builds_every_image_at_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert set(readme_image_builds()) == {"server.Dockerfile", "server-cpu.Dockerfile", "tuner.Dockerfile"}
    assert set(readme_image_tags().values()) == {version}
    for image in readme_image_tags():
        assert f'docker push "$REGISTRY/{image}:{version}"' in README


@pytest.mark.parametrize(("source", "name"), list(EXPECTED_DOCKERFILE))
def test_workloads_run_the_image_the_readme_builds_for_them(source: str, name: str) -> None:
    resource = next(r for s, r in every_applied_resource() if s == source and r["metadata"].get("name") == name)
    image = pod_spec(resource)["containers"][0]["image"]
    assert image_name(image) == readme_image_builds()[EXPECTED_DOCKERFILE[(source, name)]]
    assert image.rsplit(":", 1)[1] == readme_image_tags()[image_name(image)]


def test_every_container_image_is_built_by_the_readme() -> None:
    built = set(readme_image_builds().values())
    for source, resource in every_applied_resource():
        for container in (pod_spec(resource) or {}).get("containers", []):
            if source in {"base", "tuning"}:  # bare names until an overlay sets the registry
                assert container["image"] in built, source
            else:
                assert image_name(container["image"]) in built, f"{source}: {container['image']}"
                assert container["image"].startswith("registry.example.com/"), \
                    f"{source}: not the placeholder registry the README's sed replaces"


def test_the_serve_command_line_in_the_readme_is_the_gpu_servers() -> None:
    block = re.search(r"A server pod runs:\n\n```\n(.*?)```", README, re.DOTALL).group(1)
    container = _gpu_container("Deployment", "dietserve-server")
    words = block.replace("<CPU limit>", str(container["resources"]["limits"]["cpu"])).split()
    assert words == container_argv(container)[3:]


def test_the_tuning_command_lines_in_the_readme_are_the_containers() -> None:
    tune = pod_spec(find(rendered("overlay-gpu"), "CronJob", "dietserve-tune"))["containers"][0]
    assert f"`python -m dietserve {' '.join(container_argv(tune)[3:])}`" in README
    for kind, name in [("Deployment", "dietserve-rpc-tracker"), ("DaemonSet", "dietserve-rpc-server")]:
        argv = container_argv(_gpu_container(kind, name))
        module = argv[2]
        quoted = re.search(rf"`(python -m {re.escape(module)} [^`]*)`", README).group(1).split()
        assert quoted == argv[: len(quoted)], f"README quotes {quoted} for {name}"


def test_paths_in_the_readme_exist() -> None:
    path = re.compile(r"(?<![\w/])((?:tests/)?deploy/(?:images|k8s|render|schemas|\.)(?:[\w./*-]*[\w*])?)")
    paths = set(path.findall(README))
    assert len(paths) > 10
    missing = sorted(p for p in paths if not list(REPO.glob(p)))
    assert not missing, missing


def test_resource_names_in_the_readme_commands_exist() -> None:
    gpu = rendered("overlay-gpu")
    names = {(r["kind"].lower(), r["metadata"]["name"]) for r in gpu}
    for kind, name in re.findall(r"\b(deployment|cronjob|deploy)/(dietserve-[a-z-]+)", README):
        kind = "deployment" if kind == "deploy" else kind
        assert (kind, name) in names, f"{kind}/{name}"
    job_labels = {r["metadata"]["labels"]["app.kubernetes.io/name"] for _, r in every_applied_resource()
                  if r["kind"] == "Job"}
    for label in re.findall(r"-l app\.kubernetes\.io/name=([a-z-]+)", README):
        assert label in job_labels, label
    secret = pod_spec(find(gpu, "Deployment", "dietserve-server"))["volumes"]
    assert "create secret tls dietserve-tls" in README
    assert any(v.get("secret", {}).get("secretName") == "dietserve-tls" for v in secret)
    adapter = re.search(r"rules\.existing=(\S+)", README).group(1)
    assert find(rendered("monitoring"), "ConfigMap", adapter)
    assert "dietserve.io/client=true" in README
