"""The training thread's calls into the event loop (node/loop.py LoopBridge): a call whose wait
is bounded on the loop's side (`wait_s=None`: a swap that ends by its progress) may take as long
as that wait, while the loop answers; a loop that stops answering still fails it, in one sentence."""

import asyncio
import threading

import pytest

from node.loop import BackgroundTasks, LoopBridge


def started_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def stop(loop, thread):
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_an_open_ended_wait_outlasts_the_bridges_timeout_while_the_loop_answers():
    loop, thread = started_loop()
    try:
        bridge = LoopBridge(loop, BackgroundTasks(lambda event: None), timeout_s=0.1)
        assert bridge.call("a long swap", asyncio.sleep, 0.5, "landed", wait_s=None) == "landed"
        with pytest.raises(RuntimeError, match="did not answer a bounded wait within 0 s"):
            bridge.call("a bounded wait", asyncio.sleep, 0.5, wait_s=0.0)
    finally:
        stop(loop, thread)


def test_an_open_ended_wait_fails_once_the_loop_stops_answering():
    loop, thread = started_loop()
    try:
        bridge = LoopBridge(loop, BackgroundTasks(lambda event: None), timeout_s=0.1)
        unblock = threading.Event()
        loop.call_soon_threadsafe(unblock.wait)  # the loop is stuck in a blocking call
        with pytest.raises(RuntimeError, match="did not answer a long swap within 0 s: it is stalled"):
            bridge.call("a long swap", asyncio.sleep, 0.5, wait_s=None)
        unblock.set()
    finally:
        stop(loop, thread)
