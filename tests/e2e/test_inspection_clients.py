"""Real clients (git, npm, pip, node, requests) through egressd's TLS inspection, to real local servers.

Why: inspection is only useful if the tools people wrap actually work through it with nothing but the
child environment egressd sets — the CA-bundle variables pointing at system roots plus egressd's CA.
Every test therefore passes NO CA option to the client (and strips inherited CA variables): the client
trusts egressd's certificate for an intercepted host only through egressd's variables, and does not
trust the test upstream's own CA at all, so a tunnel that was not intercepted would fail. Each host is
admitted only by a ``builtin`` allowance with fixed path prefixes (or an ``inspect`` rule), so the paths
are decided per request; a second run under ``--no-inspect`` must be refused at CONNECT with
``needs_inspection`` before anything reaches the server (the servers count TCP connections). The audit
log (``--audit``) shows which rule decided each request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from egressd.child.env import CA_BUNDLE_VARS
from tests.support.audit_log import audit_records
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.git_server import GitHTTPServer, git_env, make_bare_repo
from tests.support.npm_registry import NpmRegistry
from tests.support.pypi_index import TINY_INIT, PypiIndex
from tests.support.upstreams import EchoHTTPSServer

GIT_ADDR = "198.51.100.30"
NPM_ADDR = "198.51.100.31"
API_ADDR = "198.51.100.33"

NODE_CLIENT = Path(__file__).parents[1] / "support" / "node_inspect_client.js"

# Documentation addresses are private: the CIDR allow rule admits the ADDRESSES a name resolves to,
# never the name itself (only the builtin/inspect rule below it does that).
POLICY_HEAD = """\
version: 1
mode: enforce
allow:
  - 198.51.100.0/24
"""

REQUESTS_CLIENT = """\
import json, os, sys
import requests
out = []
for url in sys.argv[1:]:
    try:
        r = requests.get(url, timeout=20)
        reason = r.headers.get("X-Egressd-Reason")
        out.append({"status": r.status_code, "reason": reason, "body": r.text[:2000]})
    except requests.exceptions.ProxyError as exc:
        out.append({"error": "proxy", "detail": str(exc)})
    except requests.exceptions.RequestException as exc:
        out.append({"error": type(exc).__name__, "detail": str(exc)})
ca_vars = {k: os.environ.get(k) for k in CA_VARS}
print(json.dumps({"results": out, "ca_vars": ca_vars}))
""".replace("CA_VARS", repr(list(CA_BUNDLE_VARS)))


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
class Runner:
    """Runs a client under ``egressd exec`` with the test's policy, DNS, upstream CA and its own home."""

    def __init__(self, tmp_path: Path, dns: DnsServer, ca_file: Path, policy_body: str) -> None:
        self.tmp_path = tmp_path
        self.dns = dns
        self.ca_file = ca_file
        self.policy = write_policy(tmp_path, POLICY_HEAD + policy_body)
        self.home = tmp_path / "egressd-home"
        self.runs = 0

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # no inherited CA variables: trust must come from what egressd sets (or nothing at all);
        # no inherited pip/npm settings either (this machine sets PIP_FIND_LINKS, PIP_CERT, ...)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in CA_BUNDLE_VARS
            and k != "SSL_CERT_DIR"
            and not k.upper().startswith(("PIP_", "NPM_CONFIG_"))
        }
        env["EGRESSD_HOME"] = str(self.home)
        env.update(extra or {})
        return env

    def run(
        self,
        command: list[str],
        *,
        inspect: bool = True,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[subprocess.CompletedProcess[bytes], list[dict[str, Any]]]:
        """Run ``command``; returns the result and the audit records of this run."""
        self.runs += 1
        audit = self.tmp_path / f"audit-{self.runs}.jsonl"
        options = [
            "--policy",
            str(self.policy),
            "--nameserver",
            self.dns.nameserver,
            "--upstream-ca",
            str(self.ca_file),
            "--audit",
            str(audit),
        ]
        if not inspect:
            options.append("--no-inspect")
        proc = egressd_exec(options, command, env=self.env(env), timeout=timeout)
        records = audit_records(audit)
        return proc, records


def _decisions(records: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "decision" and r.get("reason") == reason]


def _show(proc: subprocess.CompletedProcess[bytes]) -> str:
    return (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout.decode(errors='replace')[-3000:]}\n"
        f"stderr:\n{proc.stderr.decode(errors='replace')[-3000:]}"
    )


