"""A small kustomize: renders deploy/k8s kustomizations offline, the way `kubectl apply -k` would.

The kustomize binary cannot be installed here, so this implements the part of kustomize our
kustomization files use, and refuses the rest: a field it does not implement raises
``Unsupported`` instead of being skipped, so the files can never rely on something the tests
silently ignore.

- ``resources``: files (one or more YAML documents) and directories with a kustomization.yaml,
  rendered first (their own namespace, images and patches apply to them alone);
- ``configMapGenerator``: ``files`` entries (``key=path`` or ``path``) with ``options`` labels and
  annotations; the name hash kustomize appends is not implemented, so generators must set
  ``disableNameSuffixHash: true``;
- ``patches`` with ``path``: strategic merge patches, matched to one resource by apiVersion group,
  kind and name (``$patch: delete`` on an item of a keyed list removes it); with ``path`` and
  ``target`` (kind, name): JSON 6902 patches of ``replace`` and ``add`` operations (``-`` appends);
- ``namespace``: set on every namespaced resource;
- ``images``: ``newName`` / ``newTag`` for containers and initContainers of every pod template.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "patches", "images"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                        "PersistentVolume", "StorageClass", "PriorityClass", "APIService"}

# Strategic-merge keys of the lists our patches touch (from the Kubernetes API's
# x-kubernetes-patch-merge-key); any other list is replaced whole, as kustomize does.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}


class Unsupported(ValueError):
    """The kustomization uses a kustomize feature this renderer does not implement."""


def load_documents(path: Path) -> list[dict]:
    with path.open() as stream:
        return [document for document in yaml.safe_load_all(stream) if document]


def render(directory: Path) -> list[dict]:
    """Every resource the kustomization in ``directory`` produces, as plain dicts."""
    directory = Path(directory)
    kustomization = load_documents(directory / KUSTOMIZATION)[0]
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise Unsupported(f"{directory / KUSTOMIZATION}: fields not implemented by tests/deploy/render.py: "
                          f"{sorted(unknown)}")
    if kustomization.get("kind") != "Kustomization":
        raise Unsupported(f"{directory / KUSTOMIZATION} is a {kustomization.get('kind')}, not a Kustomization")

    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        resources.extend(render(path) if path.is_dir() else load_documents(path))
    resources.extend(_generate_config_maps(directory, kustomization.get("configMapGenerator", [])))
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, resources)
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        _set_image(image, resources)
    _check_unique(directory, resources)
    return resources


def _generate_config_maps(directory: Path, generators: list[dict]) -> list[dict]:
    maps = []
    for generator in generators:
        unknown = set(generator) - {"name", "files", "options"}
        options = generator.get("options", {})
        unknown |= set(options) - {"labels", "annotations", "disableNameSuffixHash"}
        if unknown:
            raise Unsupported(f"configMapGenerator {generator.get('name')}: {sorted(unknown)} not implemented")
        if options.get("disableNameSuffixHash") is not True:
            raise Unsupported(f"configMapGenerator {generator['name']}: the name hash suffix is not implemented; "
                              "set options.disableNameSuffixHash: true")
        data = {}
        for entry in generator.get("files", []):
            key, _, source = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = (directory / source).read_text()
        metadata = {"name": generator["name"]}
        for field in ("labels", "annotations"):
            if field in options:
                metadata[field] = dict(options[field])
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return maps


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _apply_patch(directory: Path, patch: dict, resources: list[dict]) -> None:
    if set(patch) == {"path", "target"}:
        _apply_json_patch(directory, patch, resources)
        return
    if set(patch) != {"path"}:
        raise Unsupported(f"{directory}: only `patches: - path: FILE` (strategic merge, or JSON 6902 with a target) "
                          f"is implemented, got {patch}")
    for document in load_documents(directory / patch["path"]):
        if isinstance(document, list):
            raise Unsupported(f"{patch['path']}: JSON 6902 patches are not implemented")
        name = document["metadata"]["name"]
        namespace = document["metadata"].get("namespace")
        matches = [r for r in resources
                   if r["kind"] == document["kind"] and _group(r["apiVersion"]) == _group(document["apiVersion"])
                   and r["metadata"].get("name") == name
                   and namespace in (None, r["metadata"].get("namespace"))]
        if len(matches) != 1:
            raise ValueError(f"{patch['path']}: patch for {document['kind']}/{name} matches {len(matches)} resources")
        target = matches[0]
        merged = strategic_merge(target, document)
        target.clear()
        target.update(merged)


def _apply_json_patch(directory: Path, patch: dict, resources: list[dict]) -> None:
    target = patch["target"]
    if set(target) != {"kind", "name"}:
        raise Unsupported(f"{patch['path']}: a target by kind and name is implemented, got {target}")
    matches = [r for r in resources if r["kind"] == target["kind"] and r["metadata"].get("name") == target["name"]]
    if len(matches) != 1:
        raise ValueError(f"{patch['path']}: target {target} matches {len(matches)} resources")
    (operations,) = load_documents(directory / patch["path"])
    for operation in operations:
        if operation.get("op") not in ("replace", "add") or set(operation) != {"op", "path", "value"}:
            raise Unsupported(f"{patch['path']}: only replace and add with a value are implemented, got {operation}")
        *parents, last = operation["path"].lstrip("/").split("/")
        node = matches[0]
        for step in parents:
            node = node[int(step)] if isinstance(node, list) else node[step]
        value = copy.deepcopy(operation["value"])
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if operation["op"] == "replace":
                node[index] = value  # IndexError past the end, as kustomize refuses it
            else:
                node.insert(index, value)
        elif operation["op"] == "replace" and last not in node:
            raise ValueError(f"{patch['path']}: replace of missing {operation['path']}")
        else:
            node[last] = value


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Kubernetes' strategic merge patch for the subset our manifests need: maps merge key by key
    (a null value deletes the key), lists named in MERGE_KEYS merge item by item on their merge
    key (patch items first matched, new ones appended), other lists and scalars are replaced."""
    if isinstance(patch, dict) and any(k.startswith("$") for k in patch):
        raise Unsupported(f"strategic merge directives {sorted(k for k in patch if k.startswith('$'))}")
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = strategic_merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        merged = [copy.deepcopy(item) for item in base]
        for item in patch:
            position = next((i for i, old in enumerate(merged) if old.get(merge_key) == item.get(merge_key)), None)
            if item.get("$patch") == "delete" and set(item) == {merge_key, "$patch"}:
                if position is not None:
                    del merged[position]
                continue
            if position is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[position] = strategic_merge(merged[position], item)
        return merged
    return copy.deepcopy(patch)


