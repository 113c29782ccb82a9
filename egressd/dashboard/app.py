"""The dashboard's routes (aiohttp), imported with its first client: the page, its static files, and a
small JSON API that forwards to the control API — every check in `Dashboard` applied first."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from egressd.dashboard.guard import COOKIE, SAFE_METHODS, SECURITY_HEADERS, SSE_KEEPALIVE, STATIC, sse
from egressd.dashboard.guard import PageGuard as Dashboard
from egressd.dashboard.guard import static_file as _static_file

QUEUE = 1000  # SSE items buffered per page; beyond it they are dropped and counted
BACKLOG = 200  # decisions shown when a page opens (the page keeps as many rows)


def make_app(dash: Dashboard, stop: asyncio.Event) -> web.Application:
    routes = Routes(dash, stop)
    app = web.Application(middlewares=[routes.guard], client_max_size=64 * 1024)
    app.add_routes(
        [
            web.get("/", routes.index),
            web.get("/static/{name}", routes.static),
            web.get("/api/state", routes.state),
            web.get("/api/stream", routes.stream),
            web.post("/api/asks/{id}", routes.answer),
            web.post("/api/grants", routes.grant),
            web.post("/api/grants/{id}/revoke", routes.revoke),
            web.post("/api/policy/rules", routes.edit_rule),
        ]
    )
    app.on_cleanup.append(routes.close)
    return app


def _deny(status: int, message: str) -> web.Response:
    response = web.json_response({"error": message}, status=status)
    response.headers.update(SECURITY_HEADERS)
    return response


class Routes:
    def __init__(self, dash: Dashboard, stop: asyncio.Event) -> None:
        self.dash = dash
        self._stop = stop
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.UnixConnector(path=str(self.dash.control_path))
            self._session = aiohttp.ClientSession(connector=connector, base_url="http://egressd")
        return self._session

    async def close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # -- the guard -------------------------------------------------------------------------------
    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Host (DNS rebinding), then the token, then for state changes same-origin + CSRF."""
        dash = self.dash
        if not dash.host_ok(request.headers.get("Host")):
            return _deny(421, "wrong Host: open the dashboard at the URL egressd printed")
        landing = request.method == "GET" and request.path == "/" and "token" in request.query
        if landing:
            if not dash.token_ok(request.query.get("token")):
                return _deny(403, "wrong token")
            # set the cookie and leave the URL with the token at once (history, Referer)
            response = web.Response(status=303, headers={"Location": "/"})
            response.set_cookie(COOKIE, dash.token, httponly=True, samesite="Strict", path="/")
            response.headers.update(SECURITY_HEADERS)
            return response
        if not dash.token_ok(request.cookies.get(COOKIE)):
            return _deny(401, "no dashboard token: open the URL egressd printed on its stderr")
        if request.method not in SAFE_METHODS:
            if not dash.same_origin(request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site")):
                return _deny(403, "cross-origin request refused")
            if not dash.csrf_ok(request.headers.get("X-CSRF-Token")):
                return _deny(403, "missing or wrong CSRF token")
            if request.content_type != "application/json":
                return _deny(415, "state changes take a JSON body")
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(SECURITY_HEADERS)
            raise
        response.headers.update(SECURITY_HEADERS)
        return response

    # -- the page ----------------------------------------------------------------------------------
    async def index(self, request: web.Request) -> web.Response:
        page = _static_file("index.html").decode().replace("{{csrf}}", html.escape(self.dash.csrf))
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            return _deny(404, "not found")
        return web.Response(body=_static_file(name), content_type=STATIC[name], charset="utf-8")

    # -- reads -------------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any = None) -> web.Response:
        """Forward to the control API; its status and JSON error come back as they are."""
        try:
            async with self.session().request(method, path, json=body) as upstream:
                data = await upstream.json(content_type=None)
                return web.json_response(data, status=upstream.status)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return web.json_response({"error": f"cannot reach egressd: {exc}"}, status=502)

    async def _get(self, path: str) -> Any:
        async with self.session().get(path) as upstream:
            return await upstream.json(content_type=None) if upstream.status < 400 else None

    async def state(self, request: web.Request) -> web.Response:
        try:
            info, asks, grants, policy = await asyncio.gather(
                self._get("/v1/info"),
                self._get("/v1/asks?peek=1"),
                self._get("/v1/grants"),
                self._get("/v1/policy"),
            )
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return web.json_response({"error": f"cannot reach egressd: {exc}"}, status=502)
        return web.json_response(
            {
                "info": info,
                "asks": (asks or {}).get("asks", []),
                "grants": (grants or {}).get("grants", []),
                "policy": policy,
            }
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: every pipeline event and every ask, merged. While a page holds this
        stream open the dashboard follows the asks, so it counts as an approver (the broker's
        `attach(approver=True)` through the control API) — and only then."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE)
        dropped = 0

        def offer(item: dict[str, Any]) -> None:
            nonlocal dropped
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                dropped += 1

        async def pump(path: str, source: str) -> None:
            try:
                async with self.session().get(path, timeout=aiohttp.ClientTimeout(total=None)) as upstream:
                    try:
                        async for raw in upstream.content:
                            with contextlib.suppress(ValueError):
                                item = json.loads(raw)
                                if isinstance(item, dict) and item.get("event") != "keepalive":
                                    offer({**item, "source": source})
                    finally:
                        # close, not release: a connection kept for reuse would leave the control
                        # API believing this page still follows the asks
                        upstream.close()
            except (aiohttp.ClientError, OSError):
                pass
            offer({"event": "gone", "source": source})

        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no", **SECURITY_HEADERS}
        )
        await response.prepare(request)
        pumps = [
            # the recent decisions first: a page opened late is not empty while its counters count
            asyncio.ensure_future(pump(f"/v1/events?backlog={BACKLOG}", "events")),
            asyncio.ensure_future(pump("/v1/asks?follow=1&peek=1", "asks")),
        ]
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await response.write(b"retry: 1000\n\n")
            while not self._stop.is_set():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {getter, stopping}, timeout=SSE_KEEPALIVE, return_when="FIRST_COMPLETED"
                )
                if getter not in done:
                    getter.cancel()
                    if stopping in done:
                        break
                    await response.write(b": keepalive\n\n")
                    continue
                if dropped:
                    await response.write(sse({"event": "dropped", "count": dropped}))
                    dropped = 0
                await response.write(sse(getter.result()))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            stopping.cancel()
            for task in pumps:
                task.cancel()
        return response

    # -- state changes -------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _deny(400, "the body must be a JSON object")
        return body if isinstance(body, dict) else _deny(400, "the body must be a JSON object")

    async def answer(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        ask_id = request.match_info["id"]
        return await self._call(
            "POST",
            f"/v1/asks/{quote(ask_id, safe='')}",
            {"answer": body.get("answer"), "by": "the dashboard"},
        )

    async def grant(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        return await self._call(
            "POST", "/v1/grants", {"target": body.get("target"), "ttl": body.get("ttl", 300), "once": True}
        )

    async def revoke(self, request: web.Request) -> web.Response:
        return await self._call("DELETE", f"/v1/grants/{quote(request.match_info['id'], safe='')}")

    async def edit_rule(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        return await self._call(
            "POST",
            "/v1/policy/rules",
            {"op": body.get("op"), "list": body.get("list"), "rule": body.get("rule")},
        )