def _assert_needs_inspection(
    proc: subprocess.CompletedProcess[bytes], records: list[dict[str, Any]], server_connections: int
) -> None:
    """Under --no-inspect: the client failed, egressd refused the CONNECT, the server saw nothing."""
    assert proc.returncode != 0, _show(proc)
    refused = _decisions(records, "needs_inspection")
    assert refused, f"no needs_inspection decision in the audit: {records}\n{_show(proc)}"
    assert all(r["decision"] == "deny" and r["stage"] == "connect" for r in refused), refused
    assert server_connections == 0, "a refused client reached the server"


RunnerFactory = Callable[[str], Runner]


@pytest.fixture
def runner_factory(tmp_path: Path, dns: DnsServer, ca_file: Path) -> RunnerFactory:
    """Make a Runner for a policy: POLICY_HEAD (the CIDR allow rule) followed by the test's lines."""

    def make(policy_body: str) -> Runner:
        return Runner(tmp_path, dns, ca_file, policy_body)

    return make


# ------------------------------------------------------------------------------------------------
# 1. git clone over smart HTTP
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def git_server(tmp_path: Path, ca: trustme.CA, dns: DnsServer) -> Iterator[GitHTTPServer]:
    root = tmp_path / "git-root"
    home = tmp_path / "git-home"
    home.mkdir()
    make_bare_repo(root, "repo.git", {"README.md": "hello through inspection\n"}, home=home)
    make_bare_repo(root, "other.git", {"SECRET.md": "not for this policy\n"}, home=home)
    dns.add("git.test", GIT_ADDR)
    with GitHTTPServer(GIT_ADDR, ca=ca, hostnames=["git.test"], project_root=root, home=home) as server:
        yield server


def test_git_clone_through_inspection(
    tmp_path: Path, runner_factory: RunnerFactory, git_server: GitHTTPServer
) -> None:
    """git clones /repo.git/ with only GIT_SSL_CAINFO from egressd; /other.git/ is refused (builtin_path)."""
    runner = runner_factory("builtin:\n  - {host: git.test, paths: [/repo.git/], methods: [GET, POST]}\n")
    client_home = tmp_path / "client-home"
    client_home.mkdir()
    env = git_env(client_home)
    base = git_server.base_url

    proc, records = runner.run(["git", "clone", f"{base}/repo.git", str(tmp_path / "clone")], env=env)
    assert proc.returncode == 0, _show(proc)
    assert (tmp_path / "clone" / "README.md").read_text() == "hello through inspection\n"
    assert any(p.startswith("/repo.git/git-upload-pack") for p in git_server.paths), git_server.paths
    assert _decisions(records, "builtin"), records

    before = list(git_server.paths)
    proc, records = runner.run(["git", "clone", f"{base}/other.git", str(tmp_path / "other")], env=env)
    assert proc.returncode != 0, _show(proc)
    # git shows egressd's refusal body as "remote:" lines, then the HTTP status
    assert b"reason: builtin_path" in proc.stderr and b"returned error: 403" in proc.stderr, _show(proc)
    assert not (tmp_path / "other").exists()
    refused = _decisions(records, "builtin_path")
    assert refused and refused[0]["path"].startswith("/other.git/"), records
    assert git_server.paths == before, "a refused request reached the git server"

    connections = git_server.connections
    proc, records = runner.run(
        ["git", "clone", f"{base}/repo.git", str(tmp_path / "no-inspect")], env=env, inspect=False
    )
    assert b"CONNECT tunnel failed, response 403" in proc.stderr, _show(proc)
    _assert_needs_inspection(proc, records, git_server.connections - connections)


