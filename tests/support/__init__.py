"""Test-support code for egressd's integration tests.

Everything here runs real servers (DNS, HTTP, HTTPS, TCP) on addresses that exist only inside the
network namespace the test session enters in ``tests/conftest.py`` (see :mod:`tests.support.netns`),
so nothing a test sends, allowed or refused, can leave the machine.
"""
