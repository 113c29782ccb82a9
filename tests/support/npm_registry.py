"""A tiny npm registry over HTTPS: packuments and tarballs of packages the test generates.

Why: ``npm install`` through egressd's TLS inspection is only proven with the real npm client against
a registry it accepts, and the tests must not touch the internet. The registry speaks just enough of the
protocol for ``npm install``: ``GET /<name>`` answers the packument (every version with its ``dist``
tarball URL, ``integrity`` and ``shasum``), ``GET /<name>/-/<name>-<version>.tgz`` the tarball.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import trustme

from tests.support.https_app import AppHTTPSServer, Reply, Request


def npm_tarball(manifest: dict[str, Any], files: dict[str, str]) -> bytes:
    """A package tarball as npm publishes it: a gzipped tar with everything under ``package/``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        entries = {"package.json": json.dumps(manifest, indent=2) + "\n", **files}
        for rel, text in entries.items():
            data = text.encode()
            info = tarfile.TarInfo(f"package/{rel}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


@dataclass
class NpmPackage:
    name: str
    version: str
    manifest: dict[str, Any]
    tarball: bytes

    @property
    def tarball_path(self) -> str:
        return f"/{self.name}/-/{self.name}-{self.version}.tgz"

    @property
    def integrity(self) -> str:
        return "sha512-" + base64.b64encode(hashlib.sha512(self.tarball).digest()).decode()

    @property
    def shasum(self) -> str:
        return hashlib.sha1(self.tarball).hexdigest()


class NpmRegistry(AppHTTPSServer):
    """Serves the packages added with :meth:`add`; unknown names get 404 like the real registry."""

    def __init__(self, host: str, *, ca: trustme.CA, hostnames: list[str]) -> None:
        super().__init__(host, ca=ca, hostnames=hostnames, name="npm-registry")
        self.packages: dict[str, dict[str, NpmPackage]] = {}

    def add(
        self,
        name: str,
        version: str = "1.0.0",
        *,
        dependencies: dict[str, str] | None = None,
        files: dict[str, str] | None = None,
    ) -> NpmPackage:
        """Generate a package (``index.js`` exporting its name and version unless ``files`` says else)."""
        manifest: dict[str, Any] = {"name": name, "version": version, "main": "index.js"}
        if dependencies:
            manifest["dependencies"] = dependencies
        if files is None:
            files = {"index.js": f"module.exports = {json.dumps(f'{name}@{version}')};\n"}
        package = NpmPackage(name, version, manifest, npm_tarball(manifest, files))
        self.packages.setdefault(name, {})[version] = package
        return package

    def packument(self, name: str) -> dict[str, Any]:
        versions = self.packages[name]
        latest = max(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
        return {
            "name": name,
            "dist-tags": {"latest": latest},
            "versions": {
                version: {
                    **package.manifest,
                    "dist": {
                        "tarball": self.base_url + package.tarball_path,
                        "integrity": package.integrity,
                        "shasum": package.shasum,
                    },
                }
                for version, package in versions.items()
            },
        }

    def handle(self, request: Request) -> Reply:
        if request.method not in ("GET", "HEAD"):
            return Reply(405, b"method not allowed\n")
        path = unquote(request.path.partition("?")[0])
        name, sep, rest = path.lstrip("/").partition("/-/")
        if name not in self.packages:
            return Reply(404, b'{"error":"Not found"}', {"Content-Type": "application/json"})
        if not sep:
            body = json.dumps(self.packument(name)).encode()
            return Reply(200, body, {"Content-Type": "application/json"})
        for package in self.packages[name].values():
            if package.tarball_path == path:
                return Reply(200, package.tarball, {"Content-Type": "application/octet-stream"})
        return Reply(404, b'{"error":"Not found"}', {"Content-Type": "application/json"})
