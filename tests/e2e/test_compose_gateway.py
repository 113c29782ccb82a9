"""docker-compose.yml on a real Docker engine: egressd as the only way out of an agent container.

Why: the compose file is what a user runs, so the test runs it — `docker-compose up` with the
repository's file plus tests/compose.test.yml (the egress network internal too, the upstream a
container on it: no packet leaves the machine) — and looks only through containers: the agent's
curl through the gateway, another container without a token, the agent bypassing the proxy, a
policy edit on the host, and `docker-compose down`. No skip: CI runs as root with docker.io
installed by scripts/setup.sh, and a missing engine is a failure that says why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.support.attempts import wait_until
from tests.support.docker_lab import ComposeProject, build_images, start_engine, stop_engine

pytestmark = pytest.mark.timeout(900)
ENTRYPOINT = "/usr/local/bin/agent-entrypoint"  # docker/agent/entrypoint.sh: the proxy settings

# The upstream container's address is private (a compose network): its names are admitted as exact
# private origins, which also license the private address they resolve to.
POLICY = """\
version: 1
mode: enforce
allow: []
deny:
  - denied.test
inspect:
  - inspected.test  # so the gateway loads its CA, from the read-only mount
private:
  origins:
    - http://up.test:8080
    - https://up.test:8443
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[ComposeProject]:
    engine = start_engine()
    project: ComposeProject | None = None
    try:
        refs, seconds = build_images()
        print(f"gateway images ready in {seconds:.0f}s: {refs}")
        cert = ca.issue_cert("up.test")
        lab_files = {
            "server.pem": b"".join(blob.bytes() for blob in (*cert.cert_chain_pems, cert.private_key_pem)),
            "ca.pem": ca.cert_pem.bytes(),
        }
        project = ComposeProject(tmp_path_factory.mktemp("compose"), refs, POLICY, lab_files)
        try:
            project.up()
        except Exception:
            print(project.logs("egressd"), project.logs("egressd-init"))
            raise
        yield project
    finally:
        if project is not None:
            project.down()
        if engine is not None:
            stop_engine(engine)


def agent_curl(
    lab: ComposeProject, *args: str, service: str = "agent", one_off: bool = False
) -> tuple[int, dict[str, str], str]:
    """curl in the running `service` container through its entrypoint (which sets the proxy), or in a
    one-off container as the README does (`docker-compose run --rm`); status, headers, body."""
    argv = ["curl", "-sS", "-i", "--suppress-connect-headers", "--max-time", "20", *args]
    done = lab.run(service, argv) if one_off else lab.exec(service, [ENTRYPOINT, *argv])
    assert done.returncode == 0, f"curl failed ({done.returncode}): {done.stderr[-2000:]}"
    return parse_response(done.stdout)