# ------------------------------------------------------------------------------------------------
# 2. npm install from a registry
# ------------------------------------------------------------------------------------------------
def _npm_env(tmp_path: Path) -> dict[str, str]:
    """npm with no user/global config, no update check, no retries (a refusal must fail fast).

    No proxy and no CA setting on purpose: npm 11's @npmcli/agent (lib/proxy.js) falls back to the
    https_proxy/HTTPS_PROXY environment variable when the `https-proxy` config is unset, and with no
    `ca`/`cafile` config node's default roots plus NODE_EXTRA_CA_CERTS are used — both set by egressd,
    so neither npm_config_https_proxy nor npm_config_cafile is needed.
    """
    home = tmp_path / "npm-home"
    home.mkdir(exist_ok=True)
    npmrc = home / ".npmrc"
    npmrc.write_text("")
    return {
        "HOME": str(home),
        "npm_config_userconfig": str(npmrc),
        "npm_config_globalconfig": str(home / "global-npmrc"),
        "npm_config_update_notifier": "false",
        "npm_config_fetch_retries": "0",
        "npm_config_loglevel": "warn",
    }


def test_npm_install_through_inspection(
    tmp_path: Path, runner_factory: RunnerFactory, npm_registry: NpmRegistry
) -> None:
    """npm installs a package and its dependency with only egressd's env; another package is refused."""
    runner = runner_factory(
        "builtin:\n  - {host: registry.test, paths: [/egressd-tiny, /egressd-tiny-dep]}\n"
    )
    env = _npm_env(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text(
        json.dumps({"name": "project", "version": "0.0.0", "private": True})
    )
    npm = [
        "npm",
        "install",
        "--prefix",
        str(project),
        "--registry",
        f"{npm_registry.base_url}/",
        "--no-audit",
        "--no-fund",
        "--cache",
        str(tmp_path / "npm-cache"),
    ]

    proc, records = runner.run([*npm, "egressd-tiny"], env=env, timeout=90)
    assert proc.returncode == 0, _show(proc)
    modules = project / "node_modules"
    assert json.loads((modules / "egressd-tiny" / "package.json").read_text())["version"] == "1.0.0"
    assert (
        (modules / "egressd-tiny-dep" / "index.js").read_text().strip().endswith('"egressd-tiny-dep@1.0.0";')
    )
    assert "/egressd-tiny/-/egressd-tiny-1.0.0.tgz" in npm_registry.paths, npm_registry.paths
    assert _decisions(records, "builtin"), records

    before = list(npm_registry.paths)
    proc, records = runner.run([*npm, "egressd-unlisted"], env=env, timeout=90)
    assert proc.returncode != 0, _show(proc)
    assert b"403" in proc.stderr, _show(proc)
    assert _decisions(records, "builtin_path"), records
    assert npm_registry.paths == before, "a refused request reached the registry"
    assert not (modules / "egressd-unlisted").exists()

    connections = npm_registry.connections
    proc, records = runner.run(
        [*npm, "--cache", str(tmp_path / "npm-cache-2"), "egressd-tiny-dep@1.0.0"],
        env=env,
        inspect=False,
        timeout=90,
    )
    _assert_needs_inspection(proc, records, npm_registry.connections - connections)


# ------------------------------------------------------------------------------------------------
# 3. pip install from a simple index
# ------------------------------------------------------------------------------------------------
def _pip_command(index: PypiIndex, target: Path, simple: str = "/simple/") -> list[str]:
    # one retry: with none, pip swallows the proxy's 403 and says only "No matching distribution"
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--retries",
        "1",
        "--timeout",
        "20",
        "--index-url",
        f"{index.base_url}{simple}",
        "--target",
        str(target),
        "egressd-tiny",
    ]


