"""Revoked credentials leave nothing behind in the pipeline.

A token is issued per child, and `egressd exec --attach` issues one for every child an agent host
starts: whatever the pipeline keeps per token (the rate limit's bucket, the child's pid) must go
when the token is revoked, or a long-running egressd grows with every child it ever served.
"""

from __future__ import annotations

from egressd.admission.in_force import PolicyHolder
from egressd.admission.pipeline import Attempt, Pipeline
from egressd.policy import parse_policy
from egressd.policy.refusal import Refusal
from egressd.wire.connect_client import basic

POLICY = parse_policy({"version": 1, "limits": {"requests_per_second": 1, "burst": 1}}, "p.yaml")


async def test_a_revoked_childs_rate_limit_bucket_is_dropped() -> None:
    pipeline = Pipeline(PolicyHolder(POLICY))
    kept = pipeline.credentials.issue()
    children = [pipeline.credentials.issue(label=f"curl[{pid}]") for pid in range(100, 150)]
    for creds in [kept, *children]:
        conn = pipeline.open_conn("127.0.0.1:40000")
        attempt = Attempt("connect", "refused.test", 443, credentials=basic(creds.username, creds.token))
        answer = await pipeline.admit(conn, attempt)
        assert isinstance(answer, Refusal) and answer.reason == "not_allowlisted"  # its token was taken
        pipeline.close_conn(conn)
    for creds in children:
        pipeline.revoke(creds)
    assert set(pipeline.limits.buckets._buckets) == {kept.token}  # the one still issued
    conn = pipeline.open_conn("127.0.0.1:40001")
    attempt = Attempt(
        "connect", "refused.test", 443, credentials=basic(children[0].username, children[0].token)
    )
    answer = await pipeline.admit(conn, attempt)
    assert isinstance(answer, Refusal) and answer.reason == "proxy_auth_required"
    assert set(pipeline.limits.buckets._buckets) == {kept.token}
