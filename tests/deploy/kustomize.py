"""A small kustomize, for the tests: builds ``deploy/k8s`` without kubectl or a network.

It knows only what seawall's kustomizations use and refuses everything else, so that a
kustomization it cannot build the way kustomize does fails the tests instead of being
rendered wrongly:

- ``resources``: files (every YAML document in them) and directories (built first);
- ``patches``: ``- path: FILE`` with one strategic-merge patch, whose target is the one
  object of the patch's kind and name, merged as kubectl does for the fields used here
  (maps merge, ``null`` removes a field, the lists below merge by their key, the
  patch's items first, and any other list is replaced);
- ``namespace``: set on every namespaced object;
- ``images``: ``name`` with ``newName``/``newTag`` on every container's image.

The order is kustomize's: resources, then patches, then the namespace and the images.
Where kubectl is installed, ``test_kubernetes.py`` checks that ``kubectl kustomize``
renders the same objects, field for field and in every list's order, for base/ and both
overlays (kubectl lists the objects by kind, this builder in the order of its resources).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "namespace", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
# Strategic-merge keys of the lists the patches touch (from the Kubernetes API's
# x-kubernetes-patch-merge-key); every other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


class KustomizeError(ValueError):
    pass


def load_documents(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict):
            raise KustomizeError(f"{path}: a document is not a mapping")
    return docs


def merge(base: Any, patch: Any) -> Any:
    """``patch`` merged into ``base`` (neither is changed)."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(key, str) and key.startswith("$"):
            raise KustomizeError(f"patch directive {key} is not supported")
        if value is None:
            out.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key])
        elif key in out:
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    """The patch's items (merged into the base's of the same key) in the patch's order,
    then the base's other items in theirs: the order ``kubectl kustomize`` gives."""
    old = {item.get(key): item for item in base if isinstance(item, dict)}
    out = []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise KustomizeError(f"a list item without its merge key {key!r}: {item!r}")
        out.append(merge(old[item[key]], item) if item[key] in old else copy.deepcopy(item))
    patched = {item[key] for item in patch}
    return out + [copy.deepcopy(i) for i in base if i.get(key) not in patched]


def _set_image(image: str, rule: Obj) -> str:
    name, tag = image, ""
    if "@" in name:
        raise KustomizeError(f"digests are not supported: {image}")
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    tag = rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def _pod_specs(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return [spec["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [spec]
    return []


def build(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` prints (which sorts them by kind), in
    the order of the resources."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if k.get("kind") != "Kustomization":
        raise KustomizeError(f"{directory}: not a Kustomization")
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise KustomizeError(f"{directory}: fields this renderer does not know: {unknown}")

    objects: list[Obj] = []
    for resource in k.get("resources", []):
        path = (directory / resource).resolve()
        objects += build(path) if path.is_dir() else load_documents(path)

    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{directory}: only `- path:` patches: {entry}")
        (patch,) = load_documents(directory / entry["path"])
        kind, name = patch["kind"], patch["metadata"]["name"]
        targets = [
            i for i, o in enumerate(objects) if o["kind"] == kind and o["metadata"]["name"] == name
        ]
        if len(targets) != 1:
            raise KustomizeError(f"{directory}: patch {entry['path']} matches {len(targets)}")
        objects[targets[0]] = merge(objects[targets[0]], patch)

    namespace = k.get("namespace")
    if namespace:
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = namespace

    for rule in k.get("images", []):
        if set(rule) - {"name", "newName", "newTag"}:
            raise KustomizeError(f"{directory}: image rule {rule}")
        for o in objects:
            for pod in _pod_specs(o):
                for c in pod.get("initContainers", []) + pod.get("containers", []):
                    c["image"] = _set_image(c["image"], rule)
    return objects