def test_pip_install_through_inspection(
    tmp_path: Path, runner_factory: RunnerFactory, pypi_index: PypiIndex
) -> None:
    """pip installs a wheel from a local index trusting egressd's CA via PIP_CERT/REQUESTS_CA_BUNDLE."""
    runner = runner_factory("builtin:\n  - {host: pypi.test, paths: [/simple/, /packages/]}\n")
    # no pip configuration of the user's; but NOT --isolated, which would ignore PIP_CERT too
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1"}
    target = tmp_path / "target"

    proc, records = runner.run(_pip_command(pypi_index, target), env=env, timeout=90)
    assert proc.returncode == 0, _show(proc)
    assert (target / "egressd_tiny" / "__init__.py").read_text() == TINY_INIT
    assert any(p.startswith("/packages/egressd_tiny-1.0-py3-none-any.whl") for p in pypi_index.paths)
    assert _decisions(records, "builtin"), records

    # an index under another path of the same host is outside the allowance
    before = list(pypi_index.paths)
    proc, records = runner.run(
        _pip_command(pypi_index, tmp_path / "target-2", "/mirror/simple/"), env=env, timeout=90
    )
    # pip reports an index page's 4xx only with -v ("HTTP error 403 while getting"): check the audit
    assert proc.returncode != 0, _show(proc)
    refused = _decisions(records, "builtin_path")
    assert refused and refused[0]["path"].startswith("/mirror/simple/"), records
    assert pypi_index.paths == before, "a refused request reached the index"

    connections = pypi_index.connections
    proc, records = runner.run(
        _pip_command(pypi_index, tmp_path / "target-3"), env=env, inspect=False, timeout=90
    )
    assert b"Tunnel connection failed: 403" in proc.stderr, _show(proc)
    _assert_needs_inspection(proc, records, pypi_index.connections - connections)
    assert not (tmp_path / "target-3" / "egressd_tiny").exists()


# ------------------------------------------------------------------------------------------------
# 4. node (CONNECT by hand, tls.connect without `ca`) and 5. Python requests
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def api_server(ca: trustme.CA, dns: DnsServer) -> Iterator[EchoHTTPSServer]:
    dns.add("api.test", API_ADDR)
    with EchoHTTPSServer(API_ADDR, name="api", ca=ca, hostnames=["api.test"]) as server:
        yield server


API_POLICY = "builtin:\n  - {host: api.test, paths: [/v1/public/]}\n"


def _check_allowed_and_refused(results: list[dict[str, Any]], server: EchoHTTPSServer) -> None:
    allowed, refused = results
    assert allowed.get("status") == 200, results
    assert json.loads(allowed["body"])["path"] == "/v1/public/item", results
    assert refused.get("status") == 403 and refused.get("reason") == "builtin_path", results
    assert [r["path"] for r in server.requests] == ["/v1/public/item"], "a refused request reached the server"


def test_node_https_through_inspection(runner_factory: RunnerFactory, api_server: EchoHTTPSServer) -> None:
    """node trusts egressd's certificate through NODE_EXTRA_CA_CERTS alone; the other path gets 403."""
    runner = runner_factory(API_POLICY)
    urls = [
        api_server.url_for("api.test", "/v1/public/item"),
        api_server.url_for("api.test", "/v1/private/x"),
    ]

    proc, _ = runner.run(["node", str(NODE_CLIENT), *urls])
    assert proc.returncode == 0, _show(proc)
    _check_allowed_and_refused(json.loads(proc.stdout), api_server)

    connections = api_server.connections
    proc, records = runner.run(["node", str(NODE_CLIENT), urls[0]], inspect=False)
    results = json.loads(proc.stdout)
    assert results == [{"connect": 403, "reason": "needs_inspection"}], results
    assert _decisions(records, "needs_inspection"), records
    assert api_server.connections == connections, "a refused client reached the server"


