"""Watch a policy file and hand every good new version to the running proxy.

Polling (stat + content hash) instead of inotify: it works on every platform, through symlink
swaps (Kubernetes ConfigMaps) and editors' rename-on-save, and a policy file is small. A file
that fails to load is reported and the last good policy stays in force: a typo must never open
or close everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from egressd.policy import Policy, load_policy

Signature = tuple[int, int, int, int]  # (mtime_ns, size, inode, device)


class PolicyWatcher:
    """Reloads `path` when it changes (or on trigger()) and calls on_change / on_error.

    `transform` is applied to every loaded policy (the CLI's --allow/--deny/--mode/--nameserver
    overrides, profile checks); an exception from it counts as a failed load.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[Any], None],
        on_error: Callable[[str], None],
        *,
        interval: float = 0.5,
        env: Mapping[str, str] | None = None,
        transform: Callable[[Policy], Policy] | None = None,
        loader: Callable[[Path], Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.on_change = on_change
        self.on_error = on_error
        self.interval = interval
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.transform = transform
        # another file watched the same way (the gateway's token file): loader(path) instead
        self.loader = loader
        self._signature: Signature | None = None
        self._digest: bytes | None = None
        self._last_error: str | None = None
        self._wake = threading.Event()
        self._forced = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- public --------------------------------------------------------------------------------
    def load(self) -> Policy:
        """Load the file now (the initial load) and remember its version; raises on error."""
        signature, digest = self._snapshot()
        policy = self._load()
        self._signature, self._digest, self._last_error = signature, digest, None
        return policy

    def start(self) -> PolicyWatcher:
        if self._signature is None:
            with contextlib.suppress(OSError):
                self._signature, self._digest = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="egressd-policy-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def trigger(self) -> None:
        """Reload at once even if the file looks unchanged (SIGHUP). Safe from a signal handler."""
        self._forced = True
        self._wake.set()

    def poll(self, force: bool = False) -> bool:
        """Check once; return True if a new policy was handed to on_change."""
        with self._lock:
            return self._poll(force)

    # -- internals -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            force, self._forced = self._forced, False
            try:
                self.poll(force)
            except Exception as exc:  # the watcher must outlive any surprise
                self._report(f"{self.path}: {exc}", force=True)

    def _poll(self, force: bool) -> bool:
        try:
            signature, digest = self._snapshot()
        except OSError as exc:
            self._report(f"{self.path}: {exc.strerror or exc}", force)
            self._signature = self._digest = None
            return False
        if not force and signature == self._signature and digest == self._digest:
            return False
        self._signature = signature
        if not force and digest == self._digest:
            return False  # touched, not changed
        try:
            policy = self._load()
        except Exception as exc:
            self._digest = digest  # report this version once; retry when it changes again
            self._report(str(exc) or type(exc).__name__, force)
            return False
        self._digest, self._last_error = digest, None
        try:
            self.on_change(policy)
        except Exception as exc:
            self._report(f"applying the new policy failed: {exc}", force=True)
            return False
        return True

    def _load(self) -> Any:
        if self.loader is not None:
            return self.loader(self.path)
        policy = load_policy(self.path, env=self.env)
        return self.transform(policy) if self.transform else policy

    def _snapshot(self) -> tuple[Signature, bytes]:
        st = os.stat(self.path)
        digest = hashlib.sha256(self.path.read_bytes()).digest()
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev), digest

    def _report(self, message: str, force: bool) -> None:
        if message == self._last_error and not force:
            return
        self._last_error = message
        with contextlib.suppress(Exception):
            self.on_error(message)
