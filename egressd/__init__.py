"""egressd: an egress-filtering forward proxy for child processes."""

__version__ = "0.1.0"
