"""The manifests name what the code actually has: every dietserve command line parses with the real
CLI, ports and probes match the server's configuration and health service, and every pod runs
the way the images and the restricted Pod Security Standard expect."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

from dietserve.__main__ import build_parser
from dietserve.server.config import ServerConfig, config_from_args

from .inventory import (
    IMAGES,
    container_argv,
    dietserve_invocations,
    every_applied_resource,
    every_container,
    find,
    inference_service,
    pod_spec,
    rendered,
    resource_id,
)

SERVER_RUNNING_UID = 10001
ALLOWED_VOLUME_TYPES = {"emptyDir", "secret", "configMap", "persistentVolumeClaim", "projected", "downwardAPI"}


def parse_dietserve(argv: list[str]) -> argparse.Namespace:
    """Parses `python -m dietserve ARGV` with the real parser; argparse's message on failure."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"`python -m dietserve {' '.join(argv)}` does not parse:\n{stderr.getvalue()}") from None


def server_config(argv: list[str], scratch: Path) -> ServerConfig:
    """The ServerConfig `serve ARGV` builds, which checks every setting's range as the server does
    at start. It also wants the TLS files to exist: those live in the pod's Secret volume, so
    stand-ins in ``scratch`` take their place."""
    namespace = parse_dietserve(argv)
    for name in ("tls_cert", "tls_key"):
        if getattr(namespace, name, None) is not None:
            stand_in = scratch / getattr(namespace, name).name
            stand_in.write_text("PEM stand-in")
            setattr(namespace, name, stand_in)
    return config_from_args(namespace, namespace.artifact)


def flag_value(argv: list[str], flag: str) -> str | None:
    return next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag), None)


INVOCATIONS = [(source, invocation) for source, _, container in every_container()
               for invocation in dietserve_invocations(container_argv(container))]
SERVERS = [(source, resource, container) for source, resource, container in every_container()
           if dietserve_invocations(container_argv(container))[:1]
           and dietserve_invocations(container_argv(container))[0][0] == "serve"]


def test_the_manifests_run_serve_tune_and_compile() -> None:
    commands = {invocation[0] for _, invocation in INVOCATIONS}
    assert commands == {"serve", "tune", "compile"}
    assert len(SERVERS) >= 4  # base, gpu, cpu overlays and the KServe example


@pytest.mark.parametrize(("source", "argv"), INVOCATIONS, ids=[f"{s}:{a[0]}" for s, a in INVOCATIONS])
def test_every_dietserve_command_line_parses_with_the_real_cli(source: str, argv: list[str], tmp_path: Path) -> None:
    unresolved = [word for word in argv if "$(" in word]
    assert not unresolved, f"$(VAR) references no env variable defines: {unresolved}"
    if argv[0] == "serve":
        server_config(argv, tmp_path)
    else:
        parse_dietserve(argv)


def test_parsing_rejects_a_flag_the_cli_does_not_have() -> None:
    with pytest.raises(AssertionError, match="does not parse"):
        parse_dietserve(["serve", "--artifact", "/a", "--no-such-flag", "1"])


@pytest.mark.parametrize(("source", "resource", "container"), SERVERS, ids=[s for s, _, _ in SERVERS])
def test_server_ports_match_the_container_ports_and_the_probes(source: str, resource: dict, container: dict,
                                                                tmp_path: Path) -> None:
    argv = dietserve_invocations(container_argv(container))[0]
    config = server_config(argv, tmp_path)
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    grpc_port = ports.get("grpc", ports.get("h2c"))
    assert config.host == "0.0.0.0", "a pod's server must listen beyond loopback"
    assert config.port == grpc_port == ServerConfig(artifact=None).port
    # The HTTP port (HTTPS with the gRPC port's TLS) is declared where it is open, and open only where declared.
    http_name = "https" if config.tls else "http"
    assert ports.get(http_name) == config.http_port, "declare the HTTP port the server opens, or pass --no-http"
    if config.http_port is not None:
        assert config.http_port == ServerConfig(artifact=None).http_port
    if "metrics" in ports:
        assert config.metrics_port == ports["metrics"] == ServerConfig(artifact=None).metrics_port
        assert config.metrics_host == "0.0.0.0", "Prometheus scrapes the pod IP: /metrics must listen beyond loopback"
    # With TLS the probes use the plaintext health port; without it, health is on the gRPC port.
    health_port = config.health_port if config.tls else config.port
    if config.tls:
        assert ports["health"] == health_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health_port, probe


