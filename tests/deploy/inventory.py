"""What deploy/ holds, loaded once: YAML files, rendered kustomizations, standalone manifests,
Dockerfiles and the README section, plus the container command lines as Kubernetes runs them."""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import shlex
from pathlib import Path

from .render import load_documents, pod_template, render, split_image

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
IMAGES = DEPLOY / "images"
README_SECTION = REPO / "README.md"  # its "Deploy on Kubernetes" section: see deploy_section()
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# Every kustomization an operator applies (base and tuning only through the overlays).
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "tuning": K8S / "tuning",
    "monitoring": K8S / "monitoring",
    "overlay-gpu": K8S / "overlays" / "gpu",
    "overlay-cpu": K8S / "overlays" / "cpu",
}
# Applied with `kubectl create -f` / `kubectl apply -f`, outside kustomize.
STANDALONE_DIRS = (K8S / "jobs", K8S / "examples")
DIETSERVE_ENTRYPOINT = ["python", "-m", "dietserve"]


def yaml_files() -> list[Path]:
    found = [p for p in DEPLOY.rglob("*") if p.is_file() and (p.suffix in {".yaml", ".yml"} or p.name == ".yamllint")]
    return sorted(found)


@functools.cache
def _rendered(name: str) -> tuple[dict, ...]:
    return tuple(render(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict]:
    """The kustomization's output (a fresh copy: tests may change it)."""
    return copy.deepcopy(list(_rendered(name)))


def standalone_files() -> list[Path]:
    return sorted(p for directory in STANDALONE_DIRS for p in directory.glob("*.yaml"))


def standalone() -> list[tuple[Path, dict]]:
    return [(path, document) for path in standalone_files() for document in load_documents(path)]


def every_applied_resource() -> list[tuple[str, dict]]:
    """(source, resource) for everything an operator applies: rendered kustomizations and standalone files."""
    resources = [(name, resource) for name in KUSTOMIZATIONS for resource in rendered(name)]
    resources += [(str(path.relative_to(REPO)), document) for path, document in standalone()]
    return resources


def resource_id(resource: dict) -> str:
    metadata = resource.get("metadata", {})
    return f"{resource['kind']}/{metadata.get('name') or metadata.get('generateName', '?')}"


def find(resources: list[dict], kind: str, name: str) -> dict:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"].get("name") == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_spec(resource: dict) -> dict | None:
    """The pod spec of a workload, or of a KServe predictor (which inlines one)."""
    if resource["kind"] == "InferenceService":
        return resource["spec"]["predictor"]
    template = pod_template(resource)
    return None if template is None else template["spec"]


# --- container command lines -------------------------------------------------------------------

def _quantity_to_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet computes it, for the sources our manifests use
    (literal values with $(VAR) references, resourceFieldRef, the pod IP)."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
        elif "resourceFieldRef" in variable.get("valueFrom", {}):
            ref = variable["valueFrom"]["resourceFieldRef"]
            section, _, resource = ref["resource"].partition(".")
            assert resource == "cpu", f"{variable['name']}: only cpu resourceFieldRefs are modelled"
            cores = _quantity_to_cores(container["resources"][section][resource])
            env[variable["name"]] = str(math.ceil(cores / _quantity_to_cores(ref.get("divisor", "1"))))
        elif variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[variable["name"]] = "10.0.0.7"
        else:
            raise AssertionError(f"env {variable['name']}: source not modelled by tests/deploy/inventory.py")
    return env


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: $$ escapes, unknown names stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


@functools.cache
def dockerfile_entrypoints() -> dict[str, list[str]]:
    """Image name (as tagged by the README's build commands) -> the Dockerfile's ENTRYPOINT."""
    entrypoints = {}
    for dockerfile, image in readme_image_builds().items():
        lines = (IMAGES / dockerfile).read_text().splitlines()
        entrypoint = [line for line in lines if line.startswith("ENTRYPOINT")][-1]
        entrypoints[image] = json.loads(entrypoint.removeprefix("ENTRYPOINT"))
    return entrypoints


def image_name(reference: str) -> str:
    """registry.example.com/dietserve-server:0.1.0 -> dietserve-server"""
    return split_image(reference)[0].rsplit("/", 1)[-1]


def container_argv(container: dict) -> list[str]:
    """The process the container runs: command (or the image's ENTRYPOINT) + args, expanded."""
    env = container_env(container)
    command = container.get("command")
    if command is None:
        entrypoints = dockerfile_entrypoints()
        name = image_name(container["image"])
        assert name in entrypoints, f"{container['image']} is not an image the README's deploy section builds"
        command = entrypoints[name]
    return [expand(part, env) for part in list(command) + list(container.get("args", []))]


def dietserve_invocations(argv: list[str]) -> list[list[str]]:
    """The `python -m dietserve ...` command lines a container runs: its argv itself, or the lines
    of a `sh -c` script (continuation lines joined)."""
    if argv[:3] == DIETSERVE_ENTRYPOINT:
        return [argv[3:]]
    if argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        lines = argv[2].replace("\\\n", " ").splitlines()
        words = [shlex.split(line) for line in lines if line.strip().startswith("python -m dietserve")]
        return [w[3:] for w in words]
    return []


def every_container() -> list[tuple[str, dict, dict]]:
    """(source, resource, container) for every container of everything applied."""
    found = []
    for source, resource in every_applied_resource():
        spec = pod_spec(resource)
        for container in (spec or {}).get("containers", []):
            found.append((f"{source}:{resource_id(resource)}:{container['name']}", resource, container))
    return found


# --- README section ---------------------------------------------------------------------------

# docker build -f deploy/images/server.Dockerfile -t "$REGISTRY/dietserve-server:0.1.0" .
BUILD_COMMAND = re.compile(r'docker build -f deploy/images/(\S+\.Dockerfile) -t "\$REGISTRY/([a-z0-9-]+):([\w.]+)" \.')


@functools.cache
def readme_image_builds() -> dict[str, str]:
    """Dockerfile name -> image name, from the README section's `docker build` commands."""
    return {m.group(1): m.group(2) for m in BUILD_COMMAND.finditer(deploy_section())}


def readme_image_tags() -> dict[str, str]:
    """Image name -> the tag the README builds it with."""
    return {m.group(2): m.group(3) for m in BUILD_COMMAND.finditer(deploy_section())}


@functools.cache
def deploy_section() -> str:
    """The README's "Deploy on Kubernetes" section, up to the next top-level heading."""
    text = README_SECTION.read_text()
    start = text.index("## Deploy on Kubernetes")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


# --- the wire contract -------------------------------------------------------------------------
# Read from protos/ rather than imported from dietserve.server._proto: the generated messages share
# the `inference` protobuf package with tritonclient's, and one test process cannot load both.
PROTO = REPO / "protos" / "open_inference.proto"


@functools.cache
def inference_service() -> tuple[str, frozenset[str]]:
    """(the gRPC service's full name, its RPC names), as the server registers them."""
    text = PROTO.read_text()
    package = re.search(r"^package\s+([\w.]+);", text, re.M).group(1)
    service = re.search(r"^service\s+(\w+)\s*\{(.*?)^\}", text, re.M | re.S)
    methods = frozenset(re.findall(r"^\s*rpc\s+(\w+)\s*\(", service.group(2), re.M))
    return f"{package}.{service.group(1)}", methods
