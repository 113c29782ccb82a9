"""The child's environment: every client library points at egressd and nothing skips it."""

from __future__ import annotations

from egressd.child.env import (
    CA_BUNDLE_VARS,
    INSTALLER_RETRY_VARS,
    PROXY_VARS,
    SOCKS_VAR,
    child_environment,
    proxy_exports,
)

URL = "http://egressd:tok@127.0.0.1:4242"
SOCKS = "socks5h://egressd:tok@127.0.0.1:4343"


def test_proxy_variables_all_point_at_the_http_proxy() -> None:
    env = child_environment({"PATH": "/usr/bin", "HOME": "/root"}, URL, SOCKS)
    for key in PROXY_VARS:
        assert env[key] == URL
    assert env["ALL_PROXY"] == env["all_proxy"] == URL  # the HTTP URL there too
    assert env["NODE_USE_ENV_PROXY"] == "1"
    assert env[SOCKS_VAR] == SOCKS
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/root"


def test_no_proxy_is_empty_so_no_host_skips_a_decision() -> None:
    base = {"NO_PROXY": "localhost,.corp.example", "no_proxy": "*", "No_Proxy": "internal.example"}
    env = child_environment(base, URL, None)
    assert env["NO_PROXY"] == "" and env["no_proxy"] == ""
    assert "No_Proxy" not in env


def test_inherited_proxy_settings_are_replaced_or_removed() -> None:
    base = {
        "HTTP_PROXY": "http://corp-proxy.example:3128",
        "Https_Proxy": "http://corp-proxy.example:3128",
        "npm_config_proxy": "http://corp-proxy.example:3128",
        "NPM_CONFIG_HTTPS_PROXY": "http://corp-proxy.example:3128",
        "npm_config_noproxy": "*",
        "FTP_PROXY": "http://corp-proxy.example:21",
        "PIP_PROXY": "http://corp-proxy.example:3128",
    }
    env = child_environment(base, URL, None)
    assert env["HTTP_PROXY"] == URL
    for key in ("Https_Proxy", "npm_config_proxy", "NPM_CONFIG_HTTPS_PROXY", "npm_config_noproxy"):
        assert key not in env
    assert "FTP_PROXY" not in env and "PIP_PROXY" not in env


def test_inherited_egressd_variables_are_stripped() -> None:
    base = {"EGRESSD_TOKEN": "secret", "egressd_other": "x", "EGRESSD_SOCKS_PROXY": "socks5h://old", "A": "1"}
    env = child_environment(base, URL, None)
    assert not [k for k in env if k.upper().startswith("EGRESSD_")]
    assert env["A"] == "1"


def test_ca_bundle_variables_only_with_a_bundle() -> None:
    base = {"SSL_CERT_FILE": "/etc/ssl/mine.pem"}
    without = child_environment(base, URL, None)
    assert without["SSL_CERT_FILE"] == "/etc/ssl/mine.pem"  # inherited value left alone
    assert not set(CA_BUNDLE_VARS[1:]) & set(without)
    bundle = "/run/egressd/bundle.pem"
    with_bundle = child_environment(base, URL, None, ca_bundle=bundle)
    for key in CA_BUNDLE_VARS:
        assert with_bundle[key] == bundle
    assert len(CA_BUNDLE_VARS) == 10


def test_base_is_not_modified_and_result_is_a_new_dict() -> None:
    base = {"HTTP_PROXY": "x", "EGRESSD_X": "y"}
    before = dict(base)
    env = child_environment(base, URL, SOCKS)
    assert base == before
    assert env is not base


def test_proxy_exports_are_only_egressd_variables() -> None:
    exports = proxy_exports(URL, SOCKS)
    assert set(exports) == {*PROXY_VARS, "NO_PROXY", "no_proxy", "NODE_USE_ENV_PROXY", SOCKS_VAR}


def test_installer_retries_are_the_users_choice() -> None:
    """PIP_RETRIES/UV_HTTP_RETRIES are never set by egressd (they would end the retries of allowed
    hosts too); the user's own value passes through."""
    env = child_environment({"PATH": "/usr/bin"}, URL, None, ca_bundle="/x/ca-bundle.pem")
    assert not any(key in env for key in INSTALLER_RETRY_VARS)
    env = child_environment({"PIP_RETRIES": "0", "UV_HTTP_RETRIES": "0"}, URL, None)
    assert env["PIP_RETRIES"] == "0" and env["UV_HTTP_RETRIES"] == "0"