def parse_response(raw: str) -> tuple[int, dict[str, str], str]:
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    lines = head.split("\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def upstream_requests(lab: ComposeProject) -> list[dict]:
    """The requests the upstream container answered (one JSON line each in its log)."""
    lines = (line.split("|", 1)[-1].strip() for line in lab.logs("upstream").splitlines())
    return [json.loads(line) for line in lines if line.startswith("{")]


def audit_records(lab: ComposeProject) -> list[dict]:
    done = lab.exec("egressd", ["cat", "/var/log/egressd/audit.jsonl"])
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_agent_reaches_an_allowed_upstream_through_the_gateway(lab: ComposeProject) -> None:
    status, _headers, body = agent_curl(lab, "http://up.test:8080/hello")
    assert status == 200, body
    assert body.strip() == "upstream ok host=up.test:8080 path=/hello"
    # the upstream saw the gateway (on the egress network), never the agent
    egressd_ip = lab.container_ip("egressd", "egress")
    assert {
        "peer": egressd_ip,
        "host": "up.test:8080",
        "path": "/hello",
        "scheme": "http",
    } in upstream_requests(lab)
    # the decision carries the client's name, in the audit and in the metrics
    records = wait_until(
        lambda: [
            r for r in audit_records(lab) if r.get("host") == "up.test" and r.get("decision") == "allow"
        ],
        "the allowed request in the audit log",
    )
    assert any(r.get("client") == "agent" for r in records), records
    metrics = lab.exec(
        "egressd",
        [
            "python3",
            "-c",
            "import urllib.request as u; token = open('/var/lib/egressd/metrics.token').read().strip(); "
            "print(u.build_opener(u.ProxyHandler({})).open(u.Request('http://127.0.0.1:9090/metrics', "
            "headers={'Authorization': 'Bearer ' + token})).read().decode())",
        ],
    )
    assert metrics.returncode == 0, metrics.stderr
    assert re.search(r'^egressd_\w+\{[^}]*"agent"[^}]*\} \d', metrics.stdout, re.M), metrics.stdout[-3000:]


def test_a_refused_host_gets_403_with_the_reason(lab: ComposeProject) -> None:
    # the README's command: docker-compose run --rm agent curl -sS http://refused.example/
    status, headers, body = agent_curl(lab, "http://refused.example/", one_off=True)
    assert status == 403
    assert headers["x-egressd-reason"] == "not_allowlisted"
    assert "refused.example" in body and "not_allowlisted" in body
    wait_until(
        lambda: [
            r
            for r in audit_records(lab)
            if r.get("host") == "refused.example"
            and r.get("decision") == "deny"
            and r.get("client") == "agent"
        ],
        "the refusal, with the client's name, in the audit log",
    )
    status, headers, body = agent_curl(lab, "http://denied.test:8080/")
    assert status == 403
    assert headers["x-egressd-reason"] == "denylist", headers


def test_agent_reaches_an_allowed_https_upstream_through_a_tunnel(lab: ComposeProject) -> None:
    """HTTPS through CONNECT, not inspected: the agent verifies the upstream's own certificate."""
    status, _headers, body = agent_curl(lab, "--cacert", "/lab/ca.pem", "https://up.test:8443/tls")
    assert status == 200, body
    assert body.strip() == "upstream ok host=up.test:8443 path=/tls"
    egressd_ip = lab.container_ip("egressd", "egress")
    assert [r for r in upstream_requests(lab) if r["path"] == "/tls" and r["peer"] == egressd_ip]


def test_the_policy_and_the_ca_are_read_only_in_the_gateway(lab: ComposeProject) -> None:
    """The CA (an `inspect` rule makes the gateway load it at start) and the policy are mounted
    read-only: the gateway runs with them as they are, and cannot change them."""
    assert lab.exec("egressd", ["test", "-s", "/var/lib/egressd/ca/mitmproxy-ca.pem"]).returncode == 0
    for path in ("/var/lib/egressd/ca/probe", "/etc/egressd/probe"):
        done = lab.exec("egressd", ["touch", path])
        assert done.returncode != 0 and "Read-only file system" in done.stderr, (path, done.stderr)
    assert "cannot set up egressd's CA" not in lab.logs("egressd")
    assert lab.health("egressd") == "healthy"  # the health check: GET /healthz on the proxy port


def test_the_agent_has_no_way_out_but_the_gateway(lab: ComposeProject) -> None:
    upstream_ip = lab.container_ip("upstream", "egress")
    assert upstream_ip
    direct = ["curl", "-sS", "--noproxy", "*", "--max-time", "5", f"http://{upstream_ip}:8080/direct"]
    done = lab.exec("agent", [ENTRYPOINT, *direct])
    assert done.returncode != 0, done.stdout  # 7 (no route / refused) or 28 (dropped): never an answer
    assert not [r for r in upstream_requests(lab) if r["path"] == "/direct"]


def test_a_container_without_a_token_gets_407(lab: ComposeProject) -> None:
    insecure = "--proxy-insecure"  # the stranger has not egressd's CA: it still gets no further
    status, headers, _ = agent_curl(
        lab, insecure, "-x", "https://egressd:3128", "http://up.test:8080/anon", service="stranger"
    )
    assert status == 407
    assert "proxy-authenticate" in headers
    forged = "https://agent:not-the-token@egressd:3128"
    status, _, _ = agent_curl(lab, insecure, "-x", forged, "http://up.test:8080/forged", service="stranger")
    assert status == 407
    assert not [r for r in upstream_requests(lab) if r["path"] in ("/anon", "/forged")]


def test_the_proxy_port_speaks_only_tls(lab: ComposeProject) -> None:
    """The agents' proxy URL is https:// and verified against egressd's CA (the entrypoint's
    bundle); a client speaking clear text, as a token sniffer on the network would see it, gets no
    HTTP answer, and one that does not trust egressd's CA stops at the handshake."""
    done = lab.exec("agent", [ENTRYPOINT, "sh", "-c", 'printf %s "$HTTPS_PROXY" | cut -d: -f1'])
    assert done.stdout.strip() == "https", done
    clear = [
        "curl",
        "-sS",
        "-i",
        "--max-time",
        "10",
        "-x",
        "http://egressd:3128",
        "http://up.test:8080/clear",
    ]
    done = lab.exec("stranger", clear)
    assert done.returncode != 0 and not done.stdout.startswith("HTTP/"), done
    untrusted = ["curl", "-sS", "--max-time", "10", "-x", "https://egressd:3128", "http://up.test:8080/x"]
    done = lab.exec("stranger", untrusted)
    assert done.returncode in (35, 60), done  # the certificate is not one it trusts
    assert not [r for r in upstream_requests(lab) if r["path"] in ("/clear", "/x")]


def test_agents_cannot_read_the_metrics(lab: ComposeProject) -> None:
    """The agents share a network with the gateway's metrics port: without the token in egressd's
    volume (which no agent mounts) it answers 401 and shows nothing."""
    for service in ("agent", "stranger"):
        argv = ["curl", "-sS", "-i", "--noproxy", "*", "--max-time", "10", "http://egressd:9090/metrics"]
        done = lab.exec(service, argv)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("HTTP/1.0 401") or done.stdout.startswith("HTTP/1.1 401"), done.stdout
        assert "egressd_" not in done.stdout
        guessed = [*argv[:-1], "-H", "Authorization: Bearer agent", argv[-1]]
        assert " 401 " in lab.exec(service, guessed).stdout.splitlines()[0]
    listing = lab.exec("agent", ["sh", "-c", "ls -a /run/egressd"])
    assert "metrics.token" not in listing.stdout


def test_a_policy_edit_on_the_host_applies_without_a_restart(lab: ComposeProject) -> None:
    started = lab.inspect("egressd", "{{.Id}} {{.State.StartedAt}} {{.RestartCount}}")
    status, headers, _ = agent_curl(lab, "http://other.test:8080/before")
    assert status == 403 and headers["x-egressd-reason"] == "not_allowlisted"
    lab.write_policy(POLICY + "    - http://other.test:8080\n")

    def allowed() -> bool:
        return agent_curl(lab, "http://other.test:8080/after")[0] == 200

    wait_until(allowed, "other.test allowed after the policy edit", timeout=60, step=1)
    # the same container, never restarted
    assert lab.inspect("egressd", "{{.Id}} {{.State.StartedAt}} {{.RestartCount}}") == started


def test_down_leaves_nothing(lab: ComposeProject) -> None:
    assert all(lab.leftovers().values()), lab.leftovers()  # the project is really there first
    done = lab.down()
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 30
    while any(lab.leftovers().values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lab.leftovers() == {"containers": [], "networks": [], "volumes": []}


def test_compose_file_keeps_the_gateway_shape() -> None:
    """The user's file (not the test override): agents internal, policy and CA read-only, audit to a
    volume, a health check, metrics published."""
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    gateway = spec["services"]["egressd"]
    assert spec["networks"]["agents"]["internal"] is True
    assert set(gateway["networks"]) == {"agents", "egress"}
    assert spec["services"]["agent"]["networks"] == ["agents"]
    volumes = gateway["volumes"]
    assert any(v.endswith(":/etc/egressd:ro") for v in volumes)
    assert any(v.endswith(":/var/lib/egressd/ca:ro") for v in volumes)
    assert "audit:/var/log/egressd" in volumes
    assert "healthcheck" in gateway and any("9090" in p for p in gateway["ports"])
    assert "--gateway" in gateway["command"]
    assert "--tls-name=egressd" in gateway["command"]  # the agents' tokens never in clear
    assert any(c.startswith("--metrics-token-file=") for c in gateway["command"])
