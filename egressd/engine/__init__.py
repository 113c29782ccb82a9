"""The proxy engine: mitmproxy embedded, every connection decided by egressd.policy."""

from egressd.engine.credentials import ProxyCredentials
from egressd.engine.proxy import EgressProxy, EngineError

__all__ = ["EgressProxy", "EngineError", "ProxyCredentials"]