def pod_template(resource: dict) -> dict | None:
    """The pod template of a workload (Deployment, DaemonSet, StatefulSet, Job, CronJob)."""
    spec = resource.get("spec", {})
    if resource["kind"] == "CronJob":
        return spec["jobTemplate"]["spec"]["template"]
    return spec.get("template") if resource["kind"] in {"Deployment", "DaemonSet", "StatefulSet", "Job"} else None


def _set_image(image: dict, resources: list[dict]) -> None:
    unknown = set(image) - {"name", "newName", "newTag"}
    if unknown:
        raise Unsupported(f"images entry {image['name']}: {sorted(unknown)} not implemented")
    for resource in resources:
        template = pod_template(resource)
        if template is None:
            continue
        spec = template["spec"]
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, tag = split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def split_image(reference: str) -> tuple[str, str | None]:
    """``registry:5000/name:tag`` -> (``registry:5000/name``, ``tag``); digests are not used here."""
    if "@" in reference:
        raise Unsupported(f"image digests are not implemented: {reference}")
    last = reference.rsplit("/", 1)[-1]
    if ":" in last:
        return reference[: -len(last)] + last.split(":")[0], last.split(":")[1]
    return reference, None


def _check_unique(directory: Path, resources: list[dict]) -> None:
    seen = set()
    for resource in resources:
        identity = (_group(resource["apiVersion"]), resource["kind"], resource["metadata"].get("namespace"),
                    resource["metadata"].get("name"))
        if identity in seen:
            raise ValueError(f"{directory}: {identity} is defined twice")
        seen.add(identity)
