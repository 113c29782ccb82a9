"""`egressd policy export --to istio`, validated by the models generated from Istio's own CRDs.

Why: no Istio control plane runs here, but its CRDs' validation does: @kubernetes-models/istio
(npm; models generated from Istio 1.29's CRDs: types, enums, required fields, limits) and
kubernetes-models (the NetworkPolicy the export adds for the gateway's pods) validate every object
of every export, in a small Node script (tests/support/kube_models.mjs). scripts/setup.sh installs
both, pinned, into .cache/kube-models (the tests have no registry). Those models, like the API
server, do not refuse unknown fields: tests/unit/test_export_schemas.py checks that with the strict
published schemas.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from egressd.policy import parse_policy
from egressd.tools.export import export_policy
from tests.support.export_policies import RICH, _policies

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / ".cache" / "kube-models" / "node_modules"
SCRIPT = REPO / "tests" / "support" / "kube_models.mjs"


def validate(objects: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    assert (MODULES / "@kubernetes-models" / "istio").is_dir(), "run scripts/setup.sh test"
    out = subprocess.run(
        ["node", str(SCRIPT), str(MODULES)],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.stderr == "", out.stderr
    return out.returncode, [json.loads(line) for line in out.stdout.splitlines()]


def test_every_istio_export_validates() -> None:
    """All objects of all exports (presets, test policies, each mode) in one run of node."""
    objects = []
    for _name, policy in _policies():
        objects += [d for d in yaml.safe_load_all(export_policy(policy, "istio").text) if d is not None]
    kinds = {(o["apiVersion"], o["kind"]) for o in objects}
    assert kinds == {
        ("networking.istio.io/v1", "ServiceEntry"),
        ("security.istio.io/v1", "AuthorizationPolicy"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    }
    rc, results = validate(objects)
    assert len(results) == len(objects)
    assert rc == 0, [r for r in results if r["errors"]]


def test_models_refuse_a_wrong_object() -> None:
    """The models do validate: a wrong enum, type or required field in each kind fails."""
    docs = list(yaml.safe_load_all(export_policy(parse_policy(RICH, "rich"), "istio").text))
    by_kind = {d["kind"]: d for d in docs}
    wrong = []
    se = json.loads(json.dumps(by_kind["ServiceEntry"]))
    se["spec"]["location"] = "OUTSIDE"
    wrong.append(se)
    ap = json.loads(json.dumps(by_kind["AuthorizationPolicy"]))
    ap["spec"]["action"] = "REFUSE"
    wrong.append(ap)
    np = json.loads(json.dumps(by_kind["NetworkPolicy"]))
    np["spec"]["policyTypes"] = "Egress"  # a string for a list
    wrong.append(np)
    ports = json.loads(json.dumps(by_kind["ServiceEntry"]))
    ports["spec"]["ports"][0]["number"] = "443"
    wrong.append(ports)
    rc, results = validate(wrong)
    assert rc == 1
    assert all(r["errors"] for r in results), results


@pytest.mark.parametrize("kind", ["Gateway", "VirtualService"])
def test_a_kind_without_a_model_fails(kind: str) -> None:
    """An export that grew a new kind must get a model here, not pass unvalidated."""
    rc, results = validate(
        [{"apiVersion": "networking.istio.io/v1", "kind": kind, "metadata": {"name": "x"}}]
    )
    assert rc == 1 and results[0]["errors"] == ["no model for this kind"]
