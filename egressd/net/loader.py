"""The resolver (egressd.net.dns: dnspython, and what its lookups would import on first use),
loaded at start in a thread of its own while the child starts.

Why at start: an import at the first lookup could meet a process out of file descriptors and
fail, and it would hold up the event loop. Why in a thread: the child waits for nothing of it. A
lookup that comes before the load is done waits for it. This module is light on purpose: the
proxy starts the load before its own pipeline is loaded (egressd.session.proxy).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import concurrent.futures

_resolver: ModuleType | None = None  # egressd.net.dns, once loaded
_loading: concurrent.futures.Future[ModuleType] | None = None
_load_lock = threading.Lock()


def load_resolver() -> concurrent.futures.Future[ModuleType]:
    """Load the resolver in a thread of its own, once (again after a load that failed)."""
    global _loading
    import concurrent.futures  # here: this module is imported before the child starts

    with _load_lock:
        if _loading is None or (_loading.done() and _loading.exception() is not None):
            _loading = concurrent.futures.Future()
            threading.Thread(target=_load, args=(_loading,), name="egressd-load", daemon=True).start()
        return _loading


def _load(done: concurrent.futures.Future[ModuleType]) -> None:
    global _resolver
    try:
        from egressd.net import dns as resolver

        resolver.load()
    except BaseException as exc:  # noqa: BLE001 - handed to the lookups that wait
        done.set_exception(exc)
        return
    _resolver = resolver
    done.set_result(resolver)


def loaded() -> ModuleType | None:
    """The resolver module if its load is done, else None."""
    return _resolver


async def resolver_module() -> ModuleType:
    """The resolver module, once loaded (waits for the load started at start)."""
    import asyncio  # loaded with the proxy's loop, which runs this

    return _resolver if _resolver is not None else await asyncio.wrap_future(load_resolver())
