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


def test_a_node_that_ended_its_schedule_lets_its_last_messages_arrive_and_a_stopped_one_does_not(
        tmp_path):
    """The 512 kbit/s run R13: a node that ended its 100 steps gave its last push 2.5 s (half a
    leave step) and cut it at 260 of 411 KB; the member receiving it waited 16 s and left it out.
    With no stop asked, leaving waits up to leave_drain_s for the transfers in flight; a stop
    request (a signal, a preemption notice) keeps to half a step."""
    import types

    from node.config.settings import NodeTimeouts
    from node.daemon.leave import leave

    async def scenario(stop_asked: bool) -> bool:
        tasks = BackgroundTasks()
        timeouts = NodeTimeouts(leave_step_s=0.2, leave_drain_s=5.0)
        node = types.SimpleNamespace(
            network=types.SimpleNamespace(exchange=None, cache=None, membership=None,
                                          transport=None, host=None),
            settings=types.SimpleNamespace(timeouts=timeouts), stop_event=asyncio.Event(),
            tasks=tasks, data_dir=types.SimpleNamespace(address=tmp_path / "address"),
            events=types.SimpleNamespace(publish=lambda event: None))
        if stop_asked:
            node.stop_event.set()
        push = tasks.spawn(asyncio.sleep(0.6), "dilocox send of round 19", transfer=True)
        await asyncio.wait_for(leave(node), 10.0)
        return push.done() and not push.cancelled()

    assert asyncio.run(scenario(stop_asked=False)) is True  # 0.6 s: well past half a step
    assert asyncio.run(scenario(stop_asked=True)) is False  # cancelled at the end of leaving
