"""`egressd sandbox`: run a child whose only way out is egressd's proxy.

Linux: bubblewrap gives the child its own network namespace (only `lo`); egressd relays a Unix
socket to its proxy and an in-sandbox bridge listens on the sandbox's loopback and forwards to
that socket. macOS: a generated Seatbelt profile allows outbound connections to the proxy's
loopback port only. Neither the relay nor the bridge decides anything: every byte reaches the
proxy, and the proxy's one decision function decides.

This package's `__init__` stays import-free: the launcher and bridge run inside the sandbox and
should start fast.
"""

# The in-sandbox loopback ports the bridge listens on (the sandbox has its own, empty loopback).
BRIDGE_HOST = "127.0.0.1"
BRIDGE_HTTP_PORT = 3128
BRIDGE_SOCKS_PORT = 1080
# The proxy without credentials: only the child can reach it (the JVM, Chromium's --proxy-server)
BRIDGE_OPEN_PORT = 3130
# Capture (clients that ignore the proxy variables): the transparent listener and DNS responder.
BRIDGE_CAPTURE_PORT = 3129
BRIDGE_DNS_PORT = 1053