@pytest.mark.parametrize(("source", "resource", "container"), SERVERS, ids=[s for s, _, _ in SERVERS])
def test_probes_ask_the_health_service_names_the_server_sets(source: str, resource: dict, container: dict) -> None:
    service_name, _ = inference_service()
    assert container["startupProbe"]["grpc"]["service"] == service_name
    assert container["readinessProbe"]["grpc"]["service"] == service_name
    assert container["livenessProbe"]["grpc"]["service"] == ""
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "loading and warm-up get 10 minutes"


@pytest.mark.parametrize(("source", "resource", "container"), SERVERS, ids=[s for s, _, _ in SERVERS])
def test_termination_grace_outlasts_the_drain_and_the_grace(source: str, resource: dict, container: dict,
                                                            tmp_path: Path) -> None:
    config = server_config(dietserve_invocations(container_argv(container))[0], tmp_path)
    assert config.drain_seconds > 0, "load balancers need time to see the pod not ready"
    grace_period = pod_spec(resource).get("terminationGracePeriodSeconds", 30)
    assert grace_period > config.drain_seconds + config.grace_seconds


@pytest.mark.parametrize(("source", "resource", "container"), SERVERS, ids=[s for s, _, _ in SERVERS])
def test_server_threads_follow_the_cpu_limit(source: str, resource: dict, container: dict) -> None:
    namespace = parse_dietserve(dietserve_invocations(container_argv(container))[0])
    limit = str(container["resources"]["limits"]["cpu"])
    assert namespace.threads == int(limit), f"--threads {namespace.threads} for a CPU limit of {limit}"


def test_tls_secret_and_data_volume_are_mounted_read_only() -> None:
    resources = rendered("overlay-gpu")
    deployment = find(resources, "Deployment", "dietserve-server")
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    argv = container_argv(spec["containers"][0])
    tls = volumes[mounts["/etc/dietserve/tls"]["name"]]["secret"]
    assert tls["secretName"] == "dietserve-tls" and tls["defaultMode"] == 0o440
    assert mounts["/etc/dietserve/tls"]["readOnly"] is True
    for flag, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):  # a kubernetes.io/tls Secret's keys
        assert flag_value(argv, flag) == f"/etc/dietserve/tls/{key}"
    assert mounts["/data"]["readOnly"] is True
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"] == {"claimName": "dietserve-data",
                                                                         "readOnly": True}
    assert flag_value(argv, "--artifact").startswith("/data/artifacts/")


@pytest.mark.parametrize("overlay", ["overlay-gpu", "overlay-cpu"])
def test_services_budgets_autoscaler_and_policies_select_the_server_pods(overlay: str) -> None:
    resources = rendered(overlay)
    deployment = find(resources, "Deployment", "dietserve-server")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}

    def selects(selector: dict) -> bool:
        return selector.items() <= pod_labels.items()

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    for name in ("dietserve-server", "dietserve-server-headless"):
        service = find(resources, "Service", name)
        assert selects(service["spec"]["selector"])
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    service = find(resources, "Service", "dietserve-server")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 8001, "https": 8000, "metrics": 8002}
    assert selects(find(resources, "PodDisruptionBudget", "dietserve-server")["spec"]["selector"]["matchLabels"])
    assert selects(find(resources, "NetworkPolicy", "dietserve-server")["spec"]["podSelector"]["matchLabels"])
    target = find(resources, "HorizontalPodAutoscaler", "dietserve-server")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "dietserve-server")
    monitor = find(resources, "ServiceMonitor", "dietserve-server")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    headless = find(resources, "Service", "dietserve-server-headless")
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items(), \
        "the headless Service must not be scraped too (every pod would be scraped twice)"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    claims = {v["persistentVolumeClaim"]["claimName"] for r in resources for v in (pod_spec(r) or {}).get("volumes", [])
              if "persistentVolumeClaim" in v}
    assert claims == {r["metadata"]["name"] for r in resources if r["kind"] == "PersistentVolumeClaim"}


