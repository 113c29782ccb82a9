"""egressd's own certificate authority for TLS inspection, and the trust bundles built from it.

The CA key lives in `<config>/ca/` (directory 0700, key 0600), never in mitmproxy's default folder
and never next to the bundle a child is pointed at: children get `<config>/public/ca-bundle.pem`
(the system roots plus egressd's CA certificate), a folder with no key in it. The JVM reads no
CA-bundle variable and no PEM trust store, so the same certificates are also written as a Java
KeyStore, `<config>/public/ca-bundle.jks` (certificates only, no key).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from egressd.platform.files import replace_atomically

# mitmproxy's TlsConfig looks for "<confdir>/mitmproxy-ca.pem"; egressd points confdir at its CA dir
MITMPROXY_BASENAME = "mitmproxy"
KEY_SIZE = 2048


class CAError(Exception):
    """The CA cannot be created or read (permissions, a broken file); the message says why."""


def config_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("EGRESSD_HOME"):
        return Path(env["EGRESSD_HOME"])
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "egressd"


def ca_dir(config: Path) -> Path:
    return config / "ca"


def public_dir(config: Path) -> Path:
    return config / "public"


def ca_cert_path(config: Path) -> Path:
    """The CA certificate alone (no key), for users to inspect or trust."""
    return public_dir(config) / "egressd-ca-cert.pem"


def bundle_path(config: Path) -> Path:
    return public_dir(config) / "ca-bundle.pem"


def java_truststore_path(bundle: str | os.PathLike[str]) -> Path:
    """The Java KeyStore written next to a CA bundle."""
    return Path(bundle).with_suffix(".jks")


# The JKS integrity digest: SHA-1 over the password (UTF-16BE), this phrase and the store.
_JKS_WHITENER = b"Mighty Aphrodite"
JKS_PASSWORD = "changeit"  # Java's customary trust-store password; the store holds no secret
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def java_truststore(pem: bytes, now: float | None = None) -> bytes:
    """Every certificate of a PEM bundle as trusted-certificate entries of a JKS key store (the JVM
    reads it with javax.net.ssl.trustStore; Java 8+ reads JKS whatever its default store type)."""
    import ssl  # here: what only looks up this module's paths (a sandbox's start) never loads it

    certs = [ssl.PEM_cert_to_DER_cert(block.decode("ascii")) for block in _PEM_CERT.findall(pem)]
    stamp = int((time.time() if now is None else now) * 1000)
    out = struct.pack(">IIi", 0xFEEDFEED, 2, len(certs))
    for index, der in enumerate(certs):
        alias = f"egressd-{index}".encode()
        out += struct.pack(">iH", 2, len(alias)) + alias + struct.pack(">qH", stamp, 5) + b"X.509"
        out += struct.pack(">i", len(der)) + der
    return out + hashlib.sha1(JKS_PASSWORD.encode("utf-16-be") + _JKS_WHITENER + out).digest()


def system_roots() -> Path | None:
    """The system's CA bundle file, or None when none can be found."""
    import ssl

    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    try:
        import certifi

        return Path(certifi.where())
    except ImportError:  # pragma: no cover - certifi comes with mitmproxy
        return None


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _chmod_if_needed(path, 0o700)


def _chmod_if_needed(path: Path, mode: int) -> None:
    """chmod only when the mode differs: a CA directory mounted read-only (a gateway container)
    is usable as it is, and chmod there fails even when it would change nothing."""
    if os.stat(path).st_mode & 0o7777 != mode:
        os.chmod(path, mode)


def ensure_ca(config: Path) -> Path:
    """Create the CA on first need; returns the path of the public CA certificate."""
    from mitmproxy import certs

    key_dir = ca_dir(config)
    key_file = key_dir / f"{MITMPROXY_BASENAME}-ca.pem"
    try:
        config.mkdir(parents=True, exist_ok=True, mode=0o700)
        _private_dir(key_dir)
        if not key_file.exists():
            certs.CertStore.create_store(
                key_dir, MITMPROXY_BASENAME, KEY_SIZE, organization="egressd", cn="egressd inspection CA"
            )
        for secret in key_dir.iterdir():
            _chmod_if_needed(secret, 0o600)
        cert_pem = (key_dir / f"{MITMPROXY_BASENAME}-ca-cert.pem").read_bytes()
        public = public_dir(config)
        public.mkdir(parents=True, exist_ok=True, mode=0o755)
        replace_atomically(ca_cert_path(config), cert_pem, mode=0o644)
        roots = system_roots()
        system = roots.read_bytes() if roots else b""
        bundle = _join_pem(system, cert_pem)
        replace_atomically(bundle_path(config), bundle, mode=0o644)
        replace_atomically(java_truststore_path(bundle_path(config)), java_truststore(bundle), mode=0o644)
    except OSError as exc:
        raise CAError(f"cannot set up egressd's CA in {config}: {exc.strerror or exc}") from exc
    return ca_cert_path(config)


def rotate_ca(config: Path) -> Path:
    """Replace the CA (a new key and certificate); children started afterwards trust only the new one."""
    key_dir = ca_dir(config)
    if key_dir.exists():
        shutil.rmtree(key_dir)
    return ensure_ca(config)


def own_work_dir(config: Path) -> Path:
    """A fresh 0700 directory in egressd's home for the files it makes while it runs (the roots
    mitmproxy verifies upstream servers against, a refusal page's key): the sandbox hides the home,
    so a child cannot change them, as it could anywhere in $TMPDIR."""
    top = config / "tmp"
    top.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix="run-", dir=top))


def remove_work_dir(directory: Path) -> None:
    """own_work_dir's directory and the plain files egressd left in it (nothing else goes there)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        os.rmdir(directory)


def upstream_trust_file(extra: Sequence[str | os.PathLike[str]], directory: Path) -> Path:
    """The roots upstream certificates are verified against: system roots plus --upstream-ca files."""
    roots = system_roots()
    parts = [roots.read_bytes()] if roots else []
    for path in extra:
        try:
            parts.append(Path(path).read_bytes())
        except OSError as exc:
            raise CAError(f"--upstream-ca {path}: {exc.strerror or exc}") from exc
    target = directory / "upstream-roots.pem"
    replace_atomically(target, _join_pem(*parts), mode=0o644)
    return target


def _join_pem(*parts: bytes) -> bytes:
    return b"\n".join(p.rstrip(b"\n") for p in parts if p.strip()) + b"\n"
