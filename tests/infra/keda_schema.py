"""Validating KEDA objects offline, as the API server would with KEDA's CRDs installed and
strict field validation (``kubectl apply --validate=strict``).

The CRDs' OpenAPI v3 schemas are checked in under ``data/keda/`` (README.md there says where
they come from). Kubernetes' own parts are checked against ``kubernetes-validate``'s schemas for
``K8S_VERSION``: an object's ``metadata`` (an ``ObjectMeta``; the CRD says only ``object``) and a
ScaledJob's ``jobTargetRef`` (a ``batch/v1`` ``JobSpec``, which the CRD inlines).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.32.0"
DATA = Path(__file__).resolve().parent / "data" / "keda"
KEDA_GROUP = "keda.sh"
VALIDATE_AS = "x-conveyor-validate-as"


def _max_default_100(spec: dict[str, Any]) -> bool:
    if "minReplicaCount" not in spec:
        return True
    return bool(spec["minReplicaCount"] <= spec.get("maxReplicaCount", 100))


# The CEL rules (x-kubernetes-validations) of the checked-in CRDs, each rendered in Python. A
# rule not listed here fails validation: a newer CRD's new rules are never skipped silently.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? self.maxReplicaCount : 100)": (
        _max_default_100
    ),
}


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with unknown fields forbidden wherever it lists properties (as a structural
    schema prunes them, and strict field validation reports them), except under
    ``x-kubernetes-preserve-unknown-fields`` or a marker for a separate check."""
    schema = dict(schema)
    if VALIDATE_AS in schema:
        return schema
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


@cache
def crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the CRD version's openAPIV3Schema, as checked in."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(DATA.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        spec = crd["spec"]
        for version in spec["versions"]:
            out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return out


def is_keda(obj: dict[str, Any]) -> bool:
    return str(obj.get("apiVersion", "")).startswith(f"{KEDA_GROUP}/")


def _walk(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(path, schema node, value) for every value the schema describes."""
    yield path, schema, value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _walk(sub, item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _walk(schema["items"], item, f"{path}[{i}]")


def _k8s_errors(obj: dict[str, Any], what: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return [f"{what}: {where}: {exc.message}"]
    return []


def keda_errors(obj: dict[str, Any]) -> list[str]:
    """Every way ``obj`` (a KEDA object) breaks its CRD, or [] when it is valid."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    schemas = crds()
    if key not in schemas:
        return [f"no CRD schema checked in for {key} (have {sorted(schemas)})"]
    schema = schemas[key]
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(obj)
    ]
    # metadata: the CRD says `object`; the API server checks it as an ObjectMeta.
    errors += _k8s_errors(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": copy.deepcopy(obj.get("metadata", {}))}, "metadata"
    )
    for path, node, value in _walk(schema, obj, "$"):
        for rule in node.get("x-kubernetes-validations", []):
            check = CEL_RULES.get(rule["rule"])
            if check is None:
                errors.append(f"{path}: CEL rule this test cannot evaluate (add it to CEL_RULES): {rule['rule']}")
            elif not check(value):
                errors.append(f"{path}: {rule.get('message', rule['rule'])}")
        if node.get(VALIDATE_AS) == "batch/v1 JobSpec" and isinstance(value, dict):
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": value}
            errors += _k8s_errors(job, path)
    return errors


def k8s_errors(obj: dict[str, Any]) -> list[str]:
    """Every way ``obj`` (a built-in Kubernetes object) breaks the pinned version's schema."""
    return _k8s_errors(obj, f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}")


def object_errors(obj: dict[str, Any]) -> list[str]:
    return keda_errors(obj) if is_keda(obj) else k8s_errors(obj)
