"""`egressd sandbox`: run a child whose only way out is egressd's proxy.

Linux: bubblewrap gives the child its own network namespace (only `lo`); the launcher binds the
proxy's listeners on the sandbox's loopback and hands them to egressd, whose proxy accepts the
child's connections there; connections that ignore the proxy are captured and sent to it as
CONNECTs. macOS: a generated Seatbelt profile allows outbound connections to the proxy's loopback
ports only. Nothing in the sandbox decides anything: the proxy's one decision function decides.

This package's `__init__` stays import-free: the launcher and capture run inside the sandbox
and should start fast.
"""

# The in-sandbox loopback ports of the proxy's listeners (the sandbox has its own, empty loopback).
BRIDGE_HOST = "127.0.0.1"
BRIDGE_HTTP_PORT = 3128
BRIDGE_SOCKS_PORT = 1080
# The proxy without credentials: only the child can reach it (the JVM, Chromium's --proxy-server)
BRIDGE_OPEN_PORT = 3130
# Capture (clients that ignore the proxy variables): the transparent listener and DNS responder.
BRIDGE_CAPTURE_PORT = 3129
BRIDGE_DNS_PORT = 1053
# The source address of the bridge's own connections to the sandbox's loopback: the capture never
# redirects them (a child that uses it too reaches only the sandbox's own loopback).
BRIDGE_SOURCE = "127.255.255.254"
# egressd's one setup line to the launcher, once it set up the namespace's network from outside
SETUP_CAPTURE = "capture"  # the capture is installed
SETUP_NO_CAPTURE = "no-capture"  # ... it is not (or was not asked for)
