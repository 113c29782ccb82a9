"""The macOS Seatbelt profile and argv, golden, checked on any platform.

The property that matters: no rule opens outbound traffic beyond the proxy's loopback ports, in
particular no network-outbound rule filtered on the LOCAL endpoint (the known trap: every
outbound connection has a local endpoint, so such a rule opens everything).
"""

from __future__ import annotations

import pytest

from egressd.sandbox.seatbelt import (
    network_rules,
    outbound_rules,
    sbpl_string,
    seatbelt_argv,
    seatbelt_profile,
)

GOLDEN = """\
(version 1)
;; egressd sandbox: the proxy on the loopback is the only way out.
(allow default)

;; Network: nothing unless allowed below. This also refuses the resolver's socket
;; (/private/var/run/mDNSResponder): there is no DNS inside, the proxy resolves names.
(deny network*)
;; The child's own servers on loopback: bind and accept only. There is deliberately no
;; network-outbound rule on the LOCAL endpoint: every outbound connection has one, so
;; such a rule would open outbound traffic to anywhere.
(allow network-bind (local ip "localhost:*"))
(allow network-inbound (local ip "localhost:*"))
;; The one way out: egressd's proxy.
(allow network-outbound (remote ip "localhost:49152"))
(allow network-outbound (remote ip "localhost:49153"))

;; Files: read anywhere; write only in the working directory, --rw paths and temporary files.
(deny file-write*)
(allow file-write*
    (subpath "/Users/u/project")
    (subpath "/private/tmp")
    (subpath "/private/var/folders/xy/T")
    (literal "/dev/null")
    (literal "/dev/zero")
    (literal "/dev/dtracehelper")
    (regex #"^/dev/tty")
    (regex #"^/dev/fd/")
)
;; --ro paths stay read-only even inside a writable directory.
(deny file-write*
    (subpath "/Users/u/project/.git")
)
"""


def _profile() -> str:
    return seatbelt_profile(
        [49152, 49153],
        writable=["/Users/u/project", "/private/tmp", "/private/var/folders/xy/T"],
        readonly=["/Users/u/project/.git"],
    )


def test_golden_profile() -> None:
    assert _profile() == GOLDEN


def test_golden_argv() -> None:
    assert seatbelt_argv(GOLDEN, ["curl", "-sS", "https://example.com/"]) == [
        "/usr/bin/sandbox-exec",
        "-p",
        GOLDEN,
        "--",
        "curl",
        "-sS",
        "https://example.com/",
    ]


def test_only_the_proxy_ports_are_open_outbound() -> None:
    """Every allowing rule that could match an outbound connection names a proxy port, remotely."""
    assert outbound_rules(_profile()) == [
        '(remote ip "localhost:49152")',
        '(remote ip "localhost:49153")',
    ]


def test_no_rule_filters_outbound_on_the_local_endpoint() -> None:
    rules = network_rules(_profile())
    assert rules[0] == ("deny", "network*", "")  # everything network is denied first
    for action, operation, filt in rules:
        if action == "allow":
            assert operation in ("network-bind", "network-inbound", "network-outbound")
            if operation == "network-outbound":
                assert filt.startswith("(remote ip ") and "*" not in filt
            else:
                assert filt == '(local ip "localhost:*")'


def test_the_trap_would_be_caught() -> None:
    """The checker itself sees a local-endpoint outbound allowance (it is not vacuous)."""
    trapped = _profile() + '(allow network-outbound (local ip "localhost:*"))\n'
    assert '(local ip "localhost:*")' in outbound_rules(trapped)
    broad = _profile() + "(allow network*)\n"
    assert "" in outbound_rules(broad)


def test_the_deny_comes_before_the_allowances() -> None:
    """Seatbelt applies the last matching rule: a deny after the allowances would close the proxy."""
    rules = network_rules(_profile())
    denies = [i for i, rule in enumerate(rules) if rule[0] == "deny"]
    allows = [i for i, rule in enumerate(rules) if rule[0] == "allow"]
    assert max(denies) < min(allows)


def test_paths_are_quoted() -> None:
    assert sbpl_string('/Users/a "b"\\c') == '"/Users/a \\"b\\"\\\\c"'
    profile = seatbelt_profile([1], writable=['/tmp/we"ird'])
    assert '(subpath "/tmp/we\\"ird")' in profile


def test_a_proxy_port_is_required() -> None:
    with pytest.raises(ValueError, match="proxy port"):
        seatbelt_profile([], writable=[])


# -- the whole macOS invocation, as `egressd sandbox` builds it ------------------------------------
class _FakeProxy:
    http_address = ("127.0.0.1", 49152)
    socks_address = ("127.0.0.1", 49153)


class _FakeSession:
    proxy = _FakeProxy()
    ca_bundle = None

    def __init__(self) -> None:
        from egressd.policy import parse_policy

        self.policy = parse_policy({"version": 1, "allow": ["github.com:22"]}, "p.yaml")


def test_full_macos_invocation(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressd.engine.credentials import ProxyCredentials
    from egressd.process import SignalCatcher
    from egressd.sandbox import run
    from egressd.sandbox.layout import Layout
    from egressd.sandbox.mounts import Mount

    seen: dict[str, object] = {}

    def fake_run_child(argv: list[str], env: dict[str, str], *, catcher: object) -> int:
        seen.update(argv=argv, env=env)
        return 7

    monkeypatch.setattr(run, "run_child", fake_run_child)
    monkeypatch.setattr(run.os.path, "realpath", lambda p: {"/tmp": "/private/tmp"}.get(p, p))
    monkeypatch.setenv("TMPDIR", "/private/var/folders/xy/T")
    monkeypatch.setenv("HTTPS_PROXY", "http://inherited.example:1")
    outcome = run.run_seatbelt(
        _FakeSession(),  # type: ignore[arg-type]
        ProxyCredentials("egressd", "tok"),
        ["git", "fetch"],
        Layout((Mount("/Users/u/project", True), Mount("/Users/u/project/.git", False)), (), (), ()),
        sandbox_exec="/usr/bin/sandbox-exec",
        catcher=SignalCatcher(()),
    )
    assert outcome.returncode == 7
    argv = seen["argv"]
    assert argv == ["/usr/bin/sandbox-exec", "-p", GOLDEN, "--", "git", "fetch"]
    env = seen["env"]
    assert isinstance(env, dict)
    # on macOS the child talks to the proxy's own loopback port: the profile's only way out
    assert env["HTTPS_PROXY"] == "http://egressd:tok@127.0.0.1:49152"
    assert env["EGRESSD_SOCKS_PROXY"] == "socks5h://egressd:tok@127.0.0.1:49153"
    assert env["EGRESSD_SANDBOX"] == "seatbelt"
    assert "egressd.connect %h %p" in env["GIT_SSH_COMMAND"]
