"""Every export, for every shipped policy and the export test policies, against its target's schema.

Why: an export that the target refuses to load protects nothing, and one that loads only because a
reader ignored an unknown key says something else than we meant. Cilium's and Istio's schemas are
the published CRD schemas (vendored under tests/schemas/, see its README), Cilium's read strictly
(an unknown field fails, as `kubectl apply --validate=strict` refuses it); Smokescreen and the
NetworkPolicy are checked against the narrowest schemas we could write from their sources. Envoy's
export is decoded by Envoy's own API (tests/unit/test_export_envoy.py), Istio's validated by its models
(tests/component/test_export_istio.py).
"""

from __future__ import annotations

import functools
import ipaddress
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from egressd.policy import parse_policy
from egressd.tools.export import TARGETS, export_policy
from tests.support.export_policies import RICH, _policies

SCHEMAS = Path(__file__).parents[1] / "schemas"
# Cilium's own CRD (pkg/k8s/apis/cilium.io/client/crds/v2/ciliumnetworkpolicies.yaml), the
# `v2` version's openAPIV3Schema as published, minus its description strings, minified to JSON.
CILIUM_CRD = {
    "source": "https://github.com/cilium/cilium/blob/main/pkg/k8s/apis/cilium.io/client/crds/v2/"
    "ciliumnetworkpolicies.yaml",
    "version": "cilium main as published on 2026-05-29 (controller-gen v0.20.1)",
    # copied unchanged (re-serialised YAML) by metio/kube-custom-resources-rs at commit
    # 121506a92aa9bc551eaf559a9d89d7ca47dcfc9d, crd-catalog/cilium/cilium/cilium.io/v2/
    # ciliumnetworkpolicies.yaml, sha256 of that file:
    "sha256": "46052124ef73d9f583321d9650c20615574baf22e10b8bad2bcca8530cb686bd",
}


def crd_strict(node: Any) -> Any:
    """A CRD schema as `kubectl apply --validate=strict` reads it: an object schema with properties
    and neither additionalProperties nor x-kubernetes-preserve-unknown-fields refuses unknown
    fields (the API server would drop them silently). Logical branches (anyOf/oneOf) carry no type
    and stay as they are."""
    if isinstance(node, list):
        return [crd_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: crd_strict(v) for k, v in node.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("cidr", raises=ValueError)
def _cidr(value: object) -> bool:
    """Kubernetes' `cidr` format: a prefix with its length (net.ParseCIDR)."""
    if isinstance(value, str):
        ipaddress.ip_network(value, strict=False)
        return "/" in value
    return True


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    if name == "ciliumnetworkpolicy_v2.json":
        schema = crd_strict(schema)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    # The schema is valid JSON Schema (without the regex format check: Cilium's CRD has an RE2-only
    # pattern, `\\PC`, in a field the export never writes, that Python's re cannot compile).
    cls(cls.META_SCHEMA).validate(schema)
    return cls(schema, format_checker=FORMATS)


BY_KIND = {
    "CiliumNetworkPolicy": "ciliumnetworkpolicy_v2.json",
    "ServiceEntry": "serviceentry_v1.json",
    "AuthorizationPolicy": "authorizationpolicy_v1.json",
    "NetworkPolicy": "networkpolicy_v1.json",
}


def _check(validator: jsonschema.protocols.Validator, doc: Any, what: str) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, (what, [f"{list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5]])


CASES = [(name, target) for name, _ in _policies() for target in TARGETS]


@pytest.mark.parametrize(("name", "target"), CASES, ids=[f"{t}-{n}" for n, t in CASES])
def test_export_validates(name: str, target: str) -> None:
    policy = dict(_policies())[name]
    result = export_policy(policy, target)
    docs = [d for d in yaml.safe_load_all(result.text) if d is not None]
    if target == "squid":
        assert result.text.rstrip().splitlines()[-1] in ("http_access deny all", "http_access allow all")
        return
    if target == "smokescreen":
        (doc,) = docs
        _check(_validator("smokescreen_acl_v1.json"), doc, name)
        return
    if target == "envoy":  # decoded by Envoy's own API types: tests/unit/test_export_envoy.py
        return
    assert docs
    for doc in docs:
        _check(_validator(BY_KIND[doc["kind"]]), doc, f"{name}: {doc['kind']}")
    if target == "cilium":
        (doc,) = docs
        egress = doc["spec"].get("egress", [])
        assert not egress or egress[0]["toPorts"][0]["rules"]["dns"] == [{"matchPattern": "*"}]


def test_schemas_refuse_a_wrong_document() -> None:
    """The vendored schemas are strict: a misspelt key or a bad value fails (they are not empty)."""
    cilium = _validator("ciliumnetworkpolicy_v2.json")
    cnp = yaml.safe_load(export_policy(parse_policy(RICH, "rich"), "cilium").text)
    assert not list(cilium.iter_errors(cnp))
    for path, key, value in (
        (["spec", "egress", 1], "toFQDN", [{"matchName": "a.test"}]),  # misspelt, in an egress rule
        (["spec", "egressDeny", 0, "toCIDRSet", 0], "excepts", ["10.0.0.0/8"]),  # in a CIDR rule
        (["spec"], "egres", []),  # at the top of the spec
        (["spec", "egress", 1, "toFQDNs", 0], "matchName", 7),  # a wrong type
        (["spec", "egressDeny", 0, "toCIDRSet", 0], "cidr", "10.0.0.300/8"),  # a bad cidr
    ):
        wrong = yaml.safe_load(export_policy(parse_policy(RICH, "rich"), "cilium").text)
        node = wrong
        for step in path:
            node = node[step]
        node[key] = value
        assert list(cilium.iter_errors(wrong)), (path, key)
    acl = yaml.safe_load(export_policy(parse_policy(RICH, "rich"), "smokescreen").text)
    acl["default"]["action"] = "deny"
    assert list(_validator("smokescreen_acl_v1.json").iter_errors(acl))
    acl["default"]["action"] = "enforce"
    acl["global_allow_list"].append("*")
    assert list(_validator("smokescreen_acl_v1.json").iter_errors(acl))
    se = next(yaml.safe_load_all(export_policy(parse_policy(RICH, "rich"), "istio").text))
    se["spec"]["location"] = "OUTSIDE"
    assert list(_validator("serviceentry_v1.json").iter_errors(se))
