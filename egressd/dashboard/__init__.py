"""The live dashboard: a loopback web page over one egressd's control API (docs/dashboard.md)."""
