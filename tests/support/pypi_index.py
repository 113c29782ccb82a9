"""A PEP 503 simple index over HTTPS serving wheels the test generates.

Why: ``pip install`` through egressd's TLS inspection is only proven with the real pip against an index
it accepts, and the tests must not touch the internet. ``/simple/`` lists the projects,
``/simple/<project>/`` links each file as ``/packages/<file>#sha256=<digest>``, ``/packages/<file>``
serves it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import zipfile
from dataclasses import dataclass

import trustme

from tests.support.https_app import AppHTTPSServer, Reply, Request

#: egressd_tiny/__init__.py in the wheel of egressd-tiny 1.0 that the `pypi_index` fixture serves
TINY_INIT = "VALUE = 'installed from the test index'\n"


def normalise(name: str) -> str:
    """PEP 503 project-name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(name: str, version: str, files: dict[str, str]) -> tuple[str, bytes]:
    """A minimal pure-Python wheel: ``files`` plus METADATA, WHEEL and RECORD. Returns (filename, bytes)."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    entries: dict[str, bytes] = {rel: text.encode() for rel, text in files.items()}
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    entries[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: egressd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{rel},{_record_hash(data)},{len(data)}\n" for rel, data in entries.items())
    entries[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in entries.items():
            zf.writestr(rel, data)
    return f"{dist}-{version}-py3-none-any.whl", raw.getvalue()


@dataclass
class Distribution:
    project: str
    filename: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class PypiIndex(AppHTTPSServer):
    """Serves the wheels added with :meth:`add_wheel`."""

    def __init__(self, host: str, *, ca: trustme.CA, hostnames: list[str]) -> None:
        super().__init__(host, ca=ca, hostnames=hostnames, name="pypi-index")
        self.files: dict[str, Distribution] = {}

    def add_wheel(self, name: str, version: str, files: dict[str, str]) -> Distribution:
        filename, data = make_wheel(name, version, files)
        dist = Distribution(normalise(name), filename, data)
        self.files[filename] = dist
        return dist

    def _page(self, title: str, links: list[tuple[str, str]]) -> Reply:
        anchors = "".join(
            f'<a href="{html.escape(href)}">{html.escape(text)}</a><br/>\n' for href, text in links
        )
        body = (
            f"<!DOCTYPE html>\n<html><head><title>{title}</title></head>\n<body>\n{anchors}</body></html>\n"
        )
        return Reply(200, body.encode(), {"Content-Type": "text/html; charset=utf-8"})

    def handle(self, request: Request) -> Reply:
        if request.method not in ("GET", "HEAD"):
            return Reply(405, b"method not allowed\n")
        path = request.path.partition("?")[0]
        projects = sorted({d.project for d in self.files.values()})
        if path == "/simple/":
            return self._page("Simple index", [(f"/simple/{p}/", p) for p in projects])
        match = re.fullmatch(r"/simple/([^/]+)/?", path)
        if match:
            project = normalise(match.group(1))
            if project not in projects:
                return Reply(404, b"no such project\n")
            if project != match.group(1) or not path.endswith("/"):
                return Reply(301, b"", {"Location": f"/simple/{project}/"})
            links = [
                (f"/packages/{d.filename}#sha256={d.sha256}", d.filename)
                for d in self.files.values()
                if d.project == project
            ]
            return self._page(f"Links for {project}", links)
        if path.startswith("/packages/") and path[len("/packages/") :] in self.files:
            dist = self.files[path[len("/packages/") :]]
            return Reply(200, dist.data, {"Content-Type": "application/octet-stream"})
        return Reply(404, b"not found\n")
