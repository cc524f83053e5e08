"""The virtual-time loop the exchange and membership unit tests run on (tests/virtual_time.py)."""

import asyncio
import threading

import pytest

from tests.virtual_time import run


def test_timers_fire_in_order_at_their_virtual_times_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        loop.call_later(3600.0, lambda: fired.append(("hour", loop.time())))
        loop.call_later(10.0, lambda: fired.append(("ten", loop.time())))
        await asyncio.sleep(7200.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30.0)
        return fired, loop.time()
    fired, now = run(main())
    assert fired == [("ten", 10.0), ("hour", 3600.0)] and now == 7230.0


def test_a_threads_result_is_not_skipped_past_by_a_virtual_timeout():
    """While a thread works, virtual time does not move: a 5 s virtual bound on a thread that
    takes a few milliseconds is not lapsed at once."""
    release = threading.Event()

    def work() -> str:
        release.wait(2.0)
        return "done"

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_soon(release.set)
        return await asyncio.wait_for(loop.run_in_executor(None, work), 5.0)
    assert run(main()) == "done"