def _assert_bundle_env(ca_vars: dict[str, str | None], runner: Runner, ca: trustme.CA) -> None:
    """Every CA variable names $EGRESSD_HOME/public/ca-bundle.pem: egressd's CA, not the test upstream's."""
    bundle = runner.home / "public" / "ca-bundle.pem"
    assert ca_vars == dict.fromkeys(CA_BUNDLE_VARS, str(bundle)), ca_vars
    text = bundle.read_text()
    assert (runner.home / "public" / "egressd-ca-cert.pem").read_text().strip() in text
    assert ca.cert_pem.bytes().decode().strip() not in text, (
        "the upstream's CA must not be trusted by the child"
    )


def test_requests_through_inspection(
    tmp_path: Path, runner_factory: RunnerFactory, api_server: EchoHTTPSServer, ca: trustme.CA
) -> None:
    """requests trusts egressd's certificate through REQUESTS_CA_BUNDLE alone; the other path gets 403."""
    runner = runner_factory(API_POLICY)
    script = tmp_path / "requests_client.py"
    script.write_text(REQUESTS_CLIENT)
    urls = [
        api_server.url_for("api.test", "/v1/public/item"),
        api_server.url_for("api.test", "/v1/private/x"),
    ]

    proc, _ = runner.run([sys.executable, str(script), *urls])
    assert proc.returncode == 0, _show(proc)
    out = json.loads(proc.stdout)
    _assert_bundle_env(out["ca_vars"], runner, ca)
    _check_allowed_and_refused(out["results"], api_server)

    connections = api_server.connections
    proc, records = runner.run([sys.executable, str(script), urls[0]], inspect=False)
    out = json.loads(proc.stdout)
    (result,) = out["results"]
    assert result.get("error") == "proxy" and "403" in result["detail"], result
    refused = _decisions(records, "needs_inspection")
    assert refused and refused[0]["stage"] == "connect", records
    assert api_server.connections == connections, "a refused client reached the server"
    # no inspection, no CA variables (and this run inherited none)
    assert out["ca_vars"] == dict.fromkeys(CA_BUNDLE_VARS), out["ca_vars"]


def test_requests_through_inspect_rule(
    tmp_path: Path, runner_factory: RunnerFactory, api_server: EchoHTTPSServer, ca: trustme.CA
) -> None:
    """A host in `inspect:` (admitted whole by an allow rule) is intercepted: requests sees egressd's
    certificate and every request is decided and audited with its path. Under --no-inspect the tunnel
    passes through untouched (as documented: --no-inspect never intercepts), so the client sees the
    upstream's own certificate, which it does not trust."""
    runner = runner_factory("  - api.test\ninspect:\n  - api.test\n")
    script = tmp_path / "requests_client.py"
    script.write_text(REQUESTS_CLIENT)
    url = api_server.url_for("api.test", "/any/path")

    proc, records = runner.run([sys.executable, str(script), url])
    assert proc.returncode == 0, _show(proc)
    out = json.loads(proc.stdout)
    _assert_bundle_env(out["ca_vars"], runner, ca)
    (result,) = out["results"]
    assert result.get("status") == 200 and json.loads(result["body"])["path"] == "/any/path", result
    seen = [r for r in records if r.get("stage") == "request" and r.get("reason") == "allowlist"]
    assert seen and seen[0]["path"] == "/any/path", records

    handshakes = api_server.tls_handshakes
    proc, records = runner.run([sys.executable, str(script), url], inspect=False)
    out = json.loads(proc.stdout)
    assert out["ca_vars"] == dict.fromkeys(CA_BUNDLE_VARS), out["ca_vars"]
    (result,) = out["results"]
    assert result.get("error") == "SSLError", result
    assert api_server.tls_handshakes == handshakes and api_server.tls_failures, "the upstream was reached"
    assert not [r for r in records if r.get("stage") == "request"], records
