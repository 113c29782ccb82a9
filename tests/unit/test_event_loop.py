"""The event loop egressd runs on: uvloop, with every task factory made to accept `eager_start`.

Why: on Python 3.13 uvloop calls the loop's task factory with `eager_start=`, and
asyncio.eager_task_factory (set by egressd's proxy thread and by mitmproxy's Master) does not take
it — egressd would not start at all. The compose gateway's image (Python 3.13) runs the real thing;
this is the same check on the interpreter the suite runs on."""

from __future__ import annotations

import asyncio

import uvloop

from egressd.session.proxy import _eager_start_tolerant_loop


def test_a_factory_set_on_the_loop_never_sees_eager_start() -> None:
    loop = _eager_start_tolerant_loop(uvloop.Loop)()
    seen: list[dict[str, object]] = []

    def strict(loop: asyncio.AbstractEventLoop, coro: object, *, name: object = None, context: object = None):
        seen.append({"name": name, "context": context})
        return asyncio.eager_task_factory(loop, coro, name=name, context=context)

    async def main() -> int:
        ran: list[int] = []

        async def step() -> int:
            ran.append(1)
            return 7

        factory = asyncio.get_running_loop().get_task_factory()
        assert factory is not None
        task = factory(asyncio.get_running_loop(), step(), eager_start=None)  # as uvloop calls it on 3.13
        assert ran == [1]  # eager: ran up to its end before the first await
        return await task + await asyncio.create_task(step())

    try:
        loop.set_task_factory(strict)
        assert loop.run_until_complete(main()) == 14
        assert len(seen) >= 2
        loop.set_task_factory(None)
        assert loop.get_task_factory() is None
    finally:
        loop.close()
