"""mitmproxy addons of egressd, installed as ``egressd.addons``; see the module docstrings."""
