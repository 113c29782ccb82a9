"""`egressd dashboard`: the live web dashboard of a running egressd (attaches like `pending`)."""

from __future__ import annotations

import contextlib

import click

from egressd.cli.instances import call, pid_option, select
from egressd.cli.options import say
from egressd.control.client import ControlClient


@click.command(
    "dashboard",
    epilog="""\b
Example:
  egressd dashboard            # prints the URL (with its secret token) on stderr
  egressd dashboard --open     # and opens it in the browser""",
    short_help="Serve the live web dashboard of a running egressd on loopback.",
)
@pid_option
@click.option("--open", "open_browser", is_flag=True, help="Open the URL in the default browser.")
def dashboard_command(pid: int | None, open_browser: bool) -> None:
    """Serve a web page on a free loopback port showing the decisions of a running egressd as they
    happen, its pending asks (with their answers), grants, policy and per-child counters. The URL
    carries a random token and is printed on stderr only; stop with Ctrl-C. While a page is open,
    asks wait for its answer."""
    import asyncio

    from egressd.dashboard.server import WHILE_OPEN, Dashboard

    client = select(pid)
    call(client, "GET", "/v1/info")  # fail now, with the reason, if it does not answer
    dashboard = Dashboard(client.path, _Registered(client))

    async def serve() -> None:
        url = await dashboard.start()
        say(f"dashboard: {url}  ({WHILE_OPEN})")
        if open_browser:
            import webbrowser

            webbrowser.open(url)
        try:
            while client.path.exists():  # the instance it serves is still there
                await asyncio.sleep(1.0)
        finally:
            await dashboard.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    say("dashboard stopped")


class _Registered:
    """The page's port goes to the running egressd's own addresses, through its control API: its
    children are refused it (`self`) as they are egressd's own ports."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client

    def add_self_address(self, host: str, port: int) -> None:
        call(self.client, "POST", "/v1/listeners", {"host": host, "port": port})
