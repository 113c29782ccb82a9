"""The network I/O the admission pipeline calls: DNS (`dns`, dnspython), the connect to the
pinned addresses only (`pinning`) and the dial through a parent proxy (`parent_proxy`).
"""
