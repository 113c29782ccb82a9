"""The control API: how the user (and any UI) talks to a running egressd.

Every egressd that runs a child serves HTTP + JSON on a Unix socket only its user can open
(`paths.py`: the run directory, 0700, and the socket, 0600); `server.py` serves it, `client.py` is
what the `ps`, `pending`, `approve`, `deny`, `grant` and `watch` commands use, and `prompt.py` is
the terminal approver on /dev/tty. The API is documented in docs/control-api.md.
"""
