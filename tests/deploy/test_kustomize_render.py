"""The overlays render to what each cluster needs; the renderer itself behaves like kustomize on
the features our kustomizations use and refuses the ones it does not implement."""

from __future__ import annotations

from pathlib import Path

import pytest

from .inventory import K8S, KUSTOMIZATIONS, find, pod_spec, rendered
from .render import Unsupported, render, strategic_merge


def server_container(resources: list[dict]) -> dict:
    deployment = find(resources, "Deployment", "dietserve-server")
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


def env_value(container: dict, name: str) -> str:
    return next(v["value"] for v in container["env"] if v["name"] == name)


def gpu_requests(resources: list[dict]) -> list[str]:
    found = []
    for resource in resources:
        for container in (pod_spec(resource) or {}).get("containers", []):
            if "nvidia.com/gpu" in container.get("resources", {}).get("limits", {}):
                found.append(f"{resource['kind']}/{resource['metadata']['name']}")
    return found


# --- the renderer ------------------------------------------------------------------------------

def test_strategic_merge_merges_containers_and_env_by_name_and_replaces_other_lists() -> None:
    base = {"containers": [{"name": "a", "args": ["x", "y"], "env": [{"name": "K", "value": "1"},
                                                                      {"name": "L", "value": "2"}]},
                           {"name": "b", "image": "b"}],
            "tolerations": [{"key": "old"}]}
    patch = {"containers": [{"name": "a", "args": ["z"], "env": [{"name": "L", "value": "3"}]}],
             "tolerations": [{"key": "new"}]}
    merged = strategic_merge(base, patch)
    assert merged["containers"][0] == {"name": "a", "args": ["z"], "env": [{"name": "K", "value": "1"},
                                                                          {"name": "L", "value": "3"}]}
    assert merged["containers"][1] == {"name": "b", "image": "b"}
    assert merged["tolerations"] == [{"key": "new"}]
    assert base["containers"][0]["args"] == ["x", "y"], "the base must not be modified"


def test_strategic_merge_deletes_keys_patched_to_null() -> None:
    assert strategic_merge({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None}}) == {"a": 1, "b": {"d": 3}}


@pytest.mark.parametrize("field", ["commonLabels: {a: b}", "replicas: [{name: x, count: 1}]",
                                   "patchesStrategicMerge: [p.yaml]", "components: [../c]"])
def test_renderer_refuses_kustomize_fields_it_does_not_implement(tmp_path: Path, field: str) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n{field}\n")
    with pytest.raises(Unsupported):
        render(tmp_path)


def test_renderer_refuses_a_patch_that_matches_nothing(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\npatches:\n  - path: p.yaml\n")
    (tmp_path / "p.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: nothing\n")
    with pytest.raises(ValueError, match="matches 0 resources"):
        render(tmp_path)


# --- what the overlays produce --------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_kustomization_renders(name: str) -> None:
    assert rendered(name)


@pytest.mark.parametrize("overlay", ["overlay-gpu", "overlay-cpu"])
def test_overlay_puts_every_namespaced_resource_in_dietserve(overlay: str) -> None:
    resources = rendered(overlay)
    namespaces = {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"}
    assert namespaces == {"dietserve"}
    assert find(resources, "Namespace", "dietserve")


@pytest.mark.parametrize("overlay", ["overlay-gpu", "overlay-cpu"])
def test_overlay_names_every_image_with_registry_and_tag(overlay: str) -> None:
    for resource in rendered(overlay):
        for container in (pod_spec(resource) or {}).get("containers", []):
            assert container["image"].startswith("registry.example.com/"), container["image"]
            assert container["image"].rsplit(":", 1)[-1] == "0.1.0", container["image"]


def test_gpu_overlay_runs_the_server_on_one_gpu_with_a_cuda_artifact() -> None:
    resources = rendered("overlay-gpu")
    deployment = find(resources, "Deployment", "dietserve-server")
    spec = deployment["spec"]["template"]["spec"]
    container = server_container(resources)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env_value(container, "DIETSERVE_ARTIFACT") == "/data/artifacts/cuda-sm_90/current"
    assert container["image"] == "registry.example.com/dietserve-server:0.1.0"
    # The patch merged into the base container instead of replacing it.
    assert container["args"][0] == "serve" and container["startupProbe"] and container["volumeMounts"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_gpu_overlay_includes_distributed_tuning() -> None:
    resources = rendered("overlay-gpu")
    for kind, name in [("Deployment", "dietserve-rpc-tracker"), ("Service", "dietserve-rpc-tracker"),
                       ("DaemonSet", "dietserve-rpc-server"), ("CronJob", "dietserve-tune"),
                       ("NetworkPolicy", "dietserve-rpc")]:
        assert find(resources, kind, name)["metadata"]["namespace"] == "dietserve"
    assert sorted(gpu_requests(resources)) == ["DaemonSet/dietserve-rpc-server", "Deployment/dietserve-server"]


def test_cpu_overlay_compiles_and_tunes_for_its_node_without_gpus_or_a_tuning_cluster() -> None:
    resources = rendered("overlay-cpu")
    container = server_container(resources)
    assert gpu_requests(resources) == []
    assert not [r for r in resources if r["kind"] in {"DaemonSet", "CronJob"}]
    assert "nodeSelector" not in find(resources, "Deployment", "dietserve-server")["spec"]["template"]["spec"]
    assert container["image"] == "registry.example.com/dietserve-server-cpu:0.1.0"
    # The model is compiled here, for as many cores as the pod gets, with its versions on the
    # shared volume (written, so mounted writable); no prebuilt artifact is named.
    args = container["args"]
    assert args[0] == "serve" and "--artifact" not in args and "--no-auto-tune" not in args
    assert args[args.index("--model") + 1] == "$(DIETSERVE_MODEL)" and env_value(container, "DIETSERVE_MODEL")
    assert args[args.index("--cache-dir") + 1].startswith("/data/")
    assert args[args.index("--num-cores") + 1] == args[args.index("--threads") + 1] == "$(DIETSERVE_THREADS)"
    assert "DIETSERVE_ARTIFACT" not in {v["name"] for v in container["env"]}
    data = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert not data.get("readOnly", False)
    # More CPU than the base, as a Guaranteed pod in whole CPUs (exclusive cores under the static policy).
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert int(container["resources"]["limits"]["cpu"]) > int(server_container(rendered("base"))["resources"]
                                                              ["limits"]["cpu"])


def test_monitoring_renders_into_the_monitoring_namespace() -> None:
    resources = rendered("monitoring")
    assert {r["metadata"]["namespace"] for r in resources} == {"monitoring"}
    dashboard = find(resources, "ConfigMap", "dietserve-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["dietserve.json"] == (K8S / "monitoring" / "grafana-dashboard.json").read_text()
