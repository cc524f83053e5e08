"""The daemon's join yields to a stop (node/daemon/daemon.py, `Daemon._unless_stopped`): a stop
that comes first cancels the join and answers None, whatever the join would have ended with;
a join that ends first answers its own result or raises its own error."""

import asyncio
from types import SimpleNamespace

import pytest

from node.daemon.daemon import Daemon


def run(work_factory):
    """`Daemon._unless_stopped` on a daemon that holds only its stop event."""
    async def main():
        node = SimpleNamespace(stop_event=asyncio.Event())
        return await Daemon._unless_stopped(node, work_factory(node))
    return asyncio.run(main())


def test_a_stop_cancels_the_join_and_answers_none():
    seen = {}

    async def join(node):
        node.stop_event.set()  # the signal comes while the join waits on its peers
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise
    assert run(join) is None and seen == {"cancelled": True}


def test_a_join_that_fails_after_the_stop_is_the_stop_not_an_error():
    async def join(node):
        node.stop_event.set()
        raise RuntimeError("late join failed: its servers left")  # before the wait sees the stop
    assert run(join) is None


def test_a_join_that_ends_first_answers_its_result_or_its_error():
    async def joined(node):
        return 7

    async def failed(node):
        raise RuntimeError("late join failed")
    assert run(joined) == 7
    with pytest.raises(RuntimeError, match="^late join failed$"):
        run(failed)


def test_a_join_done_when_the_stop_comes_keeps_its_result():
    async def join(node):
        node.stop_event.set()
        return 3
    assert run(join) == 3
