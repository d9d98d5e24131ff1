"""Every manifest an operator applies is valid: built-in kinds against the Kubernetes OpenAPI
schemas (kubernetes-validate, strict: unknown fields are errors), custom resources against the
schemas in tests/deploy/schemas/. Rendered overlays are validated as well as the files."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
from referencing import Registry, Resource

from .inventory import SCHEMAS, every_applied_resource, resource_id

# The oldest Kubernetes the manifests promise (README: native gRPC probes, CronJob timeZone,
# PDB unhealthyPodEvictionPolicy are GA by 1.31) and the newest kubernetes-validate ships, so a
# field removed since is caught too.
KUBERNETES_VERSIONS = ("1.31", "1.37")
BUILT_IN_API_VERSIONS = {"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1"}
CUSTOM_RESOURCE_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice.json",
}
# KServe's own predictor fields; the rest of a predictor is a Kubernetes PodSpec.
KSERVE_COMPONENT_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType",
                           "containerConcurrency", "timeout", "canaryTrafficPercent", "logger", "batcher",
                           "deploymentStrategy", "autoScaling", "labels", "annotations", "model"}

RESOURCES = every_applied_resource()
BUILT_IN = [(s, r) for s, r in RESOURCES if r["apiVersion"] in BUILT_IN_API_VERSIONS or r["kind"] == "InferenceService"]
CUSTOM = [(s, r) for s, r in RESOURCES if (r["apiVersion"], r["kind"]) in CUSTOM_RESOURCE_SCHEMAS]


def _ids(pairs: list[tuple[str, dict]]) -> list[str]:
    return [f"{source}:{resource_id(resource)}" for source, resource in pairs]

def _registry() -> Registry:
    resources = []
    for path in SCHEMAS.glob("*.json"):
        contents = json.loads(path.read_text())
        resources.append((contents["$id"], Resource.from_contents(contents)))
    return Registry().with_resources(resources)


def validate_custom_resource(resource: dict) -> None:
    schema_file = CUSTOM_RESOURCE_SCHEMAS[(resource["apiVersion"], resource["kind"])]
    schema = json.loads((SCHEMAS / schema_file).read_text())
    jsonschema.Draft202012Validator(schema, registry=_registry()).validate(resource)


def validate_built_in(resource: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(part) for part in err.path)
        raise AssertionError(f"{resource_id(resource)} against Kubernetes {version}: {path}: {err.message}") from None


def predictor_as_pod(resource: dict) -> dict:
    spec = {k: v for k, v in resource["spec"]["predictor"].items() if k not in KSERVE_COMPONENT_FIELDS}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": resource["metadata"]["name"]}, "spec": spec}


def test_every_applied_resource_has_a_schema_to_check_it() -> None:
    unchecked = [f"{source}:{resource_id(resource)} ({resource['apiVersion']})" for source, resource in RESOURCES
                 if resource["apiVersion"] not in BUILT_IN_API_VERSIONS
                 and (resource["apiVersion"], resource["kind"]) not in CUSTOM_RESOURCE_SCHEMAS]
    assert not unchecked, f"no schema validates these: {unchecked}"
    kinds = {resource["kind"] for _, resource in RESOURCES}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "CronJob", "DaemonSet", "ServiceMonitor",
            "PrometheusRule", "InferenceService"} <= kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("source", "resource"), BUILT_IN, ids=_ids(BUILT_IN))
def test_built_in_resources_validate_strictly(source: str, resource: dict, version: str) -> None:
    # An InferenceService's predictor is a PodSpec plus KServe's fields: validated as a Pod here.
    validate_built_in(predictor_as_pod(resource) if resource["kind"] == "InferenceService" else resource, version)


@pytest.mark.parametrize(("source", "resource"), CUSTOM, ids=_ids(CUSTOM))
def test_custom_resources_match_their_schemas(source: str, resource: dict) -> None:
    validate_custom_resource(resource)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    deployment = next(r for _, r in RESOURCES if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(AssertionError, match="readinessProbes"):
        validate_built_in(deployment, KUBERNETES_VERSIONS[0])


@pytest.mark.parametrize(("kind", "breakage"), [
    ("ServiceMonitor", lambda r: r["spec"]["endpoints"][0].update(interval="15 seconds")),
    ("ServiceMonitor", lambda r: r["spec"].pop("selector")),
    ("PrometheusRule", lambda r: r["spec"]["groups"][0]["rules"][0].update(record="also_a_record")),
    ("PrometheusRule", lambda r: r["spec"]["groups"][0]["rules"][0].update(fore="10m")),
    ("InferenceService", lambda r: r["spec"]["predictor"]["containers"][0]["ports"][0].update(name="grpc")),
])
def test_custom_resource_schemas_reject_broken_resources(kind: str, breakage) -> None:
    resource = next(r for _, r in RESOURCES if r["kind"] == kind)
    breakage(resource)
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(resource)
