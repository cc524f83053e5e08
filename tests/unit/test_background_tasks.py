"""node/loop.py BackgroundTasks: failures counted and published, transfers let finish at leaving."""

import asyncio

from node.loop import BackgroundTasks


def test_a_failed_task_is_counted_and_published_and_a_cancelled_one_is_not():
    published = []

    async def scenario():
        tasks = BackgroundTasks(published.append)

        async def fail():
            raise ValueError("bad frame")
        failing = tasks.spawn(fail(), "decoder")
        waiting = tasks.spawn(asyncio.Event().wait(), "idle")
        await asyncio.wait([failing])
        await tasks.stop(1.0)
        return tasks, waiting

    tasks, waiting = asyncio.run(scenario())
    assert waiting.cancelled()
    assert tasks.failures == {"decoder": 1}
    assert [(e.task, e.error) for e in published] == [("decoder", "ValueError: bad frame")]


def test_leaving_waits_for_transfers_in_flight_but_not_for_other_tasks():
    async def scenario():
        tasks = BackgroundTasks()
        release = asyncio.Event()

        async def send():
            await release.wait()
            return "arrived"
        transfer = tasks.spawn(send(), "swap", transfer=True)
        idle = tasks.spawn(asyncio.Event().wait(), "matchmaker")  # never ends by itself
        asyncio.get_running_loop().call_later(0.05, release.set)
        await asyncio.wait_for(tasks.finish_transfers(10.0), 5.0)
        done = transfer.done() and transfer.result() == "arrived"
        # a transfer that never ends costs the timeout, not more, and is not cancelled by it
        stuck = tasks.spawn(asyncio.Event().wait(), "stuck send", transfer=True)
        await asyncio.wait_for(tasks.finish_transfers(0.05), 5.0)
        stuck_running = not stuck.done()
        await tasks.stop(1.0)
        return done, idle.cancelled(), stuck_running

    assert asyncio.run(scenario()) == (True, True, True)
