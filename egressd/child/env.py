"""The environment a child runs with: every client library it may use is pointed at egressd.

A function of the inherited environment and the proxy address, so it is easy to test and the CLI
stays thin; the fixes for clients that need to be looked at first (node's version, the user's
wgetrc) are in child/client_fixes.py. What a child gets: docs/architecture.md, "The child's environment".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# Variables holding the proxy URL. ALL_PROXY carries the HTTP URL too (curl, git and others
# accept an http:// proxy there), so every client speaks the one protocol egressd decides best.
PROXY_VARS: tuple[str, ...] = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
)

# Set to "" so no host skips the proxy: a bypass is a connection no policy decided.
NO_PROXY_VARS: tuple[str, ...] = ("NO_PROXY", "no_proxy")

# Only set when TLS inspection is on; they point at a bundle of system roots plus egressd's CA.
CA_BUNDLE_VARS: tuple[str, ...] = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "AWS_CA_BUNDLE",
    "CARGO_HTTP_CAINFO",
    "DENO_CERT",
    "NIX_SSL_CERT_FILE",
)

# Not set: PIP_RETRIES=0 / UV_HTTP_RETRIES=0. pip (5 retries) and uv (3) retry a refused CONNECT
# as if the network failed, with back-off, though a policy refusal never succeeds. Setting them
# would also end the retries of hosts the policy allows, whose failures may well be transient (a
# reset, a 503 from an index), and egressd cannot tell an installer from a shell that runs one:
# not safe as a default. The user sets them (README, "pip and uv retry refusals"); an inherited
# value passes through. The refusal report on stderr names the host at the first refusal anyway,
# and with `refusal_pages: tls` pip gets a 403 response, which it does not retry.
INSTALLER_RETRY_VARS: tuple[str, ...] = ("PIP_RETRIES", "UV_HTTP_RETRIES")

# The SOCKS5 URL (with the same credentials) for clients that want SOCKS explicitly. Set after
# inherited EGRESSD_* variables are stripped, so it is always this child's own.
SOCKS_VAR = "EGRESSD_SOCKS_PROXY"

# Inherited proxy settings that would send a client elsewhere or exempt hosts from the proxy.
# Compared case-insensitively: tools differ in which spelling they read.
_STRIP_LOWER: frozenset[str] = frozenset(
    {
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "ftp_proxy",
        "npm_config_proxy",
        "npm_config_https_proxy",
        "npm_config_noproxy",
        "npm_config_no_proxy",
        "yarn_proxy",
        "yarn_https_proxy",
        "pip_proxy",
    }
)


def stripped_variable(name: str) -> bool:
    """An inherited variable a child never gets: a proxy setting egressd replaces or an EGRESSD_*
    variable (egressd's own configuration and secrets)."""
    return name.lower() in _STRIP_LOWER or name.upper().startswith("EGRESSD_")


def child_environment(
    base: Mapping[str, str],
    proxy_url: str,
    socks_url: str | None = None,
    *,
    ca_bundle: str | None = None,
    placeholders: Mapping[str, str] | None = None,
    hidden: Collection[str] = (),
) -> dict[str, str]:
    """Return the environment for a child whose traffic must go through egressd.

    `base` is the inherited environment (not modified). Inherited proxy settings and
    EGRESSD_* variables (egressd's own configuration and secrets) are removed first, then the
    proxy variables are set to `proxy_url`. CA-bundle variables are set only when `ca_bundle`
    is given (TLS inspection on); otherwise inherited values are left alone. `placeholders` are the
    secrets' variables ({variable: placeholder}, never a value) and `hidden` the variables of
    egressd's environment that hold their values: the child never gets those.
    """
    env = {key: value for key, value in base.items() if not stripped_variable(key) and key not in hidden}
    for key in PROXY_VARS:
        env[key] = proxy_url
    for key in NO_PROXY_VARS:
        env[key] = ""
    env["NODE_USE_ENV_PROXY"] = "1"
    if socks_url:
        env[SOCKS_VAR] = socks_url
    if ca_bundle is not None:
        for key in CA_BUNDLE_VARS:
            env[key] = ca_bundle
    from egressd.child.client_fixes import client_fixes

    env.update(client_fixes(base, env, ca_bundle))
    env.update(placeholders or {})
    return env


JAVA_OPTIONS = "JAVA_TOOL_OPTIONS"
# The proxy URL without credentials of `egressd exec`'s child-only listener, for clients that
# cannot send proxy credentials: `chromium --proxy-server="$EGRESSD_CHILD_PROXY"`.
CHILD_PROXY_VAR = "EGRESSD_CHILD_PROXY"


def java_trust_options(inherited: str | None, store: str) -> str:
    """JAVA_TOOL_OPTIONS with egressd's trust store: the JVM reads no CA-bundle variable, and a
    JVM whose connections are captured meets egressd's CA on the hosts it inspects."""
    ours = f"-Djavax.net.ssl.trustStore={store} -Djavax.net.ssl.trustStoreType=JKS"
    return f"{inherited} {ours}" if inherited else ours


def java_proxy_options(inherited: str | None, address: tuple[str, int]) -> str:
    """JAVA_TOOL_OPTIONS with a credential-free proxy port for HTTP and HTTPS, and no host exempted
    (the JVM's default skips localhost, which must be decided like any host). Appended after the
    user's own options: the JVM applies them in order, so egressd's proxy settings win."""
    host, port = address
    ours = " ".join(
        f"-D{scheme}.proxyHost={host} -D{scheme}.proxyPort={port}" for scheme in ("http", "https")
    )
    ours += " -Dhttp.nonProxyHosts="
    return f"{inherited} {ours}" if inherited else ours


def java_environment(
    env: dict[str, str], *, proxy: tuple[str, int] | None = None, truststore: str | None = None
) -> dict[str, str]:
    """env with JAVA_TOOL_OPTIONS naming egressd's trust store (inspection on) and a credential-free
    proxy port (the JVM sends no credentials on a CONNECT), merged into the user's own options.
    A trust store path with whitespace cannot be said there (the JVM splits the variable at it)."""
    if truststore is not None and not any(c.isspace() for c in truststore):
        env[JAVA_OPTIONS] = java_trust_options(env.get(JAVA_OPTIONS), truststore)
    if proxy is not None:
        env[JAVA_OPTIONS] = java_proxy_options(env.get(JAVA_OPTIONS), proxy)
    return env


def proxy_exports(
    proxy_url: str,
    socks_url: str | None = None,
    *,
    ca_bundle: str | None = None,
    placeholders: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Only the variables egressd sets (for `egressd run`, which prints them as `export` lines)."""
    return child_environment({}, proxy_url, socks_url, ca_bundle=ca_bundle, placeholders=placeholders)
