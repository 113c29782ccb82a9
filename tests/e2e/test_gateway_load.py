"""Load: the gateway holds 1,000 concurrent clients, each with its own token, and every one's
transfer comes back intact (SHA-256); its memory per idle client is measured (docs/performance.md).

The measurement is bench/gateway.py's (`python -m bench.gateway`), run here with its assertions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gateway import measure

CLIENTS = 1000


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_gateway_holds_1000_clients_with_checked_transfers(tmp_path: Path) -> None:
    result = await measure(tmp_path / "load", CLIENTS, 16384, timeout=120)
    print(f"gateway load: {result}")
    assert result.checked == CLIENTS, result
    assert result.gateway_exit == 0, result
    # a bound that catches a leak per client, not a figure: ~2 sockets and their buffers each
    assert result.rss_per_idle_client_kib < 512, result