def test_network_policy_admits_grpc_and_https_from_client_namespaces_and_metrics_from_monitoring() -> None:
    policy = find(rendered("overlay-gpu"), "NetworkPolicy", "dietserve-server")
    rules = {port["port"]: rule["from"][0]["namespaceSelector"]["matchLabels"]
             for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    clients = {"dietserve.io/client": "true"}
    assert rules == {8001: clients, 8000: clients, 8002: {"kubernetes.io/metadata.name": "monitoring"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def _dockerfile_user(dockerfile: str) -> str:
    users = re.findall(r"^USER\s+(\S+)", (IMAGES / dockerfile).read_text(), re.MULTILINE)
    return users[-1].split(":")[0]


ALL_PODS = [(source, resource) for source, resource in every_applied_resource() if pod_spec(resource) is not None]


@pytest.mark.parametrize(("source", "resource"), ALL_PODS, ids=[f"{s}:{resource_id(r)}" for s, r in ALL_PODS])
def test_every_pod_meets_the_restricted_pod_security_standard(source: str, resource: dict) -> None:
    spec = pod_spec(resource)
    pod_context = spec.get("securityContext", {})
    assert pod_context.get("runAsNonRoot") is True
    assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    assert spec.get("automountServiceAccountToken") is False, "no pod here talks to the Kubernetes API"
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for volume in volumes.values():
        assert set(volume) - {"name"} <= ALLOWED_VOLUME_TYPES, f"volume {volume['name']}"
    for container in spec["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
        assert context["readOnlyRootFilesystem"] is True
        assert context.get("runAsUser", pod_context.get("runAsUser")) == SERVER_RUNNING_UID
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert set(mounts.values()) <= set(volumes), "every mount names a volume of the pod"
        # A read-only root needs a writable /tmp, and HOME there for caches.
        assert "emptyDir" in volumes[mounts["/tmp"]]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
        assert "limits" in container["resources"] and "memory" in container["resources"]["limits"]


def test_pods_run_as_the_user_the_images_create() -> None:
    for dockerfile in ("server.Dockerfile", "server-cpu.Dockerfile", "tuner.Dockerfile"):
        assert _dockerfile_user(dockerfile) == str(SERVER_RUNNING_UID), dockerfile


def _tvm_flags(module: str) -> set[str]:
    """The --flags a tvm.exec script's argparse defines, read from its source (importing TVM to
    run --help costs seconds)."""
    tvm = importlib.util.find_spec("tvm")  # located, not imported
    source = Path(tvm.submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
    return {argument.value for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for argument in node.args if isinstance(argument, ast.Constant) and str(argument.value).startswith("--")}


def test_tvm_rpc_tracker_and_server_know_the_flags_the_manifests_pass() -> None:
    resources = rendered("overlay-gpu")
    for kind, name, module in [("Deployment", "dietserve-rpc-tracker", "tvm.exec.rpc_tracker"),
                               ("DaemonSet", "dietserve-rpc-server", "tvm.exec.rpc_server")]:
        container = find(resources, kind, name)["spec"]["template"]["spec"]["containers"][0]
        argv = container_argv(container)
        assert argv[:3] == ["python", "-m", module]
        used = {word for word in argv[3:] if word.startswith("--")}
        known = _tvm_flags(module)
        assert {"--host", "--port"} <= known, f"{module}: flags not found in its source"
        assert used <= known, f"{module} has no {sorted(used - known)}"


def test_tuning_addresses_and_keys_agree() -> None:
    resources = rendered("overlay-gpu")
    tracker_service = find(resources, "Service", "dietserve-rpc-tracker")
    address = f"{tracker_service['metadata']['name']}:{tracker_service['spec']['ports'][0]['port']}"
    rpc_server = container_argv(find(resources, "DaemonSet", "dietserve-rpc-server")["spec"]["template"]["spec"]
                                ["containers"][0])
    tune = find(resources, "CronJob", "dietserve-tune")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    tune_argv = container_argv(tune["containers"][0])
    assert flag_value(rpc_server, "--tracker") == flag_value(tune_argv, "--rpc-tracker") == address
    assert flag_value(rpc_server, "--key") == flag_value(tune_argv, "--rpc-key")
    assert flag_value(rpc_server, "--custom-addr") == "10.0.0.7", "the pod IP, from the downward API"
    tracker = container_argv(find(resources, "Deployment", "dietserve-rpc-tracker")["spec"]["template"]["spec"]
                             ["containers"][0])
    assert int(flag_value(tracker, "--port")) == tracker_service["spec"]["ports"][0]["port"]
    # The tune pod writes where the servers read.
    assert flag_value(tune_argv, "--db").startswith("/data/") and flag_value(tune_argv, "--out").startswith("/data/")
    gpu_server_artifact = flag_value(container_argv(
        find(resources, "Deployment", "dietserve-server")["spec"]["template"]["spec"]["containers"][0]), "--artifact")
    assert f"cuda-{flag_value(tune_argv, '--arch')}" in gpu_server_artifact
