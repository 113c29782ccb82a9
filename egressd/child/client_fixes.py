"""Fixes for clients that need more than the proxy and CA variables, worked out from the machine.

`child_env` says what every child gets; this module looks at what is installed, once per process:
- node: `NODE_USE_ENV_PROXY=1` makes Node 22.21+/24.5+ print an "experimental" warning
  (UNDICI-EHPA) on every run, which corrupts tools that parse stderr and alarms users. The child's
  node gets `--disable-warning=UNDICI-EHPA` in NODE_OPTIONS (the user's options kept), but only when
  that node accepts the flag (20.11+, 21.3+, 22+): an older node refuses to start on an unknown
  NODE_OPTIONS flag, which would break every node program the child runs.
- wget: it reads neither SSL_CERT_FILE nor the other CA variables, only `ca_certificate` in a
  wgetrc. Under inspection the child gets WGETRC naming a file that holds the user's own wgetrc
  (the one WGETRC named, else ~/.wgetrc) followed by `ca_certificate = <egressd's bundle>`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

NODE_WARNING_FLAG = "--disable-warning=UNDICI-EHPA"
_WGETRC_MAX = 1 << 20
_NODE_VERSION = re.compile(r"v(\d+)\.(\d+)\.(\d+)")
NodeVersion = tuple[int, int, int] | None


class _Asked:
    """A node's version, once asked: a second asker waits for the first's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.version: NodeVersion = None
        self.error: BaseException | None = None

    def result(self) -> NodeVersion:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.version


# by node binary: its version, once asked
_versions: dict[tuple[str, int, int, str], _Asked] = {}
_versions_lock = threading.Lock()


def node_supports_disable_warning(version: tuple[int, int, int] | None) -> bool:
    """`--disable-warning` exists (and is allowed in NODE_OPTIONS) from 20.11.0 and 21.3.0 on."""
    if version is None:
        return False
    major, minor, _ = version
    return major >= 22 or (major == 21 and minor >= 3) or (major == 20 and minor >= 11)


def node_version(env: Mapping[str, str]) -> NodeVersion:
    """The version of the `node` the child's PATH finds, asked with the child's environment (version
    managers' shims need it) and cached by binary, size, mtime and directory (a shim may pick another
    version elsewhere); None when there is none or it does not answer `--version` plainly."""
    path = env.get("PATH")
    found = shutil.which("node", path=path) if path else None
    if found is None:
        return None
    try:
        info = os.stat(found)
        key = (os.path.realpath(found), info.st_size, info.st_mtime_ns, os.getcwd())
    except OSError:
        return None
    with _versions_lock:
        asked = _versions.get(key)
        if asked is None:
            asked = _versions[key] = _Asked()
            ours = True
        else:
            ours = False
    if ours:
        try:
            asked.version = _ask_version(found, env)
        except BaseException as exc:
            asked.error = exc
            raise
        finally:
            asked.done.set()
    return asked.result()


def _ask_version(node: str, env: Mapping[str, str]) -> NodeVersion:
    probe_env = {k: v for k, v in env.items() if k != "NODE_OPTIONS"}
    # stdin never the child's: it may be an editor's JSON-RPC stream
    try:
        done = subprocess.run(
            [node, "--version"], env=probe_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = _NODE_VERSION.fullmatch(done.stdout.decode("ascii", "replace").strip())
    return (int(match[1]), int(match[2]), int(match[3])) if done.returncode == 0 and match else None


def ask_node_version(env: Mapping[str, str]) -> None:
    """Ask the version of the child's node now, in a thread of its own, for the child's
    environment built later from the same `env` (node starts slowly: its answer comes while the
    proxy starts)."""
    threading.Thread(target=node_version, args=(dict(env),), name="egressd-node-version", daemon=True).start()


def node_options(current: str | None, version: tuple[int, int, int] | None) -> str | None:
    """NODE_OPTIONS with the warning flag added where `version` accepts it; None: leave it as is."""
    if not node_supports_disable_warning(version):
        return None
    if current and NODE_WARNING_FLAG in current.split():
        return None
    return f"{current} {NODE_WARNING_FLAG}" if current and current.strip() else NODE_WARNING_FLAG


def _user_wgetrc(base: Mapping[str, str]) -> str:
    """What wget would read as the user's startup file: $WGETRC, else ~/.wgetrc ("" when none)."""
    given = base.get("WGETRC")
    home = base.get("HOME")
    path = Path(given) if given else (Path(home) / ".wgetrc" if home else None)
    if path is None:
        return ""
    try:  # a regular file of sane size only: never block on a FIFO or read a device
        if not path.is_file() or path.stat().st_size > _WGETRC_MAX:
            return ""
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def wgetrc_text(user: str, ca_bundle: str) -> str:
    """The user's wgetrc, then egressd's CA bundle (wget: a later setting wins)."""
    head = user if not user or user.endswith("\n") else user + "\n"
    note = "# egressd: the CA bundle with egressd's inspection CA (wget ignores SSL_CERT_FILE)"
    return f"{head}{note}\nca_certificate = {ca_bundle}\n"


def write_wgetrc(base: Mapping[str, str], ca_bundle: str) -> str | None:
    """A wgetrc beside the CA bundle (named by its content, private to the user); its path, or
    None when it cannot be written (wget then fails verification as it would have anyway)."""
    text = wgetrc_text(_user_wgetrc(base), ca_bundle)
    name = "wgetrc-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(ca_bundle).parent / name
    try:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            from egressd.platform.files import replace_atomically

            replace_atomically(path, text, mode=0o600)
    except OSError:
        return None
    return str(path)


def client_fixes(base: Mapping[str, str], env: Mapping[str, str], ca_bundle: str | None) -> dict[str, str]:
    """The variables to add to a child's `env` (built from `base`) for node and wget."""
    extra: dict[str, str] = {}
    options = node_options(env.get("NODE_OPTIONS"), node_version(env))
    if options is not None:
        extra["NODE_OPTIONS"] = options
    if ca_bundle is not None:
        wgetrc = write_wgetrc(base, ca_bundle)
        if wgetrc is not None:
            extra["WGETRC"] = wgetrc
    return extra
